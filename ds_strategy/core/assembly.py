"""Engine assembly: :class:`EngineBuilder` puts a :class:`~ds_strategy.ZeroEngine` together
from the resolved config and returns its named :class:`EngineParts`.

[Note: engine assembly]
``ZeroEngine.__init__`` asks the builder for its parts and installs them; the builder runs
its steps in this order, each from the resolved config and the parts built before it:

1. ``resolve``: the config resolved for the data-parallel ranks, and the job's topology;
2. ``adopt``: checks every rank agrees on before anything is built, quantization-aware
   layers, and the engine's place in a checkpoint (:class:`CheckpointPlace`);
3. ``lay_out``: the ranks (:class:`Ranks`): the rank layout (``core/layout.py``), which
   creates every group; tensor-parallel layers over consecutive ranks, ZeRO over the
   others, hierarchically or in MiCS shard groups;
4. ``precision``: compute and master dtypes, the fp16 loss scaler, how gradients are scaled
   when reduced (:class:`PrecisionParts`), activation checkpointing;
5. ``offload``: the offload tier, which takes the groups as they are built;
6. ``sharding``: the plan (flat groups; ZeRO-3 units built one at a time) and its reducer;
7. ``optimizer``: the user's (or the config's) optimizer rebuilt over this rank's shards,
   and its lr scheduler (:class:`OptimizerParts`);
8. ``compression``: top-k gradient compression, or a 1-bit optimizer's exchange.

What the parts ask of the running loop (may gradients be reduced now, the loss scale, the
steps taken) they ask through :class:`LoopHooks`, which the engine answers. The rule table
(``config/rules.py``) runs at steps 3, 4 and 8 with the facts known by then; each local step
that may fail on one rank only runs inside an agreement point (``faults.together``), so every
rank raises the same error.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, ZeroConfig, load_config
from ..config.rules import Facts, check_rules
from .activation_checkpointing import apply_activation_checkpointing
from .checkpoint.validate import META_FILE
from .collectives import Comm
from .compression.onebit_reduce import OneBitReduction
from .compression.reduction import GradientCompression
from .compression.topk_reduce import TopKReduction
from .compression.zeroone_reduce import ZeroOneReduction
from .faults import together
from .fingerprint import check_ranks_agree
from .hierarchical import HierarchicalComm
from .layout import RankLayout
from .memory import ModelStateMeter
from .mesh import ParallelMesh
from .mics import MiCSComm
from .moe.parallel import ExpertParallel, layer_ep_size
from .offload import Offload
from .optim.lowbit import QuantizedStates, lowbit_block
from .optim.muon import Muon
from .optim.onebit import CompressedExchange, MomentumCompressed
from .optim.zeroone import ZeroOneAdam
from .optimizers import evaluation_optimizer, optimizer_factory, track_optimizer_step
from .ownership import check_parameters_free
from .parallel_dims import ParallelDims
from .precision.loss_scaler import LossScaler
from .precision.policy import COMM_DTYPES, PrecisionPolicy
from .precision.step import DEFAULT_CHUNK, RoundedStep
from .profiling.comms import CommsLogger
from .quant.qat import prepare_qat
from .quant.scheme import QuantScheme
from .schedulers import build_scheduler
from .sequence import SequenceParallel, apply_tiling
from .stage_context import StageContext
from .timers import StepTimers
from .topology import Topology
from .tp import TensorParallel, resolve_plan
from .zero.builders import ExpertGroups, ShardingPlan, build_plan
from .zero.flat_group import GradScaling
from .zero.optimizer import OptimizerLike, ShardedOptimizer, rebuild_optimizer

__all__ = [
    "CheckpointPlace",
    "EngineBuilder",
    "EngineParts",
    "LoopHooks",
    "OptimizerParts",
    "PrecisionParts",
    "Ranks",
    "pick_device",
]

SchedulerLike = Any  # an LRScheduler bound to the user's optimizer, or optimizer -> scheduler
Compression = TopKReduction | OneBitReduction | ZeroOneReduction


@dataclass(frozen=True)
class LoopHooks:
    """What the built parts ask of the engine's loop while it runs.

    Attributes:
        reduce_every_backward: gradients may be reduced now (not inside ``no_sync``).
        reduce_at_boundary: ... and this backward ends an accumulation window.
        loss_scale: the current fp16 loss scale (1.0 without loss scaling).
        global_steps: optimizer steps run so far, skipped ones included.
        steps_taken: optimizer steps run so far, skipped ones not counted.
    """

    reduce_every_backward: Callable[[], bool]
    reduce_at_boundary: Callable[[], bool]
    loss_scale: Callable[[], float]
    global_steps: Callable[[], int]
    steps_taken: Callable[[], int]


@dataclass(frozen=True)
class Ranks:
    """Where the engine runs: the groups it sends on and how layers split over them.

    Attributes:
        comm: the data-parallel group (hierarchical when ``topology.hierarchical``).
        shard_comm: what ZeRO shards over: ``comm``, or under MiCS a group of it.
        mesh: the parallel mesh (tensor-parallel x data-parallel; flat without TP).
        tensor_parallel: the layers split over tensor-parallel ranks, or None.
        layout: the rank layout: every group above comes from it (a pipeline stage's
            engine shares the pipeline's under tensor parallelism).
        replica: MiCS's replica group, over which the reduced shards are summed; None
            without MiCS.
        sequence: sequence and context parallelism (``core/sequence``), or None.
        experts: the model's experts spread over expert-parallel ranks (``core/moe``), or
            None.
    """

    comm: Comm
    shard_comm: Comm
    mesh: ParallelMesh
    tensor_parallel: TensorParallel | None
    layout: RankLayout
    replica: Comm | None = None
    sequence: SequenceParallel | None = None
    experts: ExpertParallel | None = None


@dataclass(frozen=True)
class CheckpointPlace:
    """What a checkpoint of the engine needs to know of its place in the job.

    Attributes:
        comm: every rank holding a part of the state (all of them write a save).
        partial: a pipeline stage holds part of a model: a checkpoint it loads may hold more.
        stage: which ``stage_<k>`` of a pipeline checkpoint is its own (None outside one).
        aliases: a weight tied across pipeline stages: this stage's name -> the whole
            model's name, under which it is saved.
    """

    comm: Comm
    partial: bool
    stage: int | None
    aliases: dict[str, str]


@dataclass(frozen=True)
class PrecisionParts:
    """The compute and master dtypes, the fp16 loss scaler (or None), and how gradients are
    scaled when they are reduced."""

    policy: PrecisionPolicy
    scaler: LossScaler | None
    scaling: GradScaling


@dataclass(frozen=True)
class OptimizerParts:
    """The optimizer rebuilt over this rank's shards, its sharded view (pieces, gradient
    norm, clipping, state bytes), and its lr scheduler (or None)."""

    optimizer: Any  # a torch optimizer over this rank's pieces
    sharded: ShardedOptimizer
    lr_scheduler: Any
    trainable: bool  # False: an evaluation engine, its optimizer a stand-in


@dataclass(frozen=True)
class EngineParts:
    """An engine's named parts, each built from the resolved config by
    :class:`EngineBuilder`."""

    config: ZeroConfig
    topology: Topology
    device: torch.device
    ranks: Ranks
    qat: dict[str, str]  # layer -> fake quantization (quantization.qat)
    checkpoint: CheckpointPlace
    precision: PrecisionParts
    timers: StepTimers | None
    offload: Offload | None
    plan: ShardingPlan
    optimizer: OptimizerParts
    compression: GradientCompression | None


class EngineBuilder:
    """Builds the parts of one engine (see [Note: engine assembly]).

    Args:
        model: the model the engine trains (its parameters are sharded in place).
        config: anything :func:`~ds_strategy.config.load_config` reads.
        comm: the group the engine runs on.
        process_group: the user's process group for it (None: the default group).
        pipeline_stage: a pipeline stage's engine: its stage, mesh and the whole model.
        loop: what the parts ask of the running loop.
        meter: where model state is counted (a new one by default); pass the one ``comm``
            reports its scratch to (``Comm(on_scratch=meter.scratch)``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        comm: Comm,
        *,
        process_group: torch.distributed.ProcessGroup | None,
        pipeline_stage: StageContext | None,
        loop: LoopHooks,
        meter: ModelStateMeter | None = None,
    ) -> None:
        self.model = model
        self.comm = comm
        # the plan's meter; the composed collectives' scratch counts in it too (given to each
        # comm built here, and by the caller to ``comm``)
        self.meter = meter or ModelStateMeter()
        self.stage = pipeline_stage
        self.loop = loop
        self.config, self.topology, self.tp = self.resolve(config, process_group)
        self.device = pick_device(model)

    def build(
        self,
        optimizer: OptimizerLike | None,
        lr_scheduler: SchedulerLike | None,
        param_init_fn: Callable[[nn.Module], None] | None,
    ) -> EngineParts:
        """Every part, in the order of [Note: engine assembly]."""
        qat, place = self.adopt()
        ranks = self.lay_out()
        # from here on every collective of the engine's groups is logged (comms_logger)
        ranks.comm.comms_logger = CommsLogger.from_config(self.config.comms_logger, Comm().rank)
        self.device = pick_device(self.model)  # after tensor parallelism placed its layers
        precision = self.precision(ranks, optimizer)
        timers = StepTimers.from_config(self.config, ranks.comm, self.device)  # or None
        offload = self.offload(ranks, precision.policy, optimizer)
        plan = self.sharding(ranks, precision, offload, param_init_fn)
        opt = self.optimizer(ranks, plan, offload, optimizer, lr_scheduler)
        compression = self.compression(ranks, plan, opt, offload)  # checks the optimizer's rules
        self.state_formats(plan, opt, precision.policy)
        return EngineParts(
            config=self.config,
            topology=self.topology,
            device=self.device,
            ranks=ranks,
            qat=qat,
            checkpoint=place,
            precision=precision,
            timers=timers,
            offload=offload,
            plan=plan,
            optimizer=opt,
            compression=compression,
        )

    # -- the steps, in the order build runs them -------------------------------------------

    def resolve(
        self, config: Any, process_group: torch.distributed.ProcessGroup | None
    ) -> tuple[ZeroConfig, Topology, int]:
        """The config resolved for the data-parallel ranks, the job's topology, and the
        tensor-parallel size."""
        with together(self.comm):
            loaded = load_config(config)
            built_with = layer_ep_size(self.model)  # how DeepSpeed-MoE layers spread experts
            if loaded.moe.ep_size == 1 and built_with > 1:
                loaded = loaded.replace(**{"moe.ep_size": built_with})
            facts = Facts(in_pipeline=self.stage is not None, sub_group=process_group is not None)
            check_rules(loaded, facts, "engine")  # see config/rules.py
            mesh = self.stage.mesh if self.stage is not None else None
            tp = _tensor_parallel_size(loaded, self.comm, mesh)
            # batch sizes count data-parallel ranks: tensor- and sequence-parallel ones share
            # each batch
            data = _data_parallel_size(loaded, self.comm, tp, self.stage is not None)
            resolved = loaded.resolve(world_size=data)
            world = Comm()  # the topology is the job's, whatever group this engine runs on
            topology = Topology.detect(
                world.world_size, world.rank, resolved.topology.ranks_per_machine
            )
            # from here on (the checks that ranks agree) its bytes count under their link
            self.comm.link = topology.link(self.comm.global_ranks())
        return resolved, topology, tp

    def adopt(self) -> tuple[dict[str, str], CheckpointPlace]:
        """Checks before anything a rank may refuse, quantization-aware layers, and what a
        checkpoint of the engine needs to know of the model."""
        model, stage = self.model, self.stage
        check_ranks_agree(self.comm, self.config, model)
        with together(self.comm):
            check_parameters_free(model)  # no other engine's parameters (core/ownership.py)
        qat: dict[str, str] = {}
        if self.config.quantization.qat:
            with together(self.comm):
                qat = _prepare_qat(model, self.config, self.tp)
        place = CheckpointPlace(
            comm=self.comm,
            partial=stage is not None,
            stage=stage.stage if stage is not None else None,
            aliases=_tied_aliases(model, stage.whole_model) if stage is not None else {},
        )
        return qat, place

    def lay_out(self) -> Ranks:
        """The rank layout and its groups: tensor-parallel layers over consecutive ranks, ZeRO
        over the others (hierarchically, or in MiCS shard groups, as configured)."""
        zc, comm, model = self.config.zero_optimization, self.comm, self.model
        layout = self._layout()
        mesh = ParallelMesh.of(layout)
        tensor_parallel: TensorParallel | None = None
        if self.tp > 1:  # split the layers over consecutive ranks, then ZeRO over the others
            with together(comm):
                tp_plan = resolve_plan(model, self.tp, self.config.tensor_parallel.plan)
            given = self.stage.mesh if self.stage is not None else None
            mesh = given or ParallelMesh.of(layout, self.device)
            assert mesh.device_mesh is not None
            tp_comm = layout.comm("tp")
            tensor_parallel = TensorParallel(model, mesh.device_mesh["tp"], tp_plan, tp_comm)
            # ZeRO over the ranks of each tensor-parallel place: data x sequence ranks
            zero_ranks = ("dp", "cp", "sp") if self._sequence_ranks > 1 else "dp"
            comm = layout.comm(zero_ranks, on_scratch=self.meter.scratch)
        for c in (comm, self.comm, *([tensor_parallel.comm] if tensor_parallel else [])):
            c.link = self.topology.link(c.global_ranks())
        # ZeRO's group, on one machine: its collectives through shared memory (core/shm.py)
        comm.shared_memory = self.config.topology.shared_memory and comm.link == "intra"
        if self.config.topology.hierarchical:  # ZeRO's collectives in two levels
            comm = HierarchicalComm.build(comm.group, layout, on_scratch=self.meter.scratch)
        with together(comm):  # see config/rules.py
            check_rules(self.config, self.facts(comm, tensor_parallel), "ranks")
        shard_comm: Comm = comm
        replica: Comm | None = None
        if zc.mics_shard_size > 0:
            shard_comm = MiCSComm.build(comm, zc.mics_shard_size, layout)
            replica = shard_comm.replica
        sequence = self._sequence(layout)
        experts = None
        if self.config.moe.ep_size > 1:  # each rank keeps its own experts
            with together(comm):
                edp = layout.comm("edp", on_scratch=self.meter.scratch)
                experts = ExpertParallel(model, layout.comm("ep"), edp)
        return Ranks(comm, shard_comm, mesh, tensor_parallel, layout, replica, sequence, experts)

    @property
    def _sequence_ranks(self) -> int:
        """How many ranks share each sequence (context x sequence parallel)."""
        return self.config.layout.sp * self.config.layout.cp

    def _sequence(self, layout: RankLayout) -> SequenceParallel | None:
        """Sequence and context parallelism over the layout's groups, or None."""
        if self._sequence_ranks == 1:
            return None
        wire = self.config.seq_parallel_communication_data_type
        return SequenceParallel(
            layout.comm("sp"),
            layout.comm("cp"),
            layout.comm(("cp", "sp")),
            COMM_DTYPES[wire.value] if wire is not None else None,
        )

    def _layout(self) -> RankLayout:
        """The engine's rank layout: over its group, or (a pipeline stage's engine under
        tensor parallelism) the pipeline's, told the machines now known."""
        given = self.stage.mesh if self.stage is not None else None
        if given is not None and given.layout is not None:
            given.layout.place_on(self.topology)
            return given.layout
        sp, cp = self.config.sequence_parallel_size, self.config.context_parallel_size
        ep = self.config.moe.ep_size
        dims = ParallelDims(self.comm.world_size, tp=self.tp, sp=sp, cp=cp, ep=ep)
        return RankLayout(dims, self.topology, self.comm)

    def precision(self, ranks: Ranks, optimizer: OptimizerLike | None) -> PrecisionParts:
        """Precision and loss scaling, how gradients are scaled when reduced, and
        activation checkpointing. A low-bit optimizer's block aligns the shards."""
        with together(ranks.comm):
            check_rules(self.config, Facts(), "config")  # see config/rules.py
            policy = PrecisionPolicy.from_config(self.config)
            if optimizer is None and self.config.optimizer is not None:
                optimizer = optimizer_factory(self.config.optimizer)
            block, state_bytes = lowbit_block(optimizer)
            muon = _is_muon(optimizer)
            policy = dataclasses.replace(
                policy,
                state_block=block,
                quantized_state_bytes=state_bytes,
                matrix_moments=1 if muon else None,
            )
            scaler = LossScaler.from_config(self.config.fp16) if policy.loss_scaling else None
            scaling = GradScaling.of(
                # the mean over data-parallel ranks: sequence ranks' gradients add up
                ranks.comm.world_size // self._sequence_ranks,
                self.config.prescale_gradients,
                self.config.gradient_predivide_factor,
            )
            apply_activation_checkpointing(self.model, self.config.activation_checkpointing)
            apply_tiling(self.model, self.config.tiling)
        return PrecisionParts(policy, scaler, scaling)

    def offload(
        self, ranks: Ranks, precision: PrecisionPolicy, optimizer: OptimizerLike | None
    ) -> Offload | None:
        """The offload tier (or None); it takes the groups as they are built, and a streaming
        build opens its swap files for the whole model first."""
        comm = ranks.comm
        with together(comm):
            offload = Offload.build(self.config, [], comm.rank, comm)
            if offload is not None and offload.streams_build:
                shards = ranks.shard_comm.world_size
                params = self.model.parameters()
                offload.open_for_build(
                    _shard_bytes(self.model, shards, precision),
                    -(-sum(p.numel() for p in params if p.requires_grad) // shards),
                    optimizer,
                    META_FILE,
                )
        return offload

    def sharding(
        self,
        ranks: Ranks,
        precision: PrecisionParts,
        offload: Offload | None,
        param_init_fn: Callable[[nn.Module], None] | None,
    ) -> ShardingPlan:
        """The sharding plan: flat groups (ZeRO-3: units, built one at a time) and the reducer."""
        plan = build_plan(
            self.model,
            ranks.shard_comm,
            self.config,
            self.device,
            precision.scaling,
            should_reduce_every_backward=self.loop.reduce_every_backward,
            should_reduce_at_boundary=self.loop.reduce_at_boundary,
            param_init_fn=param_init_fn,
            precision=precision.policy,
            on_groups=offload.adopt if offload is not None else None,
            meter=self.meter,
            store=offload.store if offload is not None else None,
            layout=ranks.layout,
            replica=ranks.replica,
            experts=_expert_groups(ranks.experts),
        )
        # parameters a pipeline materialised before this engine (the optimizer may hold the
        # meta ones they replaced)
        if self.stage is not None:
            plan.replaced.update(self.stage.replaced)
        if ranks.experts is not None:  # a meta-device model's experts are new parameters
            ranks.experts.rekey(plan.replaced)
        if offload is not None:  # what comes back from NVMe: in the peak too
            offload.set_meter(plan.meter)
        return plan

    def optimizer(
        self,
        ranks: Ranks,
        plan: ShardingPlan,
        offload: Offload | None,
        optimizer: OptimizerLike | None,
        lr_scheduler: SchedulerLike | None,
    ) -> OptimizerParts:
        """The user's (or the config's) optimizer rebuilt over this rank's shards, and its lr
        scheduler; a model without trainable parameters gets a stand-in for evaluation."""
        with together(ranks.comm):
            trainable = any(p.requires_grad for p in self.model.parameters())
            optimizer = self._the_optimizer(ranks, plan, optimizer, trainable)
            # the optimizer's pieces are views of masters a streaming build has written out
            viewable = offload.viewable() if offload else contextlib.nullcontext()
            with viewable:
                opt, pieces = rebuild_optimizer(optimizer, plan.groups, plan.replaced)
                tp = ranks.tensor_parallel
                sharded = ShardedOptimizer(
                    opt,
                    pieces,
                    plan.groups,
                    ranks.shard_comm,
                    tp_norm=(tp.norm_weight, tp.comm) if tp is not None else None,
                    replica=ranks.replica,
                    matrix_chunk=min(self.config.zero_optimization.sub_group_size, 1 << 22),
                )
            if offload is not None:
                offload.attach(sharded, META_FILE)
            if self.config.scheduler is not None:
                if lr_scheduler is not None:
                    raise ValueError(
                        f"the config has a scheduler section ({self.config.scheduler.type}) "
                        "and lr_scheduler= was passed too: keep one of them"
                    )
                section = self.config.scheduler
                scheduler = build_scheduler(section.type, dict(section.params), opt)
            else:
                scheduler = _bind_scheduler(lr_scheduler, opt)
        return OptimizerParts(opt, sharded, scheduler, trainable)

    def state_formats(
        self, plan: ShardingPlan, opt: OptimizerParts, policy: PrecisionPolicy
    ) -> None:
        """How the optimizer keeps its state below fp32: torchao's quantized state per shard
        (``core/optim/lowbit.py``); low-precision master weights or optimizer states, stepped
        in fp32 chunks and rounded back stochastically (``core/precision/step.py``)."""
        if not opt.trainable:
            return
        sharded = opt.sharded
        if policy.quantized_state_bytes:
            sharded.quantized = QuantizedStates(opt.optimizer, sharded.pieces, policy.state_block)
        if policy.rounded_step:
            chunk = min(self.config.zero_optimization.sub_group_size, DEFAULT_CHUNK)
            ordinals = {id(p): i for i, p in enumerate(self.model.parameters())}
            state_dtype = policy.state_dtype
            sharded.stepper = RoundedStep(sharded, ordinals, state_dtype, chunk, plan.meter)

    def _the_optimizer(
        self,
        ranks: Ranks,
        plan: ShardingPlan,
        optimizer: OptimizerLike | None,
        trainable: bool,
    ) -> OptimizerLike:
        """What to rebuild: the user's optimizer, the config's, or the evaluation stand-in."""
        model = self.model
        if not trainable:
            if optimizer is not None or self.config.optimizer is not None:
                raise ValueError(
                    f"{type(model).__name__} has no trainable parameters (requires_grad is "
                    "False on all of them), so an optimizer would train nothing; unfreeze "
                    "the parameters to train, or pass optimizer=None (and no optimizer "
                    "section) to build an engine for evaluation"
                )
            return evaluation_optimizer
        if optimizer is None:
            if self.config.optimizer is None:
                raise ValueError(
                    "no optimizer: pass a torch.optim.Optimizer (or a callable params -> "
                    "Optimizer) to ds_strategy.initialize, or add an 'optimizer' section to "
                    "the config"
                )
            return optimizer_factory(self.config.optimizer)
        if ranks.tensor_parallel is not None:  # the user's optimizer holds full weights
            plan.replaced.update(ranks.tensor_parallel.replaced)
        whole = self.stage.whole_model if self.stage is not None else None
        dropped = ranks.experts.dropped if ranks.experts is not None else frozenset()
        _check_optimizer_params(optimizer, model, plan.replaced, whole, dropped)
        return optimizer

    def compression(
        self, ranks: Ranks, plan: ShardingPlan, opt: OptimizerParts, offload: Offload | None
    ) -> Compression | None:
        """``gradient_compression``: the top-k exchange the reducer runs after warm-up; a
        1-bit optimizer (``OneBitAdam``, ``OneBitLamb``): its compressed momentum exchange
        after ``freeze_step``; ``ZeroOneAdam``: its 1-bit gradients and synchronisations."""
        gc, optimizer = self.config.gradient_compression, opt.optimizer
        with together(ranks.comm):  # see config/rules.py
            facts = self.facts(ranks.comm, ranks.tensor_parallel, offload, optimizer)
            check_rules(self.config, facts, "optimizer")
        compression: Compression | None = None
        if isinstance(optimizer, CompressedExchange):
            compression = self._onebit(ranks, plan, opt)
        elif gc.method != "none" and opt.trainable and plan.reducer is not None:
            check_rules(self.config, facts, "compression")  # see config/rules.py
            momentum = _take_sgd_momentum(optimizer) if gc.momentum_correction else 0.0
            compression = TopKReduction(
                plan.groups,
                ranks.comm,
                gc.ratio,
                gc.warmup_steps,
                momentum,
                loss_scale=self.loop.loss_scale,
                optimizer_steps=self.loop.global_steps,
            )
        if compression is not None:
            assert plan.reducer is not None
            plan.reducer.compression = compression
        return compression

    def _onebit(
        self, ranks: Ranks, plan: ShardingPlan, opt: OptimizerParts
    ) -> OneBitReduction | ZeroOneReduction | None:
        """A 1-bit / 0-1 optimizer's exchange (the rule table has refused what it cannot
        run with)."""
        if plan.reducer is None or ranks.comm.world_size == 1:
            return None  # nothing to exchange: it trains as its dense warm-up does
        hooks: dict[str, Any] = dict(
            loss_scale=self.loop.loss_scale,
            optimizer_steps=self.loop.steps_taken,
            clip=self.config.gradient_clipping,
        )
        if isinstance(opt.optimizer, ZeroOneAdam):
            return ZeroOneReduction(plan.groups, ranks.comm, opt.optimizer, **hooks)
        assert isinstance(opt.optimizer, MomentumCompressed)
        pieces = opt.sharded.pieces
        return OneBitReduction(plan.groups, pieces, ranks.comm, opt.optimizer, **hooks)

    def facts(
        self,
        comm: Comm,
        tensor_parallel: TensorParallel | None,
        offload: Offload | None = None,
        optimizer: Any = None,
    ) -> Facts:
        """What the rule table (``config/rules.py``) needs to know besides the config."""
        return Facts(
            world_size=comm.world_size,
            ranks_per_machine=self.topology.ranks_per_machine,
            in_pipeline=self.stage is not None,
            tensor_parallel=tensor_parallel is not None,
            offload=offload is not None,
            optimizer=type(optimizer).__name__ if optimizer is not None else "",
            sgd=isinstance(optimizer, torch.optim.SGD),
            momenta=tuple(
                float(g.get("momentum", 0.0)) for g in getattr(optimizer, "param_groups", ())
            ),
            compressed_optimizer=isinstance(optimizer, CompressedExchange),
            local_steps=isinstance(optimizer, ZeroOneAdam),
        )


def _expert_groups(experts: ExpertParallel | None) -> ExpertGroups | None:
    if experts is None:
        return None
    return ExpertGroups(frozenset(experts.params), experts.data)


def pick_device(model: nn.Module) -> torch.device:
    """Where the model's tensors are; a model all on the meta device: cuda, else cpu."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _prepare_qat(model: nn.Module, config: ZeroConfig, tp: int) -> dict[str, str]:
    """``quantization.qat``: the layers the quantization converts train fake-quantized."""
    qc = config.quantization
    check_rules(config, Facts(tensor_parallel=tp > 1), "quantization")  # see config/rules.py
    assert qc.bits is not None  # qat without bits is refused by the rules above
    scheme = QuantScheme(qc.bits, qc.group_size, qc.symmetric)
    return prepare_qat(
        model,
        scheme,
        embeddings=qc.embeddings,
        modules_to_not_convert=list(qc.modules_to_not_convert),
    )


def _tied_aliases(part: nn.Module, whole: nn.Module) -> dict[str, str]:
    """``part``'s parameter names -> the name ``whole`` gives the same tensor first, where
    they differ (a pipeline stage's copy of a weight tied to an earlier stage's)."""
    first: dict[int, str] = {}
    for name, p in whole.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    out = {}
    for name, p in part.named_parameters():
        canonical = first.get(id(p), name)
        if canonical != name:
            out[name] = canonical
    return out


def _take_sgd_momentum(optimizer: torch.optim.Optimizer) -> float:
    """Momentum correction accumulates the velocity before compression, so it replaces the
    optimizer's momentum: SGD's (one value for all groups; the rule table has checked it) is
    taken and set to 0 here."""
    momenta = {float(g.get("momentum", 0.0)) for g in optimizer.param_groups}
    for g in optimizer.param_groups:
        g["momentum"], g["nesterov"] = 0.0, False
    return momenta.pop()


def _data_parallel_size(cfg: ZeroConfig, comm: Comm, tp: int, in_pipeline: bool) -> int:
    """The ranks reading different batches: the world over the tensor-parallel and sequence
    sizes, each checked (against the world, and sequences against the pipeline)."""
    sp, cp = cfg.sequence_parallel_size, cfg.context_parallel_size
    if sp * cp == 1:
        return comm.world_size // tp  # tp was checked by _tensor_parallel_size
    if in_pipeline:
        key = "sequence_parallel_size" if sp > 1 else "context_parallel_size"
        raise ConfigError(
            f"{key}: sequence and context parallelism do not run inside pipeline stages yet; "
            "train without pipeline.stages, or without splitting sequences",
            key=key,
        )
    return ParallelDims(comm.world_size, tp=tp, sp=sp, cp=cp).dp  # a size that does not fit raises


def _tensor_parallel_size(
    cfg: ZeroConfig,
    comm: Comm,
    mesh: ParallelMesh | None,
) -> int:
    tp = cfg.layout.tp  # "auto": 1, as resolving makes it
    if tp == 1:
        return 1
    if mesh is not None:  # a pipeline stage: the pipeline built the mesh
        assert mesh.tp == tp and mesh.dp * tp == comm.world_size, (mesh, comm.world_size)
        return tp
    ParallelDims(comm.world_size, tp=tp)  # an error naming the key unless T divides it
    return tp


def _shard_bytes(model: nn.Module, shards: int, precision: PrecisionPolicy) -> int:
    """This rank's bytes of ZeRO-3 parameter shards and fp32 masters: what a streaming build
    writes to the swap directory (the parameters' shapes are known on the meta device)."""
    params = list(model.parameters())  # a tied weight once
    elem = torch.empty((), dtype=precision.param_dtype).element_size()
    total = -(-sum(p.numel() for p in params) // shards) * elem
    if precision.master_weights and precision.param_dtype != torch.float32:
        total += -(-sum(p.numel() for p in params if p.requires_grad) // shards) * 4
    return total


def _is_muon(optimizer: object) -> bool:
    """Muon (ours or torch's), or the config's factory of it: one momentum per matrix element."""
    cls = getattr(optimizer, "optimizer_class", None) or type(optimizer)
    return isinstance(cls, type) and issubclass(cls, (Muon, torch.optim.Muon))


def _check_optimizer_params(
    optimizer: OptimizerLike,
    model: nn.Module,
    replaced: dict[int, nn.Parameter],
    whole_model: nn.Module | None,
    dropped: frozenset[int] = frozenset(),
) -> None:
    """An optimizer built over another model's parameters would train nothing, silently.
    ``whole_model``: a pipeline stage's engine gets the optimizer of the whole model, whose
    other parameters belong to the other stages. ``dropped``: the other ranks' experts."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # a factory: it is called with the shards
    held = [replaced.get(id(p), p) for g in optimizer.param_groups for p in g["params"]]
    mine = {id(p) for p in model.parameters()}
    allowed = mine | ({id(p) for p in whole_model.parameters()} if whole_model else set())
    allowed |= dropped
    belong = sum(id(p) in mine for p in held)
    foreign = sum(id(p) not in allowed for p in held)
    if held and (belong == 0 or foreign):
        raise ValueError(
            f"the optimizer holds {len(held)} parameters and {belong} of them belong to the "
            f"model ({type(model).__name__}, {len(mine)} parameters): build it over this "
            "model's parameters (torch.optim.AdamW(model.parameters(), ...)), after any "
            "weight tying or freezing, and pass that same model to initialize"
        )


def _bind_scheduler(sched: SchedulerLike | None, opt: torch.optim.Optimizer) -> Any:
    if sched is None:
        return None
    if callable(sched) and not hasattr(sched, "step"):
        return sched(opt)
    # A scheduler built on the user's optimizer: point it at the rebuilt one. The param
    # groups kept every key (initial_lr included), so its schedule is unchanged.
    sched.optimizer = opt
    # LRScheduler warns when optimizer.step lacks its wrapper; the rebuilt optimizer's step is
    # still the one it expects to be called before scheduler.step().
    track_optimizer_step(opt)
    return sched
