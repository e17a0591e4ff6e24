"""Collectives in flight, each a small named object: what it waits on, what it frees when
it completes, and where its result goes.

[Note: bounding full-size gradients]
Under ZeRO-2/3 a flat group's full-size gradients live in a bucket from the first gradient
autograd produces for it until its reduce-scatter has completed; only the reduced slice is
kept. If every reduction launched during backward were waited for only at the optimizer
step, every bucket would be alive at once: a full-size gradient of the whole model, exactly
what ZeRO-2 exists to avoid. ``ReductionQueue`` therefore waits for the oldest reduction in
flight before launching one more than ``max_in_flight`` (FSDP2 does the same with its
reduce-scatter states), and backward ends by draining it. With ``max_in_flight=1`` a rank
holds at most one bucket being filled plus one in flight (its input, and on gloo a receive
buffer of the same size; see ``collectives.py``). Waiting frees nothing where the gradient
buffer is persistent (stages 0/1) and no receive buffer is allocated, so there the queue is
unbounded and every reduction overlaps the rest of backward.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from ..collectives import Work
from ..memory import Held

__all__ = [
    "Fold",
    "Gather",
    "GradScaling",
    "ReducingGroup",
    "Reduction",
    "ReductionOwner",
    "ReductionQueue",
]


@dataclass(frozen=True)
class GradScaling:
    """DeepSpeed's gradient averaging: divide by ``pre`` before the reduction and multiply by
    ``post`` after it (``pre * (1/post) == world size``)."""

    pre: float
    post: float

    @staticmethod
    def of(world_size: int, prescale: bool, predivide_factor: float) -> GradScaling:
        if prescale:
            return GradScaling(float(world_size), 1.0)
        return GradScaling(predivide_factor, predivide_factor / world_size)


class ReducingGroup(Protocol):
    """What the queue needs of a group it reduces (a ``FlatParamGroup``)."""

    def launch_reduce(self, scaling: GradScaling) -> Reduction | None: ...


class ReductionOwner(Protocol):
    """Whose gradients a reduction lands in (a group's gradient half, ``flat_grads.py``)."""

    def before_fold(self) -> None: ...

    def reduction_done(self, reduction: Reduction) -> None: ...


class Fold(enum.Enum):
    """How a completed reduction's result enters the gradients."""

    IN_PLACE = "in_place"  # the collective wrote into the gradients: only scale
    ADD = "add"  # add the result to the gradient shard (it already holds earlier reductions)
    REPLACE = "replace"  # the result, scaled, becomes the gradient slice


@dataclass(eq=False)
class Reduction:
    """One flat group's gradient reduction in flight.

    ``work`` is what it waits on; ``send`` (the full-size input) and ``out`` (where the
    collective writes, when that is not ``dest`` itself) are dropped on completion. Their
    bytes, and a receive buffer's, are ``held``: ``group`` drops them once told the reduction
    is done. The result, multiplied by ``post``, ends in ``dest`` as ``fold`` says."""

    group: ReductionOwner
    work: Work
    send: torch.Tensor | None
    out: torch.Tensor | None
    dest: torch.Tensor
    fold: Fold
    post: float
    held: Held

    def complete(self) -> None:
        self.work.wait()
        self.group.before_fold()
        if self.fold is Fold.ADD:
            assert self.out is not None
            self.dest.add_(self.out, alpha=self.post)
        else:
            if self.fold is Fold.REPLACE:
                assert self.out is not None
                self.dest.copy_(self.out)
            if self.post != 1.0:
                self.dest.mul_(self.post)
        self.send = self.out = None
        self.group.reduction_done(self)


@dataclass(eq=False)
class Gather:
    """A ZeRO-3 group's all-gather in flight: ``src`` (the shard being sent, or the copy an
    offload tier handed over) must stay alive until ``work`` has completed; ``scratch``
    bytes (qwZ's int8 blocks) are held until then."""

    work: Work
    src: torch.Tensor
    scratch: int = 0

    def complete(self) -> None:
        self.work.wait()


class ReductionQueue:
    """Reductions in launch order, at most ``max_in_flight`` at once (None: unbounded).

    Every rank launches the same groups in the same order (see reducer.py's [Note: launch
    order]), so waiting for the oldest never waits for a collective another rank has not
    issued."""

    def __init__(self, max_in_flight: int | None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 or None, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._in_flight: deque[Reduction] = deque()

    def launch(self, group: ReducingGroup, scaling: GradScaling) -> None:
        """Make room (complete the oldest reductions), then start ``group``'s."""
        if self.max_in_flight is not None:
            while len(self._in_flight) >= self.max_in_flight:
                self._in_flight.popleft().complete()
        reduction = group.launch_reduce(scaling)
        if reduction is not None:
            self._in_flight.append(reduction)

    def drain(self) -> None:
        while self._in_flight:
            self._in_flight.popleft().complete()

    def __len__(self) -> int:
        return len(self._in_flight)
