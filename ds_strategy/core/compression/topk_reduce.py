"""Top-k compressed gradient reduction for ZeRO stages 0, 1 and 2.

[Note: one compressed step]
While compression is active (after ``warmup_steps`` dense steps) backward reduces nothing:
gradients accumulate locally over the micro-batches (in the flat gradient buffer at stages
0/1, in the group's bucket at stage 2). At the optimizer step, for each flat group in order:

1. every rank checks its gradients are finite; one all-reduce of a flag tells all ranks. On an
   overflow anywhere the residuals stay untouched and the gradient shard is made NaN, so the
   engine skips the step on every rank as it skips any overflow;
2. the local gradient, loss scale removed, goes through :class:`TopK` (residual + gradient,
   the ``k`` largest entries taken out);
3. the (index, value) pairs of all ranks are all-gathered (int32 + fp32: 8 bytes an entry;
   a sparse all-reduce would have to send the union of the indices, which grows with the
   ranks, so a fixed-size all-gather is the simpler and here the smaller exchange);
4. each rank adds the entries that fall in its own shard, divided by the world size (the
   average) and multiplied by the loss scale again, to its gradient shard. The engine's step
   (clipping by the global norm, the optimizer) runs as after a dense reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..collectives import Comm
from .reduction import SavedBuffers
from .topk import TopK

if TYPE_CHECKING:
    from ..zero.flat_group import FlatParamGroup

__all__ = ["TopKReduction"]


class TopKReduction:
    """The compression state of a plan's trainable flat groups and the compressed exchange.

    The step clips its gradients as after a dense reduction (``exchanged`` is never true).
    The residuals are checkpoint state: a load restores them, so :meth:`reset` has nothing
    to do.
    """

    exchanged = False
    replicas_drift = False

    def __init__(
        self,
        groups: Sequence[FlatParamGroup],
        comm: Comm,
        ratio: float,
        warmup_steps: int,
        momentum: float,
        loss_scale: Callable[[], float],
        optimizer_steps: Callable[[], int],
    ) -> None:
        self.groups = [g for g in groups if g.trainable]
        self.comm = comm
        self.warmup_steps = warmup_steps
        self.loss_scale = loss_scale
        self.optimizer_steps = optimizer_steps
        self.states = [TopK(g.layout.total, ratio, momentum, device=g.device) for g in self.groups]

    @property
    def active(self) -> bool:
        """Compressed from the first step after the dense warm-up."""
        return self.optimizer_steps() >= self.warmup_steps

    def state_bytes(self) -> int:
        """Residuals and momentum-correction velocities, for ``memory_report()``."""
        return sum(
            t.numel() * t.element_size() for st in self.states for t in st.state_dict().values()
        )

    def reset(self) -> None:
        """Nothing: a checkpoint load has written the residuals."""

    def saved_buffers(self) -> SavedBuffers:
        """Each group's residual (and momentum-correction velocity)."""
        return [(g, st.state_dict()) for g, st in zip(self.groups, self.states, strict=True)]

    def reduce(self) -> None:
        """Steps 1-4 of [Note: one compressed step], for every group. Collective."""
        local = [g.take_local_grad() for g in self.groups]
        bad = torch.tensor(
            [float(any(not bool(t.isfinite().all()) for t in local))], dtype=torch.float64
        )
        self.comm.all_reduce(bad, op="max", kind="control")
        if bad.item() > 0:
            for g in self.groups:
                g.set_reduced_grad(None)  # NaN: the engine skips the step on every rank
            return
        scale = self.loss_scale()
        world = self.comm.world_size
        for g, state, grad in zip(self.groups, self.states, local, strict=True):
            indices, values = state.select(grad[: g.layout.total], scale)
            all_indices = indices.new_empty(world * state.k, dtype=torch.int32)
            self.comm.all_gather(all_indices, indices.to(torch.int32), kind="topk")
            all_values = values.new_empty(world * state.k)
            self.comm.all_gather(all_values, values, kind="topk")
            g.set_reduced_grad((all_indices.long(), all_values.mul_(scale / world)))
