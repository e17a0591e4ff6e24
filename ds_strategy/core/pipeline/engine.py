"""``PipelineEngine``: an ``nn.Sequential`` split into pipeline stages, each stage trained
data-parallel by a :class:`~ds_strategy.core.engine.ZeroEngine` over its ranks.

[Note: one training step]
1. The ``torch.distributed.pipelining`` schedule runs forward and backward of
   ``gradient_accumulation_steps`` micro-batches. Each chunk runs through the stage's
   module, so the stage engine's hooks see every micro-batch. The loss it runs backward
   from is the micro-batch's share of the mean, times the fp16 loss scale. Under ZeRO 0-2
   the stage's ``ZeroEngine`` is in ``no_sync``: gradients accumulate locally. Under ZeRO-3
   each micro-batch gathers a layer's parameters for its forward and backward, prefetching
   the next. It reduce-scatters that layer's gradients as its backward finishes.
2. Tied weights sum their gradients across the stages that hold them.
3. ``engine.reduced_grad_norm()`` reduces over the stage's data-parallel group and returns
   the stage's gradient norm. ZeRO-1 all-reduces into the sharded slice, ZeRO-2
   reduce-scatters the accumulated bucket, ZeRO-3 has reduced already.
4. The squared gradient norms of all stages are summed over the pipeline group, each tied
   weight counted once. ``engine.step(grad_norm=...)`` clips by that global norm of the
   whole model. When it is not finite, every rank skips the step: an fp16 overflow on any
   rank of any stage lowers every rank's loss scale alike. The stage engine's own step
   does the rest: offloaded optimizer state, lr scheduler, counters,
   ``max_consecutive_skipped_steps`` and ``wall_clock_breakdown``. Its periodic checkpoint
   (``checkpoint.save_interval``) goes to ``<save_dir>/stage_<k>``, which
   :meth:`PipelineEngine.load_checkpoint` reads.

The stage engine treats every ``step()`` as an accumulation boundary: the schedule, not the
engine, counts micro-batches.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.optim.lr_scheduler import LRScheduler

from ..._logging import report as show_report
from ...config import ZeroConfig, load_config
from ...config.loop import ConfigSource
from ...config.rules import Facts, check_rules
from ..assembly import pick_device
from ..checkpoint.manager import write_latest
from ..checkpoint.validate import CheckpointError
from ..checkpoint.weights_file import write_weights
from ..collectives import Comm, init_process_group_from_env, world_rank
from ..compiled import CompileBackend, CompileReport
from ..engine import SchedulerLike, ZeroEngine
from ..faults import together
from ..materialize import has_meta, materialize_modules
from ..monitor import TrainingMonitor
from ..monitor.events import engine_comms
from ..precision.policy import PrecisionPolicy
from ..profiling.comms import CommsLogger, CommsReport, format_summary
from ..profiling.flops import FlopsProfiler
from ..profiling.summary import FlopsReport
from ..stage_context import StageContext
from ..timers import phase
from ..zero.optimizer import OptimizerLike
from ..zero.stage3 import Stage3Runtime
from .mesh import Mesh
from .partition import partition_layers
from .schedules import bubble_fraction, make_schedule, stage_indices, stage_layers
from .ties import broadcast_tied, duplicate_sq_norm, find_tied, sum_tied_grads

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["PipelineEngine"]

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


LayerBuilder = Callable[[], nn.Module]


def _as_layers(model: object) -> tuple[list[nn.Module], list[LayerBuilder | None]]:
    """The layers, and for each one given as a callable, that callable (its layer here is
    built on the meta device: shapes for partitioning, no storage)."""
    if isinstance(model, nn.Sequential):
        return list(model), [None] * len(model)
    if (
        isinstance(model, (list, tuple, nn.ModuleList))
        and model
        and all(isinstance(m, nn.Module) or callable(m) for m in model)
    ):
        layers: list[nn.Module] = []
        builders: list[LayerBuilder | None] = []
        for i, m in enumerate(model):
            if isinstance(m, nn.Module):
                layers.append(m)
                builders.append(None)
                continue
            with torch.device("meta"):
                layers.append(_built(m(), i))
            builders.append(m)
        return layers, builders
    raise TypeError(
        f"a pipeline config needs the model as an nn.Sequential or a list of layers, got "
        f"{type(model).__name__}; write it as nn.Sequential(layer, layer, ...) whose layers "
        "each take the previous layer's output (or a list whose items build each layer: "
        "functools.partial(Block, i))"
    )


def _built(layer: object, index: int) -> nn.Module:
    if not isinstance(layer, nn.Module):
        raise TypeError(
            f"pipeline layer {index}: its builder returned {type(layer).__name__}, not an "
            "nn.Module; a list item that is not a module must be a callable returning one"
        )
    return layer


class PipelineEngine:
    """Pipeline stages over ``pipeline.stages`` ranks times ZeRO data parallelism over the rest.

    Build it with ``ds_strategy.initialize(model, optimizer, config, loss_fn=fn)`` on every
    rank. A rank keeps only its stage's layers. It builds only those when the model is on
    the meta device, or a list of layer builders (callables returning one layer each).
    Example, under ``torchrun --nproc-per-node=4`` (2 stages x 2 data-parallel ranks)::

        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        engine = ds_strategy.initialize(
            model, torch.optim.AdamW(model.parameters()),
            {"pipeline": {"stages": 2, "schedule": "1f1b"},
             "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
             "zero_optimization": {"stage": 1}},
            loss_fn=torch.nn.functional.mse_loss)
        loss = engine.train_batch(x, y)   # x, y: this data-parallel rank's 8 samples

    Args:
        model: an ``nn.Sequential`` whose layers each take the previous layer's output. Or
            a list of layers, whose items may be callables building one layer each.
        optimizer: as for :class:`~ds_strategy.ZeroEngine`: an optimizer over the whole
            model's parameters, a callable ``params -> Optimizer``, or None (the config's).
        config: as for :class:`~ds_strategy.ZeroEngine`, with a ``pipeline`` section.
        loss_fn: ``(output, target) -> scalar loss``, run on the last stage.
        lr_scheduler: as for :class:`~ds_strategy.ZeroEngine`.
        param_init_fn: initialises a layer materialised from the meta device.
    """

    def __init__(
        self,
        model: nn.Sequential | Sequence[nn.Module | LayerBuilder],
        optimizer: OptimizerLike | None,
        config: ConfigSource | DictConfig,
        loss_fn: LossFn,
        *,
        lr_scheduler: SchedulerLike | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError("loss_fn: pass a callable (output, target) -> scalar loss")
        init_process_group_from_env()
        with together(Comm()):  # a builder failing on one rank fails every rank
            layers, builders = _as_layers(model)
        raw: ZeroConfig = load_config(config)
        device = pick_device(nn.Sequential(*layers))  # a model all on meta: cuda, else cpu
        self.mesh = Mesh.build(raw.layout.stages, raw.layout.tp, device)
        self.config = raw.resolve(world_size=self.mesh.dp_size)
        check_rules(self.config, Facts(), "pipeline")  # see config/rules.py
        pc = self.config.pipeline
        self.schedule_name: str = pc.schedule
        self.chunks = chunks = pc.stages_per_rank or (2 if pc.schedule == "interleaved_1f1b" else 1)
        micro_batches = self.config.gradient_accumulation_steps
        assert micro_batches is not None  # the resolved config has every batch size
        self.micro_batches: int = micro_batches
        self.micro_batch_size: int | None = self.config.train_micro_batch_size_per_gpu
        n_chunks = self.mesh.pp_size * chunks
        self.bounds = partition_layers(layers, n_chunks, pc.partition_method)
        self.chunk_ids = mine = stage_indices(self.stage_id, self.mesh.pp_size, chunks)
        self._build_stage_engine(
            layers, builders, device, optimizer, lr_scheduler, param_init_fn, n_chunks
        )
        device = self.engine.device
        self._pp = Comm(self.mesh.pp_group)
        self._pp.link = self.engine.topology.link(self._pp.global_ranks())
        # comms_logger: the pipeline group's collectives too (the stage engine logs its own)
        self._pp.comms_logger = CommsLogger.from_config(self.config.comms_logger, Comm().rank)
        self._dp = Comm(self.mesh.dp_group)
        self._stages = [
            _CountingStage(
                _Chunk(
                    self.module,
                    k,
                    self.engine.precision,
                    last=c == n_chunks - 1,
                    profiler=self.engine.flops_profiler,
                ),
                c,
                n_chunks,
                device,
                group=self.mesh.pp_group,
                comm=self._pp,
                stage3=self.engine.plan.stage3,
            )
            for k, c in enumerate(mine)
        ]
        self._loss_fn = loss_fn
        self._schedule = make_schedule(
            pc.schedule, self._stages, self.micro_batches, self._scaled_loss, self.mesh.pp_size
        )
        self._has_first = 0 in mine
        # a tagged save every stage has begun whose root does not name it yet (root, tag); see
        # [Note: a pipeline checkpoint's commit point] in checkpoint/manager.py
        self._uncommitted: tuple[Path, str] | None = None
        self._saves_seen = self.engine.checkpoint_manager.saves
        self._has_last = n_chunks - 1 in mine
        # the config's tensorboard / csv_monitor / wandb / comet sections: written here, with
        # the loss train_batch returns (the stage engines have none, see ZeroEngine)
        self.monitor = TrainingMonitor.from_config(self.config, self._dp, device)

    def _build_stage_engine(
        self,
        layers: list[nn.Module],
        builders: list[LayerBuilder | None],
        device: torch.device,
        optimizer: OptimizerLike | None,
        lr_scheduler: SchedulerLike | None,
        param_init_fn: Callable[[nn.Module], None] | None,
        n_chunks: int,
    ) -> None:
        """This rank's layers (only they are built), the weights tied across stages, and the
        :class:`~ds_strategy.ZeroEngine` over them with the stage's :class:`StageContext`."""
        bounds, mine = self.bounds, self.chunk_ids
        chunk_of_layer = [c for c in range(n_chunks) for _ in range(bounds[c], bounds[c + 1])]
        rank_of_layer = [c % self.mesh.pp_size for c in chunk_of_layer]
        self.tied = find_tied(layers, rank_of_layer, self.mesh)
        tied_stages = tuple(self.tied[0].stages) if self.tied else ()
        check_rules(self.config, Facts(tied_stages=tied_stages), "stages")  # config/rules.py
        own = stage_layers(bounds, self.stage_id, self.mesh.pp_size, self.chunks)
        with together(Comm()):  # building a layer may fail on one rank (memory, a builder)
            replaced = _build_own(layers, builders, own, device, self.config, param_init_fn)
        for t in self.tied:  # the materialised copy of a tied weight is the one kept in sync
            t.param = replaced.get(id(t.param), t.param)  # type: ignore[assignment]
        broadcast_tied(self.tied)
        # the stage's layers under their index in the full model, so state_dict keys match;
        # the schedule runs each chunk through this module, so its hooks (ZeRO-3) see it
        self.module = _StageModule(
            [[(str(i), layers[i]) for i in range(bounds[c], bounds[c + 1])] for c in mine]
        )
        self.engine = ZeroEngine(
            self.module,
            optimizer,
            self._stage_config(),
            lr_scheduler=lr_scheduler,
            # with tensor parallelism the engine splits the layers over the stage's tp ranks
            process_group=self.mesh.stage_group or self.mesh.dp_group,
            param_init_fn=param_init_fn,
            pipeline_stage=StageContext(
                self.stage_id,
                nn.Sequential(*layers),  # the optimizer holds every stage's parameters
                self.mesh.parallel,
                replaced,
                self.mesh.pp_size,
            ),
        )
        with together(Comm()):  # only the owning stages can tell
            self._check_ties_replicated()
        self.engine.set_gradient_accumulation_boundary(True)  # one step() per train_batch

    def _check_ties_replicated(self) -> None:
        tp = self.engine.tensor_parallel
        split = [t for t in self.tied if tp is not None and id(t.param) in tp.replaced]
        if split:
            raise ValueError(
                f"tensor_parallel.plan splits a weight shared by pipeline stages {split[0].stages} "
                "(tied across stages); leave tied weights replicated (remove their layers from "
                "the plan) or keep the layers that share it on one stage"
            )

    def _stage_config(self) -> ZeroConfig:
        """This stage's data-parallel part of the config; its periodic checkpoints go to
        ``<save_dir>/stage_<k>``, where :meth:`load_checkpoint` looks."""
        changes: dict[str, int | str] = {"pipeline.stages": 1}
        save_dir = self.config.checkpoint.save_dir
        if save_dir:
            changes["checkpoint.save_dir"] = str(Path(save_dir) / f"stage_{self.stage_id}")
        return self.config.replace(**changes)

    # -- properties front ends use ---------------------------------------------------------------

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage (0 is the first)."""
        return self.mesh.stage

    @property
    def num_stages(self) -> int:
        """How many pipeline stages the model is split into."""
        return self.mesh.pp_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the ranks running its stage."""
        return self.mesh.dp_rank

    @property
    def data_parallel_size(self) -> int:
        """How many ranks run each stage (data parallel)."""
        return self.mesh.dp_size

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The stage engine's optimizer, over this rank's shards of its stage."""
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> LRScheduler | None:
        """The stage engine's lr scheduler (stepped at every ``train_batch``), or None."""
        return self.engine.lr_scheduler

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped ones included), as the stage engine counts them."""
        return self.engine.global_steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite gradient norm."""
        return self.engine.skipped_steps

    def bubble_fraction(self) -> float:
        """The schedule's theoretical idle fraction for this configuration."""
        return bubble_fraction(self.schedule_name, self.num_stages, self.micro_batches, self.chunks)

    # -- training --------------------------------------------------------------------------------

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the schedule runs backward from: the micro-batch's share of the mean loss,
        times the fp16 loss scale (1 without fp16), which :meth:`_mean_loss` takes out again."""
        return self._loss_fn(output, target) * (self.engine.loss_scale / self.micro_batches)

    def _check_batch(self, inputs: object, targets: object) -> None:
        """Every rank checks what it reads (the first stage its inputs, the last its
        targets), so a wrong batch fails on all stages instead of leaving some waiting."""
        m, mb = self.micro_batches, self.micro_batch_size
        for name, t, used in (
            ("inputs", inputs, self._has_first),
            ("targets", targets, self._has_last),
        ):
            if not used:
                continue
            if not torch.is_tensor(t):
                raise TypeError(f"train_batch / eval_batch: {name} must be a tensor (batch first)")
            n = t.shape[0]
            if n % m or (mb is not None and n != m * mb):
                want = f"{m} x {mb} = {m * mb}" if mb is not None else f"a multiple of {m}"
                raise ValueError(
                    f"train_batch: this data-parallel rank got {n} samples ({name}) but the "
                    f"pipeline runs gradient_accumulation_steps={m} micro-batches of "
                    f"train_micro_batch_size_per_gpu={mb} (expected {want}); pass this rank's "
                    "share of the global batch or change those keys"
                )

    def _run(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None, train: bool
    ) -> torch.Tensor:
        self._check_batch(inputs, targets)
        args = (inputs,) if self._has_first else ()
        losses: list[torch.Tensor] = []
        # the last stage computes the loss; the others pass neither (the schedule's default)
        target, collected = (targets, losses) if self._has_last else (None, None)
        if train:
            # Stages 0-2 accumulate the micro-batches' gradients locally and reduce once, in
            # _step; ZeRO-3 reduce-scatters each micro-batch's as its backward runs, so no
            # full-size gradient outlives the layer it belongs to.
            e = self.engine
            accumulate = e.no_sync() if e.stage < 3 else nullcontext()
            profiled = e.flops_profiler.schedule(e.global_steps) if e.flops_profiler else None
            with accumulate, phase(e.timers, "schedule"), profiled or nullcontext():
                self._schedule.step(*args, target=target, losses=collected)
        else:
            with torch.no_grad():
                self._schedule.eval(*args, target=target, losses=collected)
        return self._mean_loss(losses)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The global batch's mean loss on every rank: summed on the last stage, broadcast
        along the pipeline, averaged over data-parallel ranks."""
        loss = torch.zeros(1, dtype=torch.float64)
        if self._has_last:
            loss += sum(float(x.detach()) for x in losses) / self.engine.loss_scale
        self._pp.broadcast(loss, self.num_stages - 1)
        self._dp.all_reduce(loss)
        return (loss / self.data_parallel_size).float().squeeze(0)

    def train_batch(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One optimizer step over this data-parallel rank's share of the batch.

        That share is ``gradient_accumulation_steps`` micro-batches. Collective: call it on
        every rank.

        Args:
            inputs: the first layer's input, batch first; read on the first stage.
            targets: the loss's targets, batch first; read on the last stage.

        Returns:
            The global batch's mean loss, on every rank.
        """
        loss = self._run(inputs, targets, train=True)
        self._step()
        if self.monitor is not None:
            comms = [*engine_comms(self.engine), self._pp]  # what comm_report() counts
            self.monitor.after_step(self.engine, loss=float(loss), comms=comms)
        return loss

    def eval_batch(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward only, over the micro-batches. Collective.

        Args:
            inputs: as for :meth:`train_batch`.
            targets: as for :meth:`train_batch`.

        Returns:
            The mean loss, on every rank.
        """
        return self._run(inputs, targets, train=False)

    def _step(self) -> None:
        """Steps 2-4 of [Note: one training step]."""
        e = self.engine
        with phase(e.timers, "step"):  # the engine's step adds its own part
            sum_tied_grads(self.tied, e.plan.groups)
            stage_norm = e.reduced_grad_norm()  # over this stage's data-parallel group
            dup = torch.tensor(
                [duplicate_sq_norm(self.tied, list(e.optimizer_pieces), self.stage_id)],
                dtype=torch.float64,
            )
            if e.stage > 0:  # the pieces are this rank's slices: sum them over the group
                self._dp.all_reduce(dup, kind="control")
            sq = torch.tensor([stage_norm**2], dtype=torch.float64) - dup
            self._pp.all_reduce(sq, kind="control")
        total = float(sq)
        norm = math.sqrt(max(total, 0.0)) if math.isfinite(total) else float("inf")
        # A failure on one stage (a periodic save's disk, max_consecutive_skipped_steps) fails
        # every stage, instead of leaving the others waiting in the next schedule.
        with together(self._pp):
            e.step(grad_norm=norm)
        e.plan.wait_params()  # the schedule runs the chunks, not the engine's forward
        self._note_save()  # a periodic one (checkpoint.save_interval)
        self._commit(wait=False)

    def _note_save(self) -> None:
        """Remember the tagged save the stage engine has just begun, to commit at the root."""
        manager = self.engine.checkpoint_manager
        if manager.saves == self._saves_seen:
            return
        self._saves_seen = manager.saves
        final = manager.last_saved
        if final is not None and final.parent.name == f"stage_{self.stage_id}":
            self._uncommitted = (final.parent.parent, final.name)

    def _commit(self, wait: bool) -> None:
        """Name the last tagged save in the root's ``latest`` once every stage has committed
        its part (see the note in checkpoint/manager.py). ``wait=False``: only if no stage is
        still writing its part in the background (one small all-reduce), else at a later
        step; ``wait=True``: after waiting for it. A failed part fails every rank."""
        if self._uncommitted is None:
            return
        world = Comm()
        if not wait:
            writing = torch.tensor([float(self.engine.checkpoint_manager.writing())])
            world.all_reduce(writing, kind="control")
            if writing.item():
                return
        root, tag = self._uncommitted
        self._uncommitted = None
        with together(world, CheckpointError):  # every stage's part committed, or the error
            self.engine.wait_for_checkpoint()
        with together(world, CheckpointError):
            if world.rank == 0:
                write_latest(root, tag)

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the whole model's gradients at the last step, before clipping."""
        return self.engine.get_global_grad_norm()

    def comm_report(self) -> dict[str, int]:
        """Bytes this rank sent per kind since the previous call.

        The stage engine's kinds come first: data-parallel, and ``tp_*`` with tensor
        parallelism (see ``ZeroEngine.comm_report``). The pipeline group's follow, prefixed
        ``pp_``. ``pp_send`` is the activations and gradients sent to the neighbouring
        stages; the rest are the small norm and loss reductions.
        """
        report = self.engine.comm_report()
        self._pp.take_into(report, "pp_")
        return report

    def memory_report(self) -> dict[str, int]:
        """This rank's model-state bytes: its stage's (see ``ZeroEngine.memory_report``)."""
        return self.engine.memory_report()

    def comms_report(self) -> CommsReport:
        """The ``comms_logger``'s timings: the stage engine's, and the pipeline group's.

        The stage engine's cover its data-parallel collectives (see
        ``ZeroEngine.comms_report``). The pipeline group's kinds are prefixed ``pp_``. The
        loss broadcast and the norm exchange are timed. ``pp_send``, the activations and
        gradients sent to the neighbouring stages, is counted with its bytes but not timed:
        the schedule waits on it, inside ``fwd+bwd``. A collective.
        """
        report = self.engine.comms_report()
        logger = self._pp.comms_logger
        if logger is not None:
            pipeline = logger.report(self._pp.all_gather_object)["ops"]
            report["ops"].update({f"pp_{kind}": k for kind, k in pipeline.items()})
        return report

    def log_summary(self, show_straggler: bool = True) -> CommsReport:
        """:meth:`comms_report`, printed on global rank 0 as DeepSpeed's ``log_summary`` does.

        A collective (see ``ZeroEngine.log_summary``).

        Args:
            show_straggler: include the straggler breakdown.

        Returns:
            The :meth:`comms_report`.
        """
        report = self.comms_report()
        if report["enabled"] and Comm().rank == 0:
            show_report(log, format_summary(report, show_straggler))
        return report

    def flops_report(self) -> FlopsReport | dict[str, object]:
        """This stage's profile of the ``flops_profiler``'s ``profile_step``.

        Empty until that step has run, and without ``flops_profiler.enabled``. See [Note: a
        pipeline stage's profile] in ``core/profiling/flops.py``.
        """
        return self.engine.flops_report()

    def compile(
        self, backend: CompileBackend | None = None, compile_kwargs: dict[str, Any] | None = None
    ) -> None:
        """``torch.compile`` this stage's layers one at a time (see ``ZeroEngine.compile``).

        The schedule's sends and receives stay eager between them.

        Args:
            backend: torch.compile's backend. None: the config's ``compile.backend``.
            compile_kwargs: torch.compile's keyword arguments. None: the config's
                ``compile.kwargs``.
        """
        self.engine.compile(backend, compile_kwargs)

    def compile_report(self) -> CompileReport:
        """What torch.compile did on this rank (see ``ZeroEngine.compile_report``)."""
        return self.engine.compile_report()

    def timing_report(self) -> dict[str, float]:
        """The stage engine's per-step means, with ``wall_clock_breakdown`` (else ``{}``).

        See ``ZeroEngine.timing_report``. ``schedule_ms`` is the forward and backward of all
        micro-batches, which a pipeline schedule interleaves.
        """
        return self.engine.timing_report()

    # -- state -----------------------------------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights of the whole model, on every rank. Collective.

        They are keyed like the original ``nn.Sequential``'s ``state_dict()``.

        Args:
            rank0_only: on global rank 0 alone; the others get ``{}``.
        """
        mine = self.engine.full_state_dict()
        if rank0_only and self.mesh.lane != 0:
            return {}  # global rank 0's pipeline gathers; the other lanes hold the same
        parts = self._pp.all_gather_object(mine)  # every stage's, in stage order
        if rank0_only and world_rank() != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(cast(dict[str, torch.Tensor], part))
        return dict(sorted(merged.items(), key=_key_order))  # layer order, then each layer's

    def save_weights(self, path: str | os.PathLike) -> Path:
        """Write the whole model's consolidated fp32 weights to one file. Collective.

        Global rank 0 writes it.

        Args:
            path: the file: ``.safetensors`` by suffix, else ``torch.save``.

        Returns:
            ``path``.
        """
        state = self.full_state_dict(rank0_only=True)
        path = Path(path)
        if world_rank() == 0:
            write_weights(state, path)
        Comm().barrier()
        return path

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        tag: str | None = None,
        client_state: object = None,
        *,
        include_optimizer: bool = True,
    ) -> Path:
        """Every stage writes its ZeRO checkpoint to ``path/stage_<k>``. Collective.

        It loads into a pipeline of any layout, and into a plain engine
        (``load_checkpoint(path)``). ``ds_strategy.consolidate(path, file)`` exports it.

        Args:
            path: the checkpoint's root.
            tag: each stage's checkpoint goes to ``path/stage_<k>/tag``, and the root's
                ``latest`` names it once every stage has written its part.
            client_state: any picklable object; :meth:`load_checkpoint` returns it.
            include_optimizer: must be ``True``. A pipeline writes no weights-only
                checkpoint: :meth:`save_weights` writes the weights.

        Returns:
            The root, ``path``.
        """
        if not include_optimizer:
            raise ValueError(
                "weights-only checkpoints are not available with a pipeline config; save a "
                "full checkpoint, or the consolidated weights with save_weights(path)"
            )
        root = Path(path)
        self._commit(wait=True)  # an earlier asynchronous save first
        with together(self._pp):  # agreed within the stage by the engine, across stages here
            self.engine.save_checkpoint(
                root / f"stage_{self.stage_id}", tag=tag, client_state=client_state
            )
        self._note_save()
        self._commit(wait=not self.config.checkpoint.async_save)
        return root

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        tag: str | None = None,
        *,
        load_optimizer: bool = True,
        trust_checkpoint: bool = False,
    ) -> Any:
        """Restore a checkpoint. Each stage reads its own layers' weights and optimizer state.

        Args:
            path: what :meth:`save_checkpoint` wrote (the root, with the ``stage_<k>``
                checkpoints), or a plain engine's checkpoint. The pipeline that wrote it may
                have any number of stages, data-parallel size or ZeRO stage.
            tag: the checkpoint of that tag (see ``ZeroEngine.load_checkpoint``).
            load_optimizer: ``False`` restores the weights and counters only.
            trust_checkpoint: accept a ``client_state`` holding objects other than tensors
                and plain data.

        Returns:
            The saved ``client_state``.
        """
        self._commit(wait=True)  # a save still being written first
        with together(self._pp):  # agreed within the stage by the engine, across stages here
            return self.engine.load_checkpoint(
                path,
                tag,
                load_optimizer=load_optimizer,
                trust_checkpoint=trust_checkpoint,
            )

    def wait_for_checkpoint(self) -> None:
        """Block until this stage's asynchronous save is written. Collective.

        A save that failed re-raises its error (see ``ZeroEngine.wait_for_checkpoint``).
        Then the root's ``latest`` names the save.
        """
        self.engine.wait_for_checkpoint()
        self._commit(wait=True)

    def destroy(self) -> None:
        """Commit a pending checkpoint save, close the monitors, then destroy the stage engine
        (see ``ZeroEngine.destroy``)."""
        try:
            self._commit(wait=True)
        finally:
            if self.monitor is not None:
                self.monitor.close()
            self.engine.destroy()


def _build_own(
    layers: list[nn.Module],
    builders: list[LayerBuilder | None],
    own: list[int],
    device: torch.device,
    config: ZeroConfig,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> dict[int, nn.Parameter]:
    """Build this rank's layers, one at a time.

    A builder's layer is built on ``device``. A layer on the meta device is materialised
    there (``reset_parameters()`` or ``param_init_fn``). Under ZeRO-3 the stage engine does
    that instead, one unit at a time, as it shards them. The other stages' layers stay on the
    meta device. Returns old parameter -> materialised one.
    """
    replaced: dict[int, nn.Parameter] = {}
    for i in own:
        builder = builders[i]
        if builder is not None:
            with torch.device(device):
                layers[i] = _built(builder(), i)
        if config.zero_optimization.stage < 3 and has_meta(layers[i]):
            names = {id(m): f"{i}.{n}" if n else str(i) for n, m in layers[i].named_modules()}
            materialize_modules(list(layers[i].modules()), device, replaced, param_init_fn, names)
    return replaced


class _StageModule(nn.Sequential):
    """A rank's layers under their index in the whole model (``"3"``: the fourth layer).

    Its ``state_dict`` keys are thus the original ``nn.Sequential``'s. ``forward(x,
    chunk=k)`` runs the ``k``-th chunk this rank holds (one, or several under the
    interleaved schedule). Every chunk runs through this module's ``__call__``. So the stage
    engine's module hooks (ZeRO-3's gather and release) see each micro-batch of each chunk.
    """

    def __init__(self, chunks: list[list[tuple[str, nn.Module]]]) -> None:
        super().__init__(OrderedDict(item for chunk in chunks for item in chunk))
        self.chunk_names = [[name for name, _ in chunk] for chunk in chunks]

    def forward(self, x: Any, chunk: int = 0) -> Any:  # type: ignore[override]
        for name in self.chunk_names[chunk]:
            x = self._modules[name](x)  # type: ignore[misc]
        return x


class _Chunk(nn.Module):
    """One chunk of a stage as the schedule runs it.

    Mixed precision applies as ``ZeroEngine.forward`` applies it. Floating-point inputs come
    in the compute dtype: the first chunk's data is cast. Later chunks receive activations
    already in it, and send theirs and their gradients in it. The last chunk's outputs come
    back in fp32 for the loss. The stage module is not registered as a child, so the
    schedule sees no parameters of its own. With the config's ``flops_profiler``, the stage
    module's call is measured at the profile step.
    """

    def __init__(
        self,
        stage: _StageModule,
        index: int,
        precision: PrecisionPolicy,
        last: bool,
        profiler: FlopsProfiler | None = None,
    ) -> None:
        super().__init__()
        self._stage = [stage]
        self.index, self.precision, self.last = index, precision, last
        self._profiler = profiler

    def forward(self, *args: Any) -> Any:
        args = self.precision.cast_inputs(args)
        counted = self._profiler.chunk_forward(self.index, args) if self._profiler else None
        with counted or nullcontext():
            out = self._stage[0](*args, chunk=self.index)
        return self.precision.cast_outputs(out) if self.last else out


class _CountingStage(PipelineStage):
    """A stage that counts what it sends (activations forward, their gradients backward).

    Under ZeRO-3 its first step's shape inference runs a backward for the input gradients
    only. That backward never produces the parameter gradients whose reduction releases a
    layer. So the runtime is told: it then releases each layer once backward has passed it,
    and the stage's parameters are never all gathered at once.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        group: dist.ProcessGroup | None,
        comm: Comm,
        stage3: Stage3Runtime | None = None,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self._comm = comm
        self._stage3 = stage3

    # torch's private method: its arguments and result pass through as they are, whatever
    # the torch release names them
    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        if self._stage3 is None:
            return super()._backward_metadata_inference(*args, **kwargs)
        self._stage3.input_grads_only = True
        try:
            return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self._stage3.input_grads_only = False

    def _counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        for op in ops:
            self._comm.record("send", op.tensor.numel() * op.tensor.element_size())
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id))


def _key_order(item: tuple[str, torch.Tensor]) -> int:
    head = item[0].partition(".")[0]
    return int(head) if head.isdigit() else -1
