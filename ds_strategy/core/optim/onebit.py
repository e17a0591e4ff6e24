"""DeepSpeed's error-compensated 1-bit optimizers, ``OneBitAdam`` and ``OneBitLamb``, with
the arguments of DeepSpeed's classes (``deepspeed/runtime/fp16/onebit``).

[Note: two phases, and who communicates]
For ``freeze_step`` optimizer steps (the warm-up) they are plain Adam / LAMB over gradients the
engine averaged densely, as usual. From then on the second moment ``v`` is frozen and what the
ranks exchange is the *momentum*: each rank folds its local gradient into the momentum of the
previous step (``m = b1 * m + (1 - b1) * g``) and the engine averages those local momenta
with the 1-bit compressed all-reduce (``core/compression/onebit_reduce.py``), error
compensation on both sides. The optimizer does not communicate: it is told, for that step,
that the tensor in each ``.grad`` *is* the averaged momentum (``momentum_given``), copies it
into ``exp_avg`` and applies the update with the frozen ``v``. That keeps these classes plain
``torch.optim`` optimizers over whatever pieces a ZeRO stage gives them.

Differences from DeepSpeed's classes, on purpose: DeepSpeed's first ``step()`` only allocates
its buffers and updates no weight (here the first step is a real one), and its 1-bit Adam
ignores ``bias_correction`` (no correction ever); here ``bias_correction=True`` corrects as
Adam does (the frozen ``v`` keeps the correction of the step it froze at), and ``false``, as
every public DeepSpeed config naming these optimizers sets, is DeepSpeed's arithmetic.
``cuda_aware`` and ``comm_backend_name`` choose DeepSpeed's MPI / NCCL transports and mean
nothing here (the config loader warns); DeepSpeed's ``exp_avg_mask`` param-group key is not
read: entries whose frozen ``v`` is zero (never had a gradient) get a zero momentum instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .adam import advance_moments, check_moments, closure_loss
from .lamb import Lamb

__all__ = ["CompressedExchange", "OneBitAdam", "OneBitLamb", "MomentumCompressed"]


class CompressedExchange:
    """An optimizer whose communication the engine replaces by a compressed exchange (1-bit
    Adam / LAMB, 0/1 Adam). ``exchanged`` is true for a step whose ``.grad`` the exchange
    gave: each rank's gradient was clipped before it (``gradient_clipping``), so the engine
    does not clip it again, and ``clip_grad_norm_`` is refused. Each optimizer overrides
    it from its own record of the step."""

    @property
    def exchanged(self) -> bool:
        """This step's ``.grad`` is what the exchange gave (never, unless overridden)."""
        return False


class MomentumCompressed(CompressedExchange):
    """What the engine's 1-bit exchange needs from an optimizer: ``freeze_step`` dense steps
    first, then ``momentum_given`` set before each compressed step, ``betas`` for folding the
    local gradient into the momentum, and (1-bit LAMB) ``scales_momentum``: each parameter's
    momentum is scaled to a common size before compression (see the reduction)."""

    freeze_step: int
    scales_momentum = False
    momentum_given = False

    def momentum_beta(self) -> float:
        """The one ``beta1`` of all param groups (the exchange folds one momentum)."""
        betas = {float(g["betas"][0]) for g in self.param_groups}  # type: ignore[attr-defined]
        if len(betas) != 1:
            raise ValueError(
                f"{type(self).__name__}: param groups with different betas[0] {sorted(betas)}; "
                "the compressed momentum exchange folds one momentum over all parameters, so "
                "give every group the same betas[0]"
            )
        return betas.pop()

    @property
    def exchanged(self) -> bool:
        """The coming step's ``.grad`` is the exchanged momentum."""
        return self.momentum_given

    def take_momentum_given(self) -> bool:
        given, self.momentum_given = self.momentum_given, False
        return given


def check_onebit(name: str, freeze: tuple[str, int], amsgrad: bool, max_grad_norm: float) -> None:
    """What the 1-bit optimizers refuse alike; ``freeze`` is (key, value) of their freeze
    step."""
    key, step = freeze
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{name}: {key}={step!r} must be an integer >= 0")
    if amsgrad:
        raise ValueError(f"{name}: amsgrad=True is not supported (nor by DeepSpeed's {name})")
    if max_grad_norm:
        raise ValueError(
            f"{name}: max_grad_norm={max_grad_norm} is not applied by the optimizer; set the "
            "config's gradient_clipping instead"
        )


def _take_momentum(state: dict[str, Any], momentum: torch.Tensor) -> None:
    """The averaged momentum becomes ``exp_avg``, zero where the frozen ``v`` is zero: those
    entries never had a gradient (an embedding row no batch used), and a sign cannot say
    zero, so the exchange gives them a small momentum that ``eps`` alone would turn into huge
    steps. DeepSpeed asks the user for this mask (``exp_avg_mask``); it is taken from ``v``."""
    state["exp_avg"].copy_(momentum).masked_fill_(state["exp_avg_sq"] == 0, 0.0)


