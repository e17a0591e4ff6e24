"""Muon for the matrices and AdamW for every other parameter, in one optimizer, correct under
ZeRO.

[Note: Muon's update, as torch.optim.Muon computes it]
Per matrix ``W`` with gradient ``G`` and momentum buffer ``B``::

    B = B.lerp(G, 1 - momentum)
    U = G.lerp(B, momentum) if nesterov else B
    O = NS(U)                           # Newton-Schulz orthogonalization of the whole matrix
    W = W * (1 - lr * weight_decay) - adjusted_lr * O

``NS`` runs ``ns_steps`` quintic iterations in bf16 on ``U / ||U||`` (transposed when it has
more rows than columns); ``adjusted_lr`` is ``lr * sqrt(max(1, rows / cols))`` ("original") or
``0.2 * lr * sqrt(max(rows, cols))`` ("match_rms_adamw"). Every other parameter (vectors,
norms, biases) takes AdamW with its own ``adamw_*`` hyper-parameters.

[Note: whole matrices under ZeRO]
``NS`` needs the whole matrix; under ZeRO a rank holds pieces of it. Everything but ``NS`` is
elementwise, so each rank updates its momentum pieces and its weight pieces itself.
``WholeMatrices`` gathers the updates ``U`` chunk by chunk: each rank writes its pieces into a
zero buffer of the chunk's matrices and one all-reduce sums them (every element has one
writer, so the sum is exact). Each matrix of the chunk is orthogonalized by one rank (the
least loaded so far, the same choice on every rank), which writes ``O`` into a second zero
buffer, and a second all-reduce hands every rank its pieces of ``O``. The update is then the
one-process update, the work of ``NS`` is spread over the ranks, and at most one chunk of
whole matrices is held at a time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch.optim.optimizer import ParamsT

from .adam import closure_loss

__all__ = ["Muon", "NeedsWholeMatrices", "WholeMatrices", "newton_schulz"]

_Group = dict[str, Any]  # a torch param group (untyped in torch)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    update: torch.Tensor, coefficients: Sequence[float], steps: int, eps: float
) -> torch.Tensor:
    """The orthogonalized ``update`` (a matrix) by ``steps`` quintic Newton-Schulz iterations
    in bf16, as torch.optim.Muon computes it.

    Args:
        update: the matrix.
        coefficients: the quintic's ``(a, b, c)``.
        steps: iterations.
        eps: the smallest norm divided by.
    """
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, how: str | None, shape: Sequence[int]) -> float:
    """Muon's learning rate for a matrix of ``shape`` (see the module note)."""
    rows, cols = shape[0], shape[1]
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if how in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    return lr


@dataclass(frozen=True)
class _Matrix:
    shape: tuple[int, int]
    numel: int
    piece: tuple[int, int] | None  # (start, length) of this rank's piece, if any


