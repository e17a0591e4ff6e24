"""The compressed momentum exchange of the 1-bit optimizers (``core/optim/onebit.py``), for
ZeRO stages 0, 1 and 2.

[Note: one compressed 1-bit step]
After the optimizer's ``freeze_step`` dense steps, backward reduces nothing: gradients
accumulate locally (as under top-k, ``topk_reduce.py``). At the optimizer step, per flat group:

1. one all-reduce of a finite flag, as for top-k: an overflow on any rank makes every shard
   NaN (the engine skips the step everywhere) and leaves the momentum and the errors as they
   were;
2. the local gradient, loss scale removed and clipped by its own norm when the config sets
   ``gradient_clipping`` (the gradients are not averaged yet, so each rank clips its own, as
   in DeepSpeed's 1-bit optimizers), is folded into the momentum of the previous step:
   ``x = b1 * m + (1 - b1) * g``. Every rank holds the whole momentum ``m`` of its groups
   (all ranks hold the same one: it is the result of the previous exchange);
3. ``x`` goes through the two-phase compressed all-reduce (``onebit.py``), with this rank's
   worker and server errors; the result is the new ``m`` on every rank. 1-bit LAMB scales each
   parameter's part of ``x`` by ``united / rms(m_p)`` first (computed once, when the exchange
   starts: the mean over parameters of ``rms(m_p)`` over this one) and back after, so small
   and large parameters share a sign's scale fairly;
4. this rank's slice of ``m`` (times the loss scale, which the engine's step removes) is
   written as its reduced gradient and the optimizer is told it is the momentum
   (``momentum_given``). The engine does not clip it again.

The momentum ``m`` is taken from the optimizer's ``exp_avg`` when the exchange starts (one
dense all-reduce under stages 1/2, where each rank holds a slice of it) and again after a
checkpoint is loaded; the errors start from zero then, as DeepSpeed resets them on a load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..collectives import Comm
from .onebit import compressed_all_reduce
from .reduction import SavedBuffers

if TYPE_CHECKING:
    from ..optim.onebit import MomentumCompressed
    from ..zero.flat_group import FlatParamGroup
    from ..zero.optimizer import OptimizerPiece

__all__ = ["OneBitReduction", "finite_everywhere", "unscaled_and_clipped", "padded_size"]


def padded_size(numel: int, world: int) -> int:
    """``numel`` rounded up to what the compressed all-reduce takes: a multiple of 8 x world."""
    unit = 8 * world
    return -(-numel // unit) * unit


def finite_everywhere(
    local: Sequence[torch.Tensor], groups: Sequence[FlatParamGroup], comm: Comm
) -> bool:
    """Step 1 of the note: one all-reduce of a finite flag. On an overflow on any rank every
    group's gradient shard is made NaN (the engine then skips the step on every rank) and
    ``False`` is returned: the caller leaves its momenta and errors as they are."""
    bad = torch.tensor(
        [float(any(not bool(t.isfinite().all()) for t in local))], dtype=torch.float64
    )
    comm.all_reduce(bad, op="max", kind="control")
    if bad.item() > 0:
        for g in groups:
            g.set_reduced_grad(None)
        return False
    return True


def unscaled_and_clipped(
    local: Sequence[torch.Tensor], groups: Sequence[FlatParamGroup], scale: float, clip: float
) -> list[torch.Tensor]:
    """This rank's gradients (new fp32 tensors, padding dropped), loss scale removed and, with
    ``clip > 0``, clipped by their own L2 norm: the gradients are not averaged yet, so each
    rank clips its own, as DeepSpeed's 1-bit optimizers do."""
    grads = [t[: g.layout.total].float() / scale for g, t in zip(groups, local, strict=True)]
    if clip > 0:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in grads]))
        coef = min(1.0, clip / (float(norm) + 1e-6))
        if coef < 1.0:
            for t in grads:
                t.mul_(coef)
    return grads


