"""Compose a ZeRO stage from its pieces.

Stages 0-2 are bucketed flat groups driven by one ``GradReducer``; stage 3 is per-unit flat
groups driven by ``Stage3Runtime`` plus, for parameters under the persistence threshold,
the same bucketed groups stage 2 uses. What each stage keeps sharded is a ``GroupPolicy``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...config import ZeroConfig
from ..collectives import Comm, Work
from ..faults import together
from ..heap import keep_freed_blocks
from ..layout import RankLayout
from ..materialize import has_meta, loaded_later, materialize_modules, own_init
from ..memory import ModelStateMeter
from ..precision.policy import PrecisionPolicy
from ..progress import Progress
from .flat_group import FlatParamGroup, GradScaling, GroupMaker, GroupPolicy
from .inflight import ReductionQueue
from .layout import split_into_buckets
from .reducer import GradReducer
from .stage3 import Stage3Runtime, Unit, build_groups
from .stores import DeviceStore, ShardStore
from .transports import Transport, stage3_transport
from .units import plan_units

_T = TypeVar("_T", bound=torch.Tensor)

__all__ = ["ExpertGroups", "ShardingPlan", "build_plan"]

POLICIES = {
    0: GroupPolicy(shard_optimizer=False, shard_grads=False, shard_params=False),
    1: GroupPolicy(shard_optimizer=True, shard_grads=False, shard_params=False),
    2: GroupPolicy(shard_optimizer=True, shard_grads=True, shard_params=False),
}


@dataclass
class ShardingPlan:
    """[Note: overlapping the post-step all-gather]
    Under stages 1/2 every rank updates only its slice, so the full parameters must be
    all-gathered after the step. With ``overlap_comm`` the gathers are launched in forward
    order and each unit's forward pre-hook waits only for the groups holding its own
    parameters, so the next forward starts as soon as the embedding has arrived. The
    optimizer step and anything that reads the weights (``full_state_dict``) wait for all.
    """

    groups: list[FlatParamGroup]  # every flat group (the optimizer's view of the model)
    reducer: GradReducer | None
    stage3: Stage3Runtime | None = None
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    # buffers built on the meta device that no initialisation computed (materialize.py)
    unset_buffers: list[str] = field(default_factory=list)
    meter: ModelStateMeter = field(default_factory=ModelStateMeter)
    overlap_gather: bool = False
    # MiCS's replica group (None otherwise): see [Note: summing over the replicas]
    replica: Comm | None = None
    _gathers: dict[int, Work] = field(default_factory=dict)
    _hooks: list[RemovableHandle] = field(default_factory=list)

    def finish_reduction(self) -> None:
        """[Note: summing over the replicas]
        Finish this step's reductions into the gradient shards. Under MiCS they ran inside
        the shard group; each trainable group's shard is then summed over ``replica`` (one
        all-reduce each, all in flight together). Every
        rank then holds its slice summed over all ranks, as flat ZeRO's reduce-scatter
        gives it: see [Note: MiCS's two groups] in ``core/mics.py``."""
        if self.stage3 is not None:
            self.stage3.flush_unreduced()
            self.stage3.finish()
        if self.reducer is not None:
            self.reducer.finish()
        if self.replica is not None:
            shards = [g.ensure_grad_shard() for g in self.groups if g.trainable]
            for work in [self.replica.all_reduce(t, async_op=True) for t in shards]:
                work.wait()

    def after_optimizer_step(self) -> None:
        if self.stage3 is not None:
            self.stage3.release_all()  # a unit kept gathered by a forward without backward
        for g in self.groups:
            g.drop_secondary()  # hpZ: the shards are about to change
            g.sync_from_master()
        for g in reversed(self.groups):  # groups are in backward order; gather in forward order
            if not g.policy.shard_params and g.policy.shard_optimizer:
                self._gathers[id(g)] = g.all_gather_after_step()
        if not self.overlap_gather:
            self.wait_params()

    def after_load(self) -> None:
        """Shards were overwritten from a checkpoint: rebuild the resident full parameters."""
        if self.stage3 is not None:
            self.stage3.release_all()
        for g in self.groups:
            g.drop_secondary()
            g.sync_from_master()
        for g in self.groups:
            if not g.policy.shard_params and g.policy.shard_optimizer:
                g.all_gather_after_step().wait()

    def wait_params(self, groups: list[FlatParamGroup] | None = None) -> None:
        """Block until the post-step all-gather of ``groups`` (default: all) has landed."""
        for g in self.groups if groups is None else groups:
            work = self._gathers.pop(id(g), None)
            if work is not None:
                work.wait()

    def install_gather_waits(self, model: nn.Module) -> None:
        group_of = {id(p): g for g in self.groups for p in g.params}
        plan = plan_units(model)
        for unit in plan.units:
            mine = {
                id(group_of[id(p)]): group_of[id(p)]
                for p in plan.params[id(unit)]
                if id(p) in group_of
            }
            if mine:
                groups = list(mine.values())
                wait = torch.compiler.disable(lambda *_, gs=groups: self.wait_params(gs))
                self._hooks.append(unit.register_forward_pre_hook(wait))  # eager: see stage3

    def remove_hooks(self) -> None:
        self.wait_params()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.reducer is not None:
            self.reducer.remove_hooks()
        if self.stage3 is not None:
            self.stage3.remove_hooks()

    def full_state_dict(
        self, module: nn.Module, rank0_only: bool = False, rank: int = 0
    ) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights keyed like ``module.state_dict()``; with ``rank0_only``
        only group rank 0 builds them (this process is group rank ``rank``; the others take
        part in the gathers and get ``{}``)."""
        self.wait_params()
        gathered: dict[int, torch.Tensor] = {}
        for g in self.groups:
            if g.policy.shard_params or g.dtype != torch.float32 or g.master is not None:
                # fp32, from the masters when there are any
                full = g.consolidated(0 if rank0_only else None)
                if full is None:
                    continue
                for i, (slot, shape) in enumerate(zip(g.layout.slots, g.shapes, strict=True)):
                    gathered[id(g.params[i])] = (
                        full[slot.offset : slot.offset + slot.numel].view(shape).clone()
                    )
        if rank0_only and rank != 0:
            return {}
        out = {}
        for name, t in module.state_dict(keep_vars=True).items():
            src = gathered.get(id(t))
            out[name] = src if src is not None else _fp32(t.detach().clone())
        return out

    def memory_report(self) -> dict[str, int]:
        params = grads = 0
        for g in self.groups:
            r = g.resident_bytes()
            params += r["params"]
            grads += r["grads"]
        peak = 0
        if self.stage3 is not None:
            elem = max((g.shard.element_size() for g in self.groups), default=4)
            peak = self.stage3.peak_live_numel * elem
        return {"params": params, "grads": grads, "peak_gathered_params": peak}


def group_numel(config: ZeroConfig, comm: Comm) -> int:
    """Elements per flat group: a reduce bucket (``reduce_bucket_size``), or half of one
    where a reduce-scatter needs a receive buffer as large as its input (gloo), so that a
    group being filled plus one in flight with its receive buffer stay within two buckets."""
    zc = config.zero_optimization
    bucket = zc.reduce_bucket_size
    if zc.stage >= 1 and comm.reduce_needs_scratch:
        return max(1, bucket // 2)
    return bucket


def max_in_flight(config: ZeroConfig, comm: Comm) -> int | None:
    """One reduction in flight where waiting for it frees memory (see inflight.py)."""
    stage = config.zero_optimization.stage
    if stage >= 2 or (stage == 1 and comm.reduce_needs_scratch):
        return 1
    return None


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())  # parameters() already yields a tied weight once


def _buckets(params: list[nn.Parameter], bucket_numel: int) -> list[list[nn.Parameter]]:
    """Reverse registration order (≈ the order backward produces gradients), one dtype per
    bucket, at most ``bucket_numel`` elements each."""
    out: list[list[nn.Parameter]] = []
    run: list[nn.Parameter] = []
    for p in reversed(params):
        if run and p.dtype != run[-1].dtype:
            out.extend(
                [
                    [run[i] for i in b]
                    for b in split_into_buckets([q.numel() for q in run], bucket_numel)
                ]
            )
            run = []
        run.append(p)
    if run:
        out.extend(
            [
                [run[i] for i in b]
                for b in split_into_buckets([q.numel() for q in run], bucket_numel)
            ]
        )
    return out


def _broadcast_loose(tensors: list[torch.Tensor], comm: Comm, precision: PrecisionPolicy) -> None:
    """Parameters outside every flat group (frozen ones under stages 0-2, small frozen ones
    under stage 3) and buffers: rank 0's values everywhere; frozen parameters also take the
    compute dtype (buffers keep theirs, as running statistics want fp32)."""
    with torch.no_grad():
        for t in tensors:
            if isinstance(t, nn.Parameter) and t.is_floating_point() and precision.mixed:
                t.data = t.data.to(precision.param_dtype)
            comm.broadcast(t.data, 0)


def _bucketed_groups(
    params: list[nn.Parameter], make: GroupMaker, policy: GroupPolicy, bucket_numel: int
) -> list[FlatParamGroup]:
    groups = []
    for bucket in _buckets(params, bucket_numel):  # one flat group per bucket
        with together(make.comm):  # an allocation failing on one rank fails all, before broadcast
            g = make(bucket, policy)
            g.load_from_params()
        g.broadcast_and_bind()
        groups.append(g)
    return groups


@dataclass(frozen=True)
class ExpertGroups:
    """Expert parameters and the group they are sharded over (see [Note: expert
    parallelism] in ``core/moe/parallel.py``).

    Attributes:
        params: ids of the expert parameters.
        comm: the expert-data-parallel group: the ranks holding the same experts.
    """

    params: frozenset[int]
    comm: Comm


class _Split:
    """Builds a plan's groups, expert parameters apart on their own group when there are."""

    def __init__(
        self,
        make: GroupMaker,
        experts: ExpertGroups | None,
        replaced: dict[int, nn.Parameter],
    ) -> None:
        self.make, self.experts = make, experts
        # parameters materialised from the meta device replace the ones the experts named
        self.replaced = replaced
        self.make_expert = make
        if experts is not None:
            self.make_expert = dataclasses.replace(make, comm=experts.comm)
        self.expert_transport = Transport.plain(self.make_expert.comm)  # ZeRO++ refused

    def _apart(self, params: list[_T]) -> tuple[list[_T], list[_T]]:
        if self.experts is None:
            return params, []
        ids = set(self.experts.params)
        ids |= {id(new) for old, new in self.replaced.items() if old in self.experts.params}
        return [p for p in params if id(p) not in ids], [p for p in params if id(p) in ids]

    def bucketed(
        self, params: list[nn.Parameter], policy: GroupPolicy, bucket_numel: int
    ) -> list[FlatParamGroup]:
        dense, expert = self._apart(params)
        groups = _bucketed_groups(dense, self.make, policy, bucket_numel)
        return groups + _bucketed_groups(expert, self.make_expert, policy, bucket_numel)

    def unit_groups(
        self, params: list[nn.Parameter], bucket_numel: int, transport: Transport, unfilled: bool
    ) -> list[FlatParamGroup]:
        dense, expert = self._apart(params)
        groups = build_groups(dense, self.make, bucket_numel, transport, unfilled)
        return groups + build_groups(
            expert, self.make_expert, bucket_numel, self.expert_transport, unfilled
        )

    def broadcast_loose(self, tensors: list[torch.Tensor], precision: PrecisionPolicy) -> None:
        dense, expert = self._apart(tensors)
        _broadcast_loose(dense, self.make.comm, precision)
        _broadcast_loose(expert, self.make_expert.comm, precision)


def build_plan(
    model: nn.Module,
    comm: Comm,
    config: ZeroConfig,
    device: torch.device,
    scaling: GradScaling,
    should_reduce_every_backward: Callable[[], bool],
    should_reduce_at_boundary: Callable[[], bool],
    param_init_fn: Callable[[nn.Module], None] | None = None,
    precision: PrecisionPolicy | None = None,
    on_groups: Callable[[list[FlatParamGroup]], None] | None = None,
    *,
    meter: ModelStateMeter | None = None,
    store: Callable[[], ShardStore] | None = None,
    replica: Comm | None = None,
    layout: RankLayout | None = None,
    experts: ExpertGroups | None = None,
) -> ShardingPlan:
    """The groups, reducer and (stage 3) runtime of ``model``; ``on_groups`` is handed each
    batch of groups as soon as they are built and bound (stage 3: unit by unit, so that
    the offload tier can write a unit out before the next is built), on every rank together.

    Every group is built with all it uses: the plan's ``meter``, a store from ``store`` (the
    offload tier's; on the device without one) and, at stage 3, the transport ZeRO++
    configures (hpZ's and qgZ's groups from the rank ``layout``). Under MiCS, ``replica`` is
    the replica group the plan sums the gradient shards over (``finish_reduction``). With
    ``experts``, expert parameters are grouped apart and sharded over their own group."""
    zc = config.zero_optimization
    meter = meter or ModelStateMeter()
    precision = precision or PrecisionPolicy()
    make = GroupMaker(comm, device, precision, meter, store or DeviceStore)
    replaced: dict[int, nn.Parameter] = {}
    split = _Split(make, experts, replaced)
    param_init_fn = param_init_fn or own_init(model)
    if zc.stage == 3:
        return _build_stage3(
            model,
            make,
            config,
            scaling,
            should_reduce_every_backward,
            param_init_fn,
            on_groups,
            stage3_transport(comm, config, layout),
            replica,
            split,
        )
    unset: list[str] = []
    if has_meta(model):
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        with together(comm):  # see faults.py: one rank failing fails all, before a broadcast
            materialize_modules(
                list(model.modules()),
                device,
                replaced,
                param_init_fn,
                names,
                unset=unset,
                later=loaded_later(model),
            )
    params = _unique_params(model)
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    policy = POLICIES[zc.stage]
    groups = split.bucketed(trainable, policy, group_numel(config, comm))
    split.broadcast_loose([*frozen, *model.buffers()], precision)
    if on_groups is not None:
        with together(comm):
            on_groups(groups)
    when = should_reduce_every_backward if policy.shard_grads else should_reduce_at_boundary
    queue = ReductionQueue(max_in_flight(config, comm))
    reducer = GradReducer(groups, scaling, when, queue)
    plan = ShardingPlan(
        groups, reducer, replaced=replaced, unset_buffers=unset, meter=meter, replica=replica
    )
    if zc.overlap_comm and policy.shard_optimizer:
        plan.overlap_gather = True
        plan.install_gather_waits(model)
    return plan


def _build_stage3(
    model: nn.Module,
    make: GroupMaker,
    config: ZeroConfig,
    scaling: GradScaling,
    should_reduce: Callable[[], bool],
    param_init_fn: Callable[[nn.Module], None] | None,
    on_groups: Callable[[list[FlatParamGroup]], None] | None,
    transport: Transport,
    replica: Comm | None,
    split: _Split,
) -> ShardingPlan:
    zc = config.zero_optimization
    comm, device, precision = make.comm, make.device, make.precision
    plan = plan_units(model, zc.stage3_param_persistence_threshold)
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    replaced = split.replaced
    unset: list[str] = []
    later = loaded_later(model)  # a strict pretrained load follows: see bind_unfilled
    units: list[Unit] = []
    all_groups: list[FlatParamGroup] = []
    progress = Progress("building the ZeRO-3 model", len(plan.units), comm.rank, "units")
    for index, module in enumerate(plan.units):
        # Materialise and shard one unit at a time: no rank ever holds the whole model. A
        # rank failing to (out of memory, a raising param_init_fn) fails every rank before
        # the unit's broadcast.
        with together(comm):
            owned = plan.owned_modules[id(module)]
            unfilled = bool(later) and all(id(m) in later for m in owned)
            materialize_modules(
                owned, device, replaced, param_init_fn, names, unset=unset, later=later
            )
            params = [replaced.get(id(p), p) for p in plan.params[id(module)]]
            groups = split.unit_groups(params, group_numel(config, comm), transport, unfilled)
            for g in groups if not unfilled else ():
                g.load_from_params()
        for g in groups:
            if unfilled:
                g.bind_unfilled()
            else:
                g.broadcast_and_bind()
        if on_groups is not None:  # e.g. written out before the next unit is built
            with together(comm):
                on_groups(groups)
        units.append(Unit(module, groups, index))
        all_groups.extend(groups)
        progress.advance()
    progress.done()
    persistent = [replaced.get(id(p), p) for p in plan.persistent]
    trainable_small = [p for p in persistent if p.requires_grad]
    small = split.bucketed(trainable_small, POLICIES[2], group_numel(config, comm))
    frozen_small = [p for p in persistent if not p.requires_grad]
    split.broadcast_loose([*frozen_small, *model.buffers()], precision)
    if on_groups is not None:
        with together(comm):
            on_groups(small)
    if device.type == "cpu":  # see [Note: the C heap under stage-3 gathers]
        keep_freed_blocks(max((g.full_nbytes for g in all_groups + small), default=0))
    queue = ReductionQueue(max_in_flight(config, comm))  # shared: one bound for both
    runtime = Stage3Runtime(
        units,
        scaling,
        should_reduce,
        prefetch_numel=zc.stage3_prefetch_bucket_size,
        max_live_numel=zc.stage3_max_live_parameters,
        queue=queue,
        max_reuse_numel=zc.stage3_max_reuse_distance,
    )
    reducer = GradReducer(small, scaling, should_reduce, queue)
    return ShardingPlan(
        all_groups + small,
        reducer,
        runtime,
        replaced=replaced,
        unset_buffers=unset,
        meter=make.meter,
        replica=replica,
    )
