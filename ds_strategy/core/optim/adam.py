"""Adam and AdamW with DeepSpeed's ``bias_correction`` switch, on plain torch ops.

A config's ``{"type": "Adam" | "AdamW"}`` builds ``torch.optim.Adam`` / ``AdamW`` (torch's fused
kernels where they exist); only ``bias_correction: false``, which torch's classes do not offer,
builds this class. It follows DeepSpeed's ``FusedAdam`` (``csrc/adam/multi_tensor_adam.cu``)::

    g = g + weight_decay * w                         # L2 mode (adam_w_mode=False) only
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / c1) / (sqrt(v / c2) + eps)              # c = 1 - b**t, or 1 without bias_correction
    u = u + weight_decay * w                         # decoupled mode (adam_w_mode=True) only
    w = w - lr * u

With ``bias_correction=True`` it is torch's Adam (``adam_w_mode=False``) or AdamW, to round-off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim.optimizer import ParamsT

__all__ = ["Adam"]


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """What ``step(closure)`` returns: the closure's loss, computed with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_moments(
    name: str, lr: float, eps: float, weight_decay: float, betas: Sequence[float]
) -> None:
    """The hyper-parameter ranges Adam-family optimizers (Adam, Lamb) share."""
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"{name}: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: betas={tuple(betas)} must each be in [0, 1)")


def advance_moments(
    state: dict[str, torch.Tensor], w: torch.Tensor, g: torch.Tensor, betas: tuple[float, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the Adam-family state of ``w`` (created at its first step): the step count
    and the moving averages of ``g`` and ``g * g``, which it returns."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(w)
        state["exp_avg_sq"] = torch.zeros_like(w)
    state["step"] += 1
    b1, b2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    return m, v


class Adam(torch.optim.Optimizer):
    """DeepSpeed's ``FusedAdam``: Adam, or AdamW with ``adam_w_mode=True`` (its default, as
    in DeepSpeed), with bias correction optional. Formula in the module docstring.

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = Adam([w], lr=0.1, bias_correction=False)
    >>> w.grad = torch.ones(2)
    >>> opt.step()  # m = 0.1, sqrt(v) = sqrt(0.001): the first step is lr * 0.1 / 0.0316
    >>> [round(x, 4) for x in w.tolist()]
    [-0.3162, -0.3162]
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
    ) -> None:
        check_moments("Adam", lr, eps, weight_decay, betas)
        # adam_w_mode in defaults (per group, unlike FusedAdam) so a rebuild over shards keeps it
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            decay = group["weight_decay"]
            for w in group["params"]:
                if w.grad is None:
                    continue
                state = self.state[w]
                g = w.grad
                if decay and not group["adam_w_mode"]:
                    g = g.add(w, alpha=decay)
                m, v = advance_moments(state, w, g, (b1, b2))
                c1, c2 = 1.0, 1.0
                if group["bias_correction"]:
                    t = float(state["step"])
                    c1, c2 = 1 - b1**t, 1 - b2**t
                u = (m / c1).div_((v / c2).sqrt_().add_(group["eps"]))
                if decay and group["adam_w_mode"]:
                    u.add_(w, alpha=decay)
                w.add_(u, alpha=-group["lr"])
        return loss
