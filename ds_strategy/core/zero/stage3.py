"""ZeRO-3 runtime: gather a unit's parameters just before it runs, release them after,
prefetch the next unit, reduce-scatter its gradients as soon as backward has produced them.

[Note: the life of a unit in one training step]
forward:  pre-hook  -> gather (or wait for the prefetch), prefetch the next unit(s)
          post-hook -> release; hook the outputs so backward announces itself
backward: first gradient w.r.t. an output -> gather again, prefetch the previous unit
          last parameter gradient of one of its flat groups -> reduce-scatter that group
          (async, through the plan's ReductionQueue, which bounds the buckets in flight)
          every group launched -> release
          end of backward -> reduce what never got a gradient, wait for every reduction,
          release everything
The forward order is recorded on the first step and replayed for prefetching; if a later
step runs units in another order, prefetching stops for that pass (correctness does not
depend on it, only overlap does).

[Note: reuse distance]
The last units of forward are the first of backward: between unit u's forward and its
backward, only the units after it run (forward, then backward), so backward gathers u again
after 2 x (their elements) gathered elements. DeepSpeed keeps a parameter gathered when it
is reused within ``stage3_max_reuse_distance``; here, once the order is recorded, the
longest suffix of it whose units are each reused within that distance stays gathered from
forward into backward (from the last call of a unit that runs more than once), saving a
gather per unit, as long as the suffix fits
``stage3_max_live_parameters`` less the root, the largest unit and the prefetch bucket (so
the units running and prefetched still fit: the gathered parameters stay within the bound
whatever the suffix). A reuse distance of 0 keeps none but the last unit.

[Note: no release just before a re-gather]
Backward starts with the root (head, final norm) and the last unit forward ran. Releasing
them at the end of a forward that backward follows would only gather them again at once, so
after a forward under grad mode they stay gathered (FSDP2 keeps its root the same way); the
bound ``stage3_max_live_parameters`` still holds, since they count as live. The optimizer
step, a checkpoint load and the next forward without grad release them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .flat_group import FlatParamGroup, GradScaling, GroupMaker, GroupPolicy, ShardState
from .inflight import ReductionQueue
from .layout import split_into_buckets
from .reducer import queue_end_of_backward
from .transports import Transport

__all__ = ["Stage3Runtime", "Unit"]

STAGE3_POLICY = GroupPolicy(shard_optimizer=True, shard_grads=True, shard_params=True)


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Unit:
    """One module's parameters, in flat groups of one (dtype, trainable) each and at most
    a bucket's worth of elements (a parameter larger than that gets a group of its own)."""

    def __init__(self, module: nn.Module, groups: list[FlatParamGroup], index: int) -> None:
        self.module = module
        self.groups = groups
        self.index = index
        self.launched = 0  # trainable groups whose reduction started in this backward

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def gathered(self) -> bool:
        return any(g.state is not ShardState.SHARDED for g in self.groups)

    @property
    def trainable_groups(self) -> list[FlatParamGroup]:
        return [g for g in self.groups if g.trainable]

    @property
    def has_frozen(self) -> bool:
        return any(not g.trainable for g in self.groups)

    @property
    def reduced(self) -> bool:
        return self.launched >= len(self.trainable_groups)


def build_groups(
    params: list[nn.Parameter],
    make: GroupMaker,
    bucket_numel: int | None = None,
    transport: Transport | None = None,
    unfilled: bool = False,
) -> list[FlatParamGroup]:
    """Flat groups of one (dtype, requires_grad) each (frozen weights get no gradient
    buffers) and at most ``bucket_numel`` elements, so no gradient bucket is larger than a
    reduce bucket, built by ``make`` with ``transport``. Like stage 2's buckets they run in
    reverse registration order, roughly the order backward produces gradients, which is the
    order a unit launches them in."""
    by_kind: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
    for p in reversed(params):
        by_kind.setdefault((p.dtype, p.requires_grad), []).append(p)
    groups = []
    for (_, trainable), ps in by_kind.items():
        for piece in split_into_buckets([p.numel() for p in ps], bucket_numel or _numel(ps)):
            group = make(
                [ps[i] for i in piece],
                STAGE3_POLICY,
                trainable=trainable,
                transport=transport,
                unfilled=unfilled,
            )
            groups.append(group)
    return groups


def _numel(params: list[nn.Parameter]) -> int:
    return max(1, sum(p.numel() for p in params))