class OneBitReduction:
    """Momentum, errors and the compressed exchange of a plan's trainable flat groups.

    None of it is saved: a load takes the momentum from the optimizer again.
    """

    replicas_drift = False

    def __init__(
        self,
        groups: Sequence[FlatParamGroup],
        pieces: Sequence[OptimizerPiece],
        comm: Comm,
        optimizer: MomentumCompressed,
        loss_scale: Callable[[], float],
        optimizer_steps: Callable[[], int],
        clip: float,
    ) -> None:
        self.groups = [g for g in groups if g.trainable]
        self.pieces = list(pieces)
        self.comm = comm
        self.optimizer = optimizer
        self.beta = optimizer.momentum_beta()
        self.loss_scale = loss_scale
        self.optimizer_steps = optimizer_steps
        self.clip = clip
        self.sizes = [padded_size(g.layout.padded_total, comm.world_size) for g in self.groups]
        self.momenta: list[torch.Tensor] | None = None  # None: to be taken from the optimizer
        self.worker_errors: list[torch.Tensor] = []
        self.server_errors: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] | None = None  # 1-bit LAMB's per-parameter factors

    @property
    def active(self) -> bool:
        """Compressed from the first step after the optimizer's ``freeze_step`` dense ones."""
        return self.optimizer_steps() >= self.optimizer.freeze_step

    @property
    def exchanged(self) -> bool:
        """The optimizer's coming step takes the exchanged momentum."""
        return self.optimizer.exchanged

    def reset(self) -> None:
        """After a checkpoint load: the momentum is taken from the optimizer again and the
        errors start from zero."""
        self.momenta = None
        self.scales = None

    def saved_buffers(self) -> SavedBuffers:
        """None: the errors restart at a load, as DeepSpeed's do."""
        return []

    def state_bytes(self) -> int:
        tensors = [*(self.momenta or []), *self.worker_errors, *self.server_errors]
        tensors += self.scales or []
        return sum(t.numel() * t.element_size() for t in tensors)

    def reduce(self) -> None:
        """Steps 1-4 of [Note: one compressed 1-bit step], for every group. Collective."""
        local = [g.take_local_grad() for g in self.groups]
        if not finite_everywhere(local, self.groups, self.comm):
            return
        if self.momenta is None:
            self._start()
        assert self.momenta is not None
        scale = self.loss_scale()
        grads = unscaled_and_clipped(local, self.groups, scale, self.clip)
        for i, (g, grad) in enumerate(zip(self.groups, grads, strict=True)):
            m = self.momenta[i]
            x = m.mul(self.beta)
            x[: g.layout.total].add_(grad, alpha=1 - self.beta)
            if self.scales is not None:
                x.mul_(self.scales[i])
            m.copy_(
                compressed_all_reduce(x, self.worker_errors[i], self.server_errors[i], self.comm)
            )
            if self.scales is not None:
                m.div_(self.scales[i])
            g.set_reduced_grad(m[: g.layout.padded_total] * scale)
        self.optimizer.momentum_given = True

    def _start(self) -> None:
        """The momentum from the optimizer's ``exp_avg``, zero errors, LAMB's scales."""
        world = self.comm.world_size
        self.momenta = [
            torch.zeros(n, device=g.device) for g, n in zip(self.groups, self.sizes, strict=True)
        ]
        index = {id(g): i for i, g in enumerate(self.groups)}
        state = self.optimizer.state  # type: ignore[attr-defined]
        sharded = False
        for pc in self.pieces:
            m = state.get(pc.tensor, {}).get("exp_avg")
            if m is None or id(pc.group) not in index:
                continue
            g = pc.group
            if pc.sl is None:
                start = g.layout.slots[pc.index].offset
            else:
                sharded = sharded or g.policy.shard_optimizer
                start = g.layout.shard_range(g.rank)[0] + pc.sl.start
            self.momenta[index[id(g)]][start : start + m.numel()].copy_(m.reshape(-1))
        flag = torch.tensor([float(sharded)], dtype=torch.float64)
        self.comm.all_reduce(flag, op="max", kind="control")
        if flag.item() > 0:  # each rank held a slice: sum the slices (one dense exchange)
            for m in self.momenta:
                self.comm.all_reduce(m, kind="onebit_start")
        self.worker_errors = [torch.zeros_like(m) for m in self.momenta]
        self.server_errors = [m.new_zeros(m.numel() // world) for m in self.momenta]
        self.scales = self._lamb_scales() if self.optimizer.scales_momentum else None

    def _lamb_scales(self) -> list[torch.Tensor]:
        assert self.momenta is not None
        rms: list[list[float]] = []
        for g, m in zip(self.groups, self.momenta, strict=True):
            rms.append([
                float(m[s.offset : s.offset + s.numel].norm()) / max(s.numel, 1) ** 0.5
                for s in g.layout.slots
            ])  # fmt: skip
        flat = [r for group in rms for r in group if r > 0]
        united = sum(flat) / len(flat) if flat else 1.0
        out = []
        for g, m, group in zip(self.groups, self.momenta, rms, strict=True):
            s_vec = torch.ones_like(m)
            for s, r in zip(g.layout.slots, group, strict=True):
                s_vec[s.offset : s.offset + s.numel] = united / r if r > 0 else 1.0
            out.append(s_vec)
        return out