def _denominator(v: torch.Tensor, c2: float, eps: float, inside: bool) -> torch.Tensor:
    if inside:
        return (v / c2).add_(eps).sqrt_()
    return (v / c2).sqrt_().add_(eps)


class OneBitAdam(MomentumCompressed, torch.optim.Optimizer):
    """1-bit Adam (`Tang et al., 2021 <https://arxiv.org/abs/2102.02888>`_): Adam with
    decoupled weight decay for ``freeze_step`` steps, then Adam with the second moment frozen
    and the momentum exchanged 1-bit compressed (module note). Build it from a config
    (``{"type": "OneBitAdam", "params": {"freeze_step": ...}}``) or pass it to
    ``ds_strategy.initialize``; the engine runs the exchange at ZeRO stages 0-2.

    Update at step ``t`` (``c1 = 1 - b1**t``, ``c2 = 1 - b2**min(t, freeze_step)``; both 1
    without ``bias_correction``)::

        w = w - lr * ((m / c1) / (sqrt(v / c2) + eps) + weight_decay * w)

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = OneBitAdam([w], lr=0.1, freeze_step=10, bias_correction=False)
    >>> w.grad = torch.ones(2)
    >>> opt.step()  # a warm-up step is an Adam step
    >>> [round(x, 4) for x in w.tolist()]
    [-0.3162, -0.3162]
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        check_moments("OneBitAdam", lr, eps, weight_decay, betas)
        check_onebit("OneBitAdam", ("freeze_step", freeze_step), amsgrad, max_grad_norm)
        defaults = dict(
            lr=lr,
            freeze_step=freeze_step,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
        )
        super().__init__(params, defaults)
        self.freeze_step = freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        given = self.take_momentum_given()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for w in group["params"]:
                if w.grad is None:
                    continue
                state = self.state[w]
                if given:  # .grad is the averaged momentum; v stays frozen
                    if not state:
                        advance_moments(state, w, torch.zeros_like(w), (b1, b2))
                    else:
                        state["step"] += 1
                    _take_momentum(state, w.grad)
                else:
                    advance_moments(state, w, w.grad, (b1, b2))
                m, v = state["exp_avg"], state["exp_avg_sq"]
                c1 = c2 = 1.0
                if group["bias_correction"]:
                    t = float(state["step"])
                    c1, c2 = 1 - b1**t, 1 - b2 ** min(t, float(group["freeze_step"]))
                denom = _denominator(v, c2, group["eps"], group["eps_inside_sqrt"])
                u = (m / c1).div_(denom)
                if group["weight_decay"]:
                    u.add_(w, alpha=group["weight_decay"])
                w.add_(u, alpha=-group["lr"])
        return loss


class OneBitLamb(MomentumCompressed, Lamb):
    """1-bit LAMB (`Li et al., 2021 <https://arxiv.org/abs/2104.06069>`_): LAMB (this
    package's :class:`~ds_strategy.core.optim.Lamb`) for ``freeze_step`` steps, keeping a
    moving average (``coeff_beta``) of each parameter's trust ratio; then the second moment
    and the averaged trust ratio are frozen and the momentum is exchanged 1-bit compressed.
    In the compressed phase each parameter's trust ratio is the frozen one times a factor: the
    largest ratio of the frozen to a fresh ``sqrt(v)`` (the fresh ``v`` tracks the gradients
    reconstructed from successive momenta), mixed towards 1 by the weight-decay share of the
    update, clamped to ``[factor_min, factor_max]`` and to ``factor_threshold`` of the last
    step's factor, as in DeepSpeed's ``OnebitLamb``.

    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> opt = OneBitLamb([w], lr=0.1, freeze_step=10, bias_correction=False)
    >>> w.grad = torch.ones(4)
    >>> opt.step()  # a warm-up step is a LAMB step
    >>> [round(x, 4) for x in w.tolist()]
    [0.9, 0.9, 0.9, 0.9]
    """

    scales_momentum = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        check_onebit("OneBitLamb", ("freeze_step", freeze_step), amsgrad, max_grad_norm)
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"OneBitLamb: coeff_beta={coeff_beta} must be in [0, 1)")
        if not 0.0 < factor_min <= factor_max or factor_threshold < 0:
            raise ValueError(
                f"OneBitLamb: factor_min={factor_min}, factor_max={factor_max}, "
                f"factor_threshold={factor_threshold}: need 0 < factor_min <= factor_max and "
                "factor_threshold >= 0"
            )
        super().__init__(
            params, lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay, 0.0,
            max_coeff, min_coeff,
        )  # fmt: skip
        extra = dict(
            freeze_step=freeze_step,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        self.defaults.update(extra)
        for group in self.param_groups:
            for key, value in extra.items():
                group.setdefault(key, value)
        self.freeze_step = freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self.take_momentum_given():
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._compressed_step()
            return loss
        loss = super().step(closure)
        live = [(g, w) for g in self.param_groups for w in g["params"] if w.grad is not None]
        for (group, w), coeff in zip(live, self._coeffs.tolist(), strict=True):
            state = self.state[w]
            if "lamb_coeff_freeze" not in state:
                state["lamb_coeff_freeze"] = torch.tensor(0.0, dtype=torch.float64)
                state["last_factor"] = torch.tensor(1.0, dtype=torch.float64)
            if coeff != 1.0:  # DeepSpeed's rule: a ratio of exactly 1 is not averaged in
                beta = group["coeff_beta"]
                state["lamb_coeff_freeze"].mul_(beta).add_(coeff * (1 - beta))
            if int(state["step"]) == group["freeze_step"]:
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
        return loss

    def _compressed_step(self) -> None:
        live = [(g, w) for g in self.param_groups for w in g["params"] if w.grad is not None]
        sums, maxima = [], []
        for group, w in live:
            state = self.state[w]
            b1, b2 = group["betas"]
            if "exp_avg_sq_fresh" not in state:  # no gradient in the warm-up: no trust ratio
                advance_moments(state, w, torch.zeros_like(w), (b1, b2))
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
                state["lamb_coeff_freeze"] = torch.tensor(0.0, dtype=torch.float64)
                state["last_factor"] = torch.tensor(1.0, dtype=torch.float64)
            else:
                state["step"] += 1
            m = state["exp_avg"]
            rebuilt = (w.grad - m * b1).div_(1 - b1)  # the gradient these momenta imply
            state["exp_avg_sq_fresh"].mul_(b2).addcmul_(rebuilt, rebuilt, value=1 - b2)
            _take_momentum(state, w.grad)
            denom, fresh = self._denominators(group, state)
            plain = m / denom
            u = plain + w * group["weight_decay"] if group["weight_decay"] else plain
            sums.append(torch.stack([u.norm(), plain.norm()]).double())
            maxima.append((denom / fresh).max().double().reshape(1) if w.numel() else
                          torch.zeros(1, dtype=torch.float64))  # fmt: skip
        partial = torch.stack(sums).square().cpu() if sums else torch.zeros(0, 2).double()
        peaks = torch.stack(maxima).cpu() if maxima else torch.zeros(0, 1).double()
        tensors = [w for _, w in live]
        if self._norms is not None:  # collective: once per step on every rank
            partial = self._norms.totals(tensors, partial)
            peaks = self._norms.maxima(tensors, peaks)
        coeffs = []
        for (group, w), (u_sq, plain_sq), peak in zip(
            live, partial.tolist(), peaks[:, 0].tolist(), strict=True
        ):
            state = self.state[w]
            factor = peak
            if group["weight_decay"] and u_sq > 0:
                share = min(1.0, math.sqrt(plain_sq / u_sq))
                factor = factor * share + (1.0 - share)
            factor = min(max(factor, group["factor_min"]), group["factor_max"])
            last, threshold = float(state["last_factor"]), group["factor_threshold"]
            factor = min(max(factor, last * (1 - threshold)), last * (1 + threshold))
            state["last_factor"].fill_(factor)
            coeff = float(state["lamb_coeff_freeze"]) * factor
            coeffs.append(coeff)
            denom, _ = self._denominators(group, state)
            u = state["exp_avg"] / denom
            if group["weight_decay"]:
                u.add_(w, alpha=group["weight_decay"])
            w.add_(u, alpha=-self._step_size(group, state) * coeff)
        self._coeffs = torch.tensor(coeffs, dtype=torch.float64)

    @staticmethod
    def _step_size(group: dict[str, Any], state: dict[str, Any]) -> float:
        """LAMB's, with the second moment's correction stopped where ``v`` froze."""
        if not group["bias_correction"]:
            return float(group["lr"])
        b1, b2 = group["betas"]
        t = float(state["step"])
        frozen = min(t, float(group["freeze_step"]))
        return float(group["lr"]) * math.sqrt(1 - b2**frozen) / (1 - b1**t)

    @staticmethod
    def _denominators(
        group: dict[str, Any], state: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sqrt(v) + eps`` of the frozen and of the fresh second moment."""
        eps, inside = group["eps"], group["eps_inside_sqrt"]
        return (
            _denominator(state["exp_avg_sq"], 1.0, eps, inside),
            _denominator(state["exp_avg_sq_fresh"], 1.0, eps, inside),
        )
