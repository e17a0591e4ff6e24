"""Top-k sparsification with error feedback, and Deep Gradient Compression's momentum
correction and factor masking.

[Note: error feedback]
A rank sends only the ``k`` largest-magnitude entries of ``residual + gradient`` and keeps the
rest as its residual for the next step, so nothing is lost, only delayed: what was sent plus
the new residual is exactly what would have been sent uncompressed. With momentum correction
(Lin et al., 2018) the velocity ``u = m * u + g`` accumulates instead of the gradient
(``v = v + u``); the entries sent are cleared from both ``v`` and ``u`` (factor masking), so a
stale momentum does not keep pushing a coordinate that was already applied.
"""

from __future__ import annotations

import math

import torch

__all__ = ["TopK"]


class TopK:
    """One flat gradient buffer's compression state: ``ratio`` of its entries per step."""

    def __init__(
        self,
        numel: int,
        ratio: float,
        momentum: float = 0.0,
        *,
        device=None,  # noqa: ANN001
    ) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"gradient_compression.ratio: {ratio} is not in (0, 1]")
        self.numel = numel
        self.k = max(1, math.ceil(numel * ratio))
        self.momentum = momentum
        self.residual = torch.zeros(numel, device=device)  # v: what is still to be sent
        self.velocity = torch.zeros(numel, device=device) if momentum else None  # u

    def select(self, grad: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``grad / scale`` (flat, this step's; ``grad`` is only read) and take the ``k``
        largest entries out: (indices, values), both of length ``k``; the rest stays in the
        residual."""
        g = grad.reshape(-1)
        if self.velocity is not None:
            self.velocity.mul_(self.momentum).add_(g, alpha=1.0 / scale)
            self.residual.add_(self.velocity)
        else:
            self.residual.add_(g, alpha=1.0 / scale)
        indices = torch.topk(self.residual.abs(), self.k, sorted=False).indices
        values = self.residual[indices].clone()
        self.residual[indices] = 0
        if self.velocity is not None:
            self.velocity[indices] = 0
        return indices, values

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"residual": self.residual}
        if self.velocity is not None:
            state["velocity"] = self.velocity
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residual.copy_(state["residual"])
        if self.velocity is not None:
            self.velocity.copy_(state["velocity"])