class WholeMatrices:
    """Orthogonalizes the updates of matrices whose pieces are spread over ranks (the note).

    Args:
        matrices: every Muon matrix in the same order on every rank, as ``(shape, piece)``
            with this rank's ``(start, length)`` or None.
        keys: ``id`` of each piece tensor this rank steps, to its matrix's index.
        all_reduce: sums a tensor over the ranks holding the pieces.
        rank: this rank among them; ``world``: how many.
        chunk: the most elements of whole matrices held at once.
    """

    def __init__(
        self,
        matrices: Sequence[tuple[Sequence[int], tuple[int, int] | None]],
        keys: dict[int, int],
        all_reduce: Callable[[torch.Tensor], object],
        rank: int,
        world: int,
        chunk: int,
    ) -> None:
        self.matrices = [
            _Matrix((int(s[0]), int(s[1])), int(s[0]) * int(s[1]), p) for s, p in matrices
        ]
        self.keys = keys
        self.all_reduce = all_reduce
        self.rank, self.world = rank, world
        self.chunk = max(1, chunk)

    def shape_of(self, t: torch.Tensor) -> tuple[int, int]:
        return self.matrices[self.keys[id(t)]].shape

    def orthogonalize(
        self, updates: dict[int, torch.Tensor], ns: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """``O`` pieces for this rank's ``updates`` (by ``id`` of the piece tensor).

        Collective: every rank calls it once per step, with whatever pieces it has.

        Args:
            updates: this rank's update pieces, by ``id`` of the tensor they update.
            ns: the orthogonalization of one whole matrix.
        """
        mine = {self.keys[k]: (k, u) for k, u in updates.items()}
        out: dict[int, torch.Tensor] = {}
        load = [0] * self.world
        for run in self._runs():
            sizes = [self.matrices[m].numel for m in run]
            total = sum(sizes)
            # one extra element per matrix: whether any rank has its update (a gradient)
            flat = torch.zeros(total + len(run), dtype=torch.float32)
            offsets = [0, *itertools.accumulate(sizes)][:-1]
            for j, m in enumerate(run):
                if m in mine:
                    start, length = self.matrices[m].piece or (0, 0)
                    at = offsets[j] + start
                    flat[at : at + length] = mine[m][1].reshape(-1)
                    flat[total + j] = 1.0
            self.all_reduce(flat)
            result = torch.zeros(total, dtype=torch.float32)
            for j, m in enumerate(run):
                owner = min(range(self.world), key=lambda r: (load[r], r))
                load[owner] += sizes[j]
                if owner == self.rank and flat[total + j] > 0:
                    whole = flat[offsets[j] : offsets[j] + sizes[j]].view(self.matrices[m].shape)
                    result[offsets[j] : offsets[j] + sizes[j]] = ns(whole).float().reshape(-1)
            self.all_reduce(result)
            for j, m in enumerate(run):
                if m in mine:
                    start, length = self.matrices[m].piece or (0, 0)
                    key, u = mine[m]
                    piece = result[offsets[j] + start : offsets[j] + start + length]
                    out[key] = piece.view(u.shape).to(u.dtype)
        return out

    def _runs(self) -> list[list[int]]:
        runs: list[list[int]] = [[]]
        size = 0
        for m, matrix in enumerate(self.matrices):
            if runs[-1] and size + matrix.numel > self.chunk:
                runs.append([])
                size = 0
            runs[-1].append(m)
            size += matrix.numel
        return [r for r in runs if r]


@runtime_checkable
class NeedsWholeMatrices(Protocol):
    """An optimizer whose update needs whole matrices (Muon); a sharding wrapper calls
    ``use_whole_matrices`` once, after building it over this rank's pieces."""

    def use_whole_matrices(self, whole: WholeMatrices | None) -> None: ...


class Muon(torch.optim.Optimizer):
    """Muon (torch.optim.Muon's update) for 2-D parameters, AdamW for the others.

    A param group may say ``use_muon``; otherwise its matrices take Muon and the rest AdamW
    (the group is split in two). Under ZeRO the engine gives it :class:`WholeMatrices`
    (:meth:`use_whole_matrices`), so a matrix split between ranks gets the one-process update.

    Args:
        params: parameters or param groups.
        lr: Muon's learning rate.
        weight_decay: Muon's decoupled weight decay.
        momentum: Muon's momentum.
        nesterov: Nesterov momentum.
        ns_coefficients: the Newton-Schulz quintic's coefficients.
        eps: the smallest norm divided by.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``"original"`` (None) or ``"match_rms_adamw"``.
        adamw_lr: AdamW's learning rate, for the other parameters.
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's eps.
        adamw_weight_decay: AdamW's decoupled weight decay.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
    ) -> None:
        defaults: _Group = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, adamw_lr=adamw_lr, adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
        )  # fmt: skip
        super().__init__(_split_by_kind(params), defaults)
        self.whole: WholeMatrices | None = None

    def use_whole_matrices(self, whole: WholeMatrices | None) -> None:
        """Under ZeRO: the matrices' pieces are orthogonalized together by ``whole``."""
        self.whole = whole

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        updates: dict[int, torch.Tensor] = {}
        stepped: list[tuple[torch.Tensor, _Group]] = []
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is None:
                    continue
                if not group["use_muon"]:
                    self._adamw(w, group)
                    continue
                state = self.state[w]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(w)
                buf = state["momentum_buffer"]
                buf.lerp_(w.grad, 1 - group["momentum"])
                u = w.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                if self.whole is None and w.ndim != 2:
                    raise ValueError(
                        f"Muon: a use_muon group holds a parameter of shape {tuple(w.shape)}, "
                        "not a matrix; put it in a group with use_muon=False (AdamW)"
                    )
                updates[id(w)] = u
                stepped.append((w, group))
        orthogonal = self._orthogonalize(updates, stepped)
        for w, group in stepped:
            shape = self.whole.shape_of(w) if self.whole is not None else tuple(w.shape)
            w.mul_(1 - group["lr"] * group["weight_decay"])
            w.add_(orthogonal[id(w)], alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], shape))
        return loss

    def _orthogonalize(
        self, updates: dict[int, torch.Tensor], stepped: list[tuple[torch.Tensor, _Group]]
    ) -> dict[int, torch.Tensor]:
        groups = [g for g in self.param_groups if g["use_muon"]]
        g0 = groups[0] if groups else self.defaults
        coefficients, steps, eps = g0["ns_coefficients"], g0["ns_steps"], g0["eps"]

        def ns(m: torch.Tensor) -> torch.Tensor:
            return newton_schulz(m, coefficients, steps, eps)

        if self.whole is not None:
            return self.whole.orthogonalize(updates, ns)
        return {id(w): ns(updates[id(w)]).to(w.dtype) for w, _ in stepped}

    def _adamw(self, w: torch.Tensor, group: _Group) -> None:
        """AdamW, in the order of operations of torch.optim.AdamW's loop (foreach=False), so
        the two agree to the last bit and Muon's bf16 orthogonalization sees the same input."""
        b1, b2 = group["adamw_betas"]
        lr, decay = group["adamw_lr"], group["adamw_weight_decay"]
        state = self.state[w]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(w)
            state["exp_avg_sq"] = torch.zeros_like(w)
        state["step"] += 1
        t = float(state["step"])
        g, m, v = w.grad, state["exp_avg"], state["exp_avg_sq"]
        w.mul_(1 - lr * decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / (1 - b2**t) ** 0.5).add_(group["adamw_eps"])
        w.addcdiv_(m, denom, value=-(lr / (1 - b1**t)))


def _split_by_kind(params: ParamsT) -> list[_Group]:
    """Param groups with ``use_muon`` set: a group that does not say is split into its
    matrices (Muon) and the rest (AdamW)."""
    given = list(params)
    groups: list[_Group] = [{"params": given}]
    if given and isinstance(given[0], dict):
        groups = [dict(cast(_Group, g)) for g in given]
    out = []
    for g in groups:
        ps = list(g.pop("params"))
        if "use_muon" in g:  # (under ZeRO: pieces of matrices, flat)
            out.append({**g, "params": ps})
            continue
        for kind in (True, False):
            chosen = [p for p in ps if (p.ndim == 2) == kind]
            if chosen:
                out.append({**g, "params": chosen, "use_muon": kind})
    return out
