"""The exchanges of 0/1 Adam (``core/optim/zeroone.py``) at ZeRO stage 0.

[Note: what each kind of 0/1 Adam step sends]
The optimizer's schedule says, before backward, what the coming optimizer step is:

- ``dense`` (a variance step): backward reduces as usual; this class does nothing;
- ``onebit``: backward reduces nothing; at the step one finite-flag all-reduce (an overflow on
  any rank skips the step everywhere, errors untouched), then each flat group's local gradient
  (loss scale removed, clipped by this rank's own norm under ``gradient_clipping``) goes
  through the 1-bit compressed all-reduce with that group's worker and server errors, and the
  result is every rank's gradient;
- ``local``: nothing is sent but the finite flag; each rank's optimizer steps on its own
  (clipped) gradient;
- ``sync``: as ``local``, then the optimizer calls :meth:`ZeroOneReduction.exchange` with its
  accumulated updates, averaged 1-bit compressed as one flat buffer with errors of their own.

The gradient errors serve the variance phase only and are dropped when the local steps start
(their metric changes, as DeepSpeed resets them); all errors restart from zero after a
checkpoint load, as DeepSpeed's do. The accumulators and the summed learning rates are
optimizer state, saved with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..collectives import Comm
from .onebit import compressed_all_reduce
from .onebit_reduce import finite_everywhere, padded_size, unscaled_and_clipped
from .reduction import SavedBuffers

if TYPE_CHECKING:
    from ..optim.zeroone import StepKind, ZeroOneAdam
    from ..zero.flat_group import FlatParamGroup

__all__ = ["ZeroOneReduction"]


class ZeroOneReduction:
    """Errors and exchanges of 0/1 Adam over a plan's trainable flat groups.

    Between syncs each rank steps on its own gradient, so the replicas drift apart.
    """

    replicas_drift = True

    def __init__(
        self,
        groups: Sequence[FlatParamGroup],
        comm: Comm,
        optimizer: ZeroOneAdam,
        loss_scale: Callable[[], float],
        optimizer_steps: Callable[[], int],
        clip: float,
    ) -> None:
        self.groups = [g for g in groups if g.trainable]
        self.comm = comm
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        self.optimizer_steps = optimizer_steps
        self.clip = clip
        # per group, for the variance phase's 1-bit gradients; one pair for the syncs
        self.grad_errors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sync_errors: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def kind(self) -> StepKind:
        """The kind of the coming optimizer step."""
        return self.optimizer.kind_of(self.optimizer_steps() + 1)

    @property
    def active(self) -> bool:
        """Backward reduces nothing: every step but a variance step."""
        return self.kind != "dense"

    @property
    def exchanged(self) -> bool:
        """The optimizer's coming step takes what the exchange gave."""
        return self.optimizer.exchanged

    def reset(self) -> None:
        """After a checkpoint load: every error restarts from zero."""
        self.grad_errors, self.sync_errors = [], None

    def saved_buffers(self) -> SavedBuffers:
        """None: the errors restart at a load, as DeepSpeed's do."""
        return []

    def state_bytes(self) -> int:
        pairs = [*self.grad_errors, *([self.sync_errors] if self.sync_errors else [])]
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair)

    def reduce(self) -> None:
        """The step's exchange (see the note). Collective."""
        local = [g.take_local_grad() for g in self.groups]
        if not finite_everywhere(local, self.groups, self.comm):
            return
        scale = self.loss_scale()
        grads = unscaled_and_clipped(local, self.groups, scale, self.clip)
        kind = self.kind
        if kind == "onebit" and not self.grad_errors:
            self.grad_errors = [self._errors(padded_size(g.layout.padded_total,
                                                         self.comm.world_size), g.device)
                                for g in self.groups]  # fmt: skip
        elif kind != "onebit":
            self.grad_errors = []  # the local steps have begun
        for i, (g, grad) in enumerate(zip(self.groups, grads, strict=True)):
            if kind == "onebit":
                worker, server = self.grad_errors[i]
                x = grad.new_zeros(worker.numel())
                x[: grad.numel()] = grad
                grad = compressed_all_reduce(x, worker, server, self.comm, kind="onebit")
            out = grad.new_zeros(g.layout.padded_total)
            out[: g.layout.total] = grad[: g.layout.total]
            g.set_reduced_grad(out * scale)  # the engine's step removes the loss scale
        self.optimizer.given = kind
        self.optimizer.exchange = self.exchange

    def exchange(self, tensors: Sequence[torch.Tensor]) -> None:
        """Average ``tensors`` over the ranks in place, 1-bit compressed as one flat buffer
        with the sync errors. Collective: every rank passes the same shapes, in order."""
        total = sum(t.numel() for t in tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        size = padded_size(total, self.comm.world_size)
        if self.sync_errors is None or self.sync_errors[0].numel() != size:
            self.sync_errors = self._errors(size, device)
        flat = torch.zeros(size, device=device)
        if tensors:
            torch.cat([t.reshape(-1).float() for t in tensors], out=flat[:total])
        mean = compressed_all_reduce(flat, *self.sync_errors, self.comm, kind="onebit")
        offset = 0
        for t in tensors:
            t.copy_(mean[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def _errors(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.zeros(size, device=device),
            torch.zeros(size // self.comm.world_size, device=device),
        )
