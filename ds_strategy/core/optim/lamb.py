"""LAMB with DeepSpeed's ``FusedLamb`` semantics, on plain torch ops, correct under ZeRO.

[Note: the formula, as DeepSpeed's kernel computes it]
``csrc/lamb/fused_lamb_cuda_kernel.cu``, per parameter ``w`` with gradient ``g`` at step ``t``::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * w        # sqrt(v + eps) with eps_inside_sqrt
    ratio = ||w|| / ||u||, clamped to [min_coeff, max_coeff]; 1 when ||w|| or ||u|| is 0
    step_size = lr * sqrt(1 - b2**t) / (1 - b1**t)   # lr without bias_correction
    w = w - step_size * ratio * u

The moments are *not* bias-corrected inside ``u``: the correction is folded into the step size
only, so the trust ratio sees the uncorrected update. ``||w||`` is taken before the update.

[Note: the norms under ZeRO]
``||w||`` and ``||u||`` are over the whole parameter. Each rank holds pieces of parameters, so
:meth:`Lamb.step` runs in two passes: the first updates the moments and collects each piece's
partial ``sum(w**2)`` and ``sum(u**2)``; one all-reduce of a (parameters x 2) vector
(``norms.ParamNorms``) turns them into whole-parameter totals; the second pass recomputes ``u``
from the updated moments (rather than keeping a copy of every update, which would cost one more
shard of memory) and applies it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from .adam import advance_moments, check_moments, closure_loss
from .norms import ParamNorms

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """LAMB (`You et al., 2019 <https://arxiv.org/abs/1904.00962>`_) as DeepSpeed's
    ``FusedLamb`` computes it (see the module note for the formula), on any device.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        bias_correction: fold Adam's bias correction into the step size.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to ``sqrt(v)`` (inside the square root with ``eps_inside_sqrt``).
        eps_inside_sqrt: DeepSpeed's ``eps_inside_sqrt``.
        weight_decay: added to the update as ``weight_decay * w`` before the trust ratio.
        max_grad_norm: accepted for DeepSpeed's signature; only 0 is allowed. Clip with the
            config's ``gradient_clipping`` (DeepSpeed refuses the key in a config, too).
        max_coeff, min_coeff: bounds of the trust ratio.

    Under ZeRO the engine gives it whole-parameter norms (:meth:`use_param_norms`), so a
    parameter split between ranks gets the same trust ratio as in one process. Pass it to
    ``ds_strategy.initialize`` like any optimizer, or name it in a config
    (``{"type": "Lamb", "params": {...}}``).

    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> opt = Lamb([w], lr=0.1, bias_correction=False)
    >>> w.grad = torch.ones(4)
    >>> opt.step()  # the trust ratio makes the step's norm lr * ||w||
    >>> [round(x, 4) for x in w.tolist()]
    [0.9, 0.9, 0.9, 0.9]
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        check_moments("Lamb", lr, eps, weight_decay, betas)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"Lamb: min_coeff={min_coeff}, max_coeff={max_coeff}: need "
                "0 <= min_coeff <= max_coeff"
            )
        if max_grad_norm:
            raise ValueError(
                f"Lamb: max_grad_norm={max_grad_norm} is not applied by the optimizer; set the "
                "config's gradient_clipping instead (DeepSpeed refuses this key too)"
            )
        # every hyper-parameter lives in defaults, so a rebuild over the shards keeps them all
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._norms: ParamNorms | None = None
        self._coeffs = torch.zeros(0)

    def use_param_norms(self, norms: ParamNorms | None) -> None:
        """Take whole-parameter norms from ``norms`` (the sharded wrapper's), or from each
        tensor alone with ``None`` (every tensor a whole parameter)."""
        self._norms = norms

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per tensor stepped (DeepSpeed's name)."""
        return self._coeffs.tolist()

    # a param group is torch's dict[str, Any]: hyper-parameters of several types, and "params"
    @staticmethod
    def _update(
        group: dict[str, Any], w: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        v = state["exp_avg_sq"]
        if group["eps_inside_sqrt"]:
            denom = (v + group["eps"]).sqrt_()
        else:
            denom = v.sqrt().add_(group["eps"])
        u = state["exp_avg"] / denom
        if group["weight_decay"]:
            u.add_(w, alpha=group["weight_decay"])
        return u

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        live = [(g, w) for g in self.param_groups for w in g["params"] if w.grad is not None]
        sums = []
        for group, w in live:
            state = self.state[w]
            advance_moments(state, w, w.grad, group["betas"])
            u = self._update(group, w, state)
            sums.append(torch.stack([torch.linalg.vector_norm(t) for t in (w, u)]).double())
        # this rank's sum(w**2), sum(u**2) per tensor, fetched from the device once
        partial = (
            torch.stack(sums).square().cpu() if sums else torch.zeros(0, 2, dtype=torch.float64)
        )
        totals = partial
        if self._norms is not None:  # collective: once per step on every rank, pieces or none
            totals = self._norms.totals([w for _, w in live], partial)
        self._coeffs = self._trust_ratios(totals.sqrt(), [g for g, _ in live])
        for (group, w), coeff in zip(live, self._coeffs.tolist(), strict=True):
            state = self.state[w]
            w.add_(self._update(group, w, state), alpha=-self._step_size(group, state) * coeff)
        return loss

    @staticmethod
    def _trust_ratios(norms: torch.Tensor, groups: list[dict[str, Any]]) -> torch.Tensor:
        """``||w|| / ||u||`` per row of ``norms``, clamped to its group's bounds; 1 where
        either norm is 0 (unclamped, as in DeepSpeed's kernel)."""
        lo = torch.tensor([g["min_coeff"] for g in groups], dtype=torch.float64)
        hi = torch.tensor([g["max_coeff"] for g in groups], dtype=torch.float64)
        w, u = norms[:, 0], norms[:, 1]
        ratio = torch.minimum(torch.maximum(w / u, lo), hi)
        return torch.where((w > 0) & (u > 0), ratio, torch.ones_like(ratio))

    @staticmethod
    def _step_size(group: dict[str, Any], state: dict[str, torch.Tensor]) -> float:
        if not group["bias_correction"]:
            return float(group["lr"])
        b1, b2 = group["betas"]
        t = float(state["step"])
        return float(group["lr"]) * math.sqrt(1 - b2**t) / (1 - b1**t)