class Stage3Runtime:
    """Hooks that drive gather / release / prefetch / reduce for a list of units."""

    def __init__(
        self,
        units: list[Unit],
        scaling: GradScaling,
        should_reduce: Callable[[], bool],
        prefetch_numel: int,
        max_live_numel: int,
        queue: ReductionQueue,
        max_reuse_numel: int = 0,
    ) -> None:
        self.units = units
        self.root = units[-1]
        self.scaling = scaling
        self.should_reduce = should_reduce
        self.queue = queue
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self._kept: set[int] = set()  # calls kept into backward: see [Note: reuse distance]
        self.state = TrainingState.IDLE
        self._order: list[Unit] = []  # forward order recorded on the first pass
        self._recording = True
        self._call_index = 0
        self._order_ok = True
        self._reducing = False
        self._dirty = False  # gradients accumulated under no_sync, not reduced yet
        # a backward computing input gradients only (torch.autograd.grad over the inputs, as a
        # pipeline stage's shape inference runs): no parameter gradient will ever release a
        # unit, so each is released once backward has moved on to the unit before it
        self.input_grads_only = False
        self.live_numel = 0
        self.peak_live_numel = 0
        self._handles: list[Any] = []
        self._install_hooks()

    # -- hooks --------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        for unit in self.units:
            m = unit.module
            # eager even where the module is compiled: see [Note: compiled units]
            pre = torch.compiler.disable(self._pre_forward(unit))
            post = torch.compiler.disable(self._post_forward(unit))
            self._handles.append(m.register_forward_pre_hook(pre))
            self._handles.append(m.register_forward_hook(post))
            for g in unit.trainable_groups:
                for i, p in enumerate(g.params):
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(self._grad_hook(unit, g, i))
                    )

    # [Note: compiled units]
    # ``module.compile()`` compiles the module's ``__call__``, hooks included, and
    # ``torch.compile(model)`` traces into every submodule's. Traced by Dynamo, the gather in
    # the pre-forward hook rebinds each parameter (``p.data = view``) as an operation that
    # bumps the parameter's version counter; AOTAutograd saved that parameter for backward at
    # the old version, so the first backward of a unit whose weights are sharded failed
    # ("modified by an inplace operation"). The forward hooks are therefore excluded from
    # tracing (``torch.compiler.disable``): they run eagerly between the compiled graphs, as
    # they do without compilation, where rebinding ``.data`` leaves the version alone and the
    # storage the graph saved is refilled in place before backward reads it (see the note on
    # resizing in ``flat_params.py``). Each unit's body compiles as a whole; the graph breaks
    # are at its boundaries only.

    # [Note: a unit called outside the root]
    # A front end may build an engine over a container whose own forward never runs: Lightning's
    # several optimizers, each over the LightningModule's submodules its parameters live in,
    # which ``training_step`` calls directly. Each unit called while no root forward is running
    # is gathered for that call alone and released after it (backward gathers it again), with
    # no order recorded and nothing prefetched, so a loop of such calls never grows the
    # recorded order nor holds more than the units running.

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_forward(self, unit: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.state is TrainingState.BACKWARD and unit is not self.root:
                # activation checkpointing recomputes this unit's forward inside backward.
                # Keep it gathered: its backward needs these parameters next, so releasing
                # here would cost a second all-gather. The recorded order is not touched.
                self._gather(unit, wait=True)
                return
            if unit is self.root:
                self._start_forward()
            elif self.state is TrainingState.IDLE:  # see [Note: a unit called outside the root]
                self._gather(unit, wait=True)
                return
            index = self._call_index
            self._call_index += 1
            if self._recording:
                self._order.append(unit)
            elif index >= len(self._order) or self._order[index] is not unit:
                self._order_ok = False
            self._gather(unit, wait=True)
            if not self._recording and self._order_ok:
                self._prefetch(range(index + 1, len(self._order)))

        return hook

    def _post_forward(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.state is TrainingState.BACKWARD and unit is not self.root:
                return None  # a recompute (see _pre_forward): backward releases the unit
            outside = self.state is TrainingState.IDLE and unit is not self.root
            index = -1 if outside else self._call_index - 1  # -1: nothing to prefetch
            tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._pre_backward(unit, index), mode="any"
                )
            if outside:
                self._release(unit)
            elif unit is self.root:
                self._end_forward(backward_follows=bool(tensors))
            elif not (tensors and (self._ran_last(unit, index) or self._reused(index))):
                self._release(unit)
            return None

        return hook

    def _pre_backward(self, unit: Unit, forward_index: int) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            if self.state is not TrainingState.BACKWARD:
                self._start_backward()
            if self.input_grads_only:  # the units after this one have computed theirs
                for later in self.units[unit.index + 1 :]:
                    if later is not self.root:
                        self._release(later)
            self._gather(unit, wait=True)
            if self._order_ok:
                self._prefetch(range(forward_index - 1, -1, -1))

        return hook

    def _grad_hook(
        self, unit: Unit, group: FlatParamGroup, index: int
    ) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            if self.state is not TrainingState.BACKWARD:
                self._start_backward()
            group.mark_ready(index)
            if self._reducing:
                self._launch_ready(unit)

        return hook

    def _launch_ready(self, unit: Unit) -> None:
        """Launch the unit's groups whose gradients are complete, in the unit's order (the
        same on every rank); release the unit once all are launched."""
        groups = unit.trainable_groups
        while unit.launched < len(groups) and groups[unit.launched].all_ready:
            self.queue.launch(groups[unit.launched], self.scaling)
            unit.launched += 1
        if unit.reduced and not unit.has_frozen:
            self._release(unit)

    # -- transitions --------------------------------------------------------------------------

    def _start_forward(self) -> None:
        if self.state is TrainingState.BACKWARD:
            raise RuntimeError("forward started while a backward pass is still running")
        if self._order and self._recording:
            self._recording = False
            self._kept = self._reuse_suffix()
        self.state = TrainingState.FORWARD
        self._call_index = 0
        self._order_ok = True

    def _ran_last(self, unit: Unit, index: int) -> bool:
        """Whether ``unit`` is the last unit of the recorded forward order."""
        order = self._order
        return (
            not self._recording and self._order_ok and index == len(order) - 1 == order.index(unit)
        )

    def _reuse_suffix(self) -> set[int]:
        """The calls (indices of the recorded order) after which a unit stays gathered into
        its backward (see [Note: reuse distance]): the last call of each of the last units,
        while backward reuses each within ``max_reuse_numel`` gathered elements and they
        fit the room ``max_live_numel`` leaves beside the root, the largest unit and the
        prefetch."""
        room = self.max_live_numel - self.root.numel - self.prefetch_numel
        room -= max((u.numel for u in self.units if u is not self.root), default=0)
        kept: set[int] = set()
        seen: set[int] = set()
        after = 0  # elements of the units that run between this one's forward and backward
        for index in range(len(self._order) - 1, -1, -1):
            unit = self._order[index]
            if unit is self.root or id(unit) in seen:
                continue
            seen.add(id(unit))
            if 2 * after > self.max_reuse_numel or after + unit.numel > room:
                break
            kept.add(index)
            after += unit.numel
        return kept

    def _reused(self, index: int) -> bool:
        return self._order_ok and index in self._kept  # empty while the order is recorded

    def _end_forward(self, backward_follows: bool) -> None:
        keep: set[int] = set()
        if backward_follows:  # see [Note: no release just before a re-gather]
            keep.add(id(self.root))
            if self._order and self._ran_last(self._order[-1], len(self._order) - 1):
                keep.add(id(self._order[-1]))
            if self._order_ok:
                keep |= {id(self._order[i]) for i in self._kept}
        for u in self.units:  # including prefetches that the forward never used
            if id(u) not in keep:
                self._release(u)
        self.state = TrainingState.IDLE

    def release_all(self) -> None:
        """Release every unit (before the optimizer step or a load changes the shards)."""
        for u in self.units:
            self._release(u)

    def _start_backward(self) -> None:
        self.state = TrainingState.BACKWARD
        self._reducing = self.should_reduce()
        if self._reducing:
            self._dirty = False  # this backward's reduction carries the accumulated .grad
        for u in self.units:
            u.launched = 0
            for g in u.trainable_groups:
                g.begin_backward()
        queue_end_of_backward(self._end_backward)

    def _end_backward(self) -> None:
        if self._reducing:
            for u in self.units:  # groups with a parameter that got no gradient
                for g in u.trainable_groups[u.launched :]:
                    self.queue.launch(g, self.scaling)
                u.launched = len(u.trainable_groups)
            self.queue.drain()
        else:
            self._dirty = True
        for u in self.units:
            self._release(u)
        self.state = TrainingState.IDLE

    def flush_unreduced(self) -> None:
        """Launch reductions for gradients accumulated under ``no_sync`` (optimizer step)."""
        if not self._dirty:
            return
        self._dirty = False
        for u in self.units:
            for g in u.trainable_groups:
                g.begin_backward()
                self.queue.launch(g, self.scaling)

    def finish(self) -> None:
        self.queue.drain()

    # -- gather / release with live-memory accounting ----------------------------------------

    def _gather(self, unit: Unit, wait: bool) -> None:
        if not unit.gathered:
            for g in unit.groups:
                g.gather(async_op=True)
            self.live_numel += unit.numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        if wait:
            for g in unit.groups:
                g.wait_gathered()

    def _release(self, unit: Unit) -> None:
        if unit.gathered:
            for g in unit.groups:
                g.release()
            self.live_numel -= unit.numel

    def _prefetch(self, indices: range) -> None:
        """Gather the units coming next (``indices`` of the recorded order) until
        ``stage3_prefetch_bucket_size`` elements are ahead of the one running: units a
        previous call already prefetched count against it, so the units gathered ahead stay
        about one bucket whatever the depth of the model (else each call would add a bucket
        and the gathered parameters grow up to ``stage3_max_live_parameters``)."""
        budget = self.prefetch_numel
        for i in indices:
            unit = self._order[i]
            if unit is self.root:
                continue
            if budget <= 0:
                return
            if not unit.gathered:
                if self.live_numel + unit.numel > self.max_live_numel:
                    return
                self._gather(unit, wait=False)
            budget -= unit.numel
