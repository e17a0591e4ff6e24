"""Bucketed gradient reduction overlapped with backward (stages 0, 1, 2 and stage 3's
persistent small parameters).

[Note: launch order]
Gloo and NCCL match collectives by the order in which ranks issue them, so every rank must
launch the buckets in the same order even if gradients arrive in a different one (an
unused parameter on one rank, say). A bucket is therefore launched only after every bucket
before it; whatever is left when backward ends is launched then, in order. Buckets are
built in reverse registration order, which approximates the order backward produces
gradients, so most buckets still go out while backward is running.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .flat_group import FlatParamGroup, GradScaling
from .inflight import ReductionQueue

__all__ = ["CompressedReduction", "GradReducer"]


class CompressedReduction(Protocol):
    """A reduction that stands in for backward's (top-k gradient compression,
    ``core/compression/topk_reduce.py``): while ``active``, backward reduces nothing and
    ``GradReducer.finish`` runs :meth:`reduce`, the compressed exchange of everything
    accumulated."""

    @property
    def active(self) -> bool: ...

    def reduce(self) -> None: ...


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current autograd backward pass finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


class GradReducer:
    """Owns the post-accumulate-grad hooks of a list of groups and launches their
    reductions in a fixed order.

    ``should_reduce()`` says whether this backward reduces (False inside ``no_sync`` and, for
    stages 0/1, before the accumulation boundary): gradients then just accumulate. Reductions
    go through ``queue``, which bounds how many are in flight (see inflight.py).
    """

    def __init__(
        self,
        groups: list[FlatParamGroup],
        scaling: GradScaling,
        should_reduce: Callable[[], bool],
        queue: ReductionQueue,
    ) -> None:
        self.groups = [g for g in groups if g.trainable]
        self.scaling = scaling
        self.should_reduce = should_reduce
        self.queue = queue
        self._next = 0
        self._in_backward = False
        self._reducing = False
        self._dirty = False  # gradients accumulated that no reduction has seen yet
        # set by the engine with gradient_compression: while active, backward reduces
        # nothing and finish() runs the compressed exchange instead
        self.compression: CompressedReduction | None = None
        self._handles: list[RemovableHandle] = []
        for g in self.groups:
            for i, p in enumerate(g.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(g, i)))
                if g.policy.shard_optimizer and not g.policy.shard_grads:  # stage 1
                    self._handles.append(p.register_hook(self._before(g)))

    def _hook(self, group: FlatParamGroup, index: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            if not self._in_backward:
                self._start_backward()
            group.mark_ready(index)  # moves or keeps the gradient where the group wants it
            if self._reducing:
                self._launch_ready()

        return hook

    @staticmethod
    def _before(group: FlatParamGroup) -> Callable[[torch.Tensor], None]:
        """A hook on a parameter's incoming gradient, before autograd adds it to ``.grad``."""

        def hook(grad: torch.Tensor) -> None:
            group.before_accumulate()

        return hook

    def _start_backward(self) -> None:
        self._in_backward = True
        compressing = self.compression is not None and self.compression.active
        self._reducing = self.should_reduce() and not compressing
        self._next = 0
        for g in self.groups:
            g.begin_backward()
        queue_end_of_backward(self._end_backward)

    def _launch_ready(self) -> None:
        while self._next < len(self.groups) and self.groups[self._next].all_ready:
            self.queue.launch(self.groups[self._next], self.scaling)
            self._next += 1

    def _end_backward(self) -> None:
        self._in_backward = False
        if not self._reducing:
            self._dirty = True
            return
        self.launch_all()
        # Stages 0/1 reduce the buffer autograd accumulates into: finish before another
        # backward can write to it; stages 2/3 free their last buckets. Only the tail of
        # the reduction is exposed by waiting here.
        self.queue.drain()
        for g in self.groups:
            g.to_accumulation_form(self.scaling)

    def launch_all(self) -> None:
        """Launch every group not launched yet, in order."""
        for g in self.groups[self._next :]:
            self.queue.launch(g, self.scaling)
        self._next = len(self.groups)
        self._dirty = False

    def finish(self) -> None:
        """Before the optimizer step: reduce anything accumulated without a reduction (e.g.
        the last backward ran under ``no_sync``), then wait for every reduction. Under
        active gradient compression: the compressed exchange of everything accumulated."""
        if self.compression is not None and self.compression.active:
            self.queue.drain()
            self.compression.reduce()
            self._dirty = False
            return
        if self._dirty:
            for g in self.groups:
                g.begin_backward()
            self._next = 0
            self.launch_all()
        self.queue.drain()
        for g in self.groups:
            g.to_final_form(self.scaling)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
