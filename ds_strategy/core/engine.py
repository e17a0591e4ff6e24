"""``ZeroEngine``: the one object front ends talk to. It composes the sharding pieces that the
config's ZeRO stage asks for and runs DeepSpeed's loop: ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsInt, TypedDict, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from .._logging import report as show_report
from ..config import ZeroConfig
from ..config.loop import ConfigSource
from .assembly import EngineBuilder, EngineParts, LoopHooks
from .checkpoint.manager import CheckpointManager
from .checkpoint.pretrained import LoadedWeights, load_pretrained, pending_weights
from .checkpoint.records import ScalerState
from .checkpoint.seam import ShardedState
from .checkpoint.weights_file import write_weights
from .collectives import Comm, init_process_group_from_env, world_rank
from .compiled import (
    CompileBackend,
    CompileReport,
    CompileWatch,
    check_compile_kwargs,
    compile_backend,
    compile_units,
)
from .compression.reduction import GradientCompression
from .engine_shards import sharded_state
from .generation import sync_generation
from .materialize import refuse_unset_forward
from .memory import ModelStateMeter
from .memory_timeline import MemoryTimeline, TimelineEvent, timeline_path, zero_formula_bytes
from .moe.parallel import ExpertParallel
from .monitor import TrainingMonitor
from .names import plain_names, unwrapped
from .offload.streaming import SwapFiles
from .ownership import claim_parameters, release_parameters
from .profiling.comms import CommsLogger, CommsReport, format_summary
from .profiling.flops import FlopsProfiler
from .profiling.summary import FlopsReport
from .quant.export import write_quantized_state
from .quant.scheme import QuantScheme
from .schedulers import load_scheduler_state
from .sequence import SequenceParallel
from .stage_context import StageContext
from .start_summary import RankCounts, start_summary
from .step_line import report_progress
from .timers import StepTimers, phase
from .zero.builders import ShardingPlan
from .zero.gathered import GatheredParameters, ModifierRank
from .zero.optimizer import OptimizerLike, OptimizerPiece

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["ZeroEngine"]

log = logging.getLogger(__name__)

# an LRScheduler bound to the user's optimizer, or a callable building one on the rebuilt one
SchedulerLike = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler]
# called after each optimizer step with the steps taken so far (``global_steps``)
PostStep = Callable[[int], None]


class LoopState(TypedDict):
    """The training loop's state, as :meth:`ZeroEngine.checkpoint_state` returns it."""

    global_steps: int
    micro_steps: int
    skipped_steps: int
    lr_scheduler: dict[str, object] | None  # the scheduler's ``state_dict()``
    loss_scaler: ScalerState | None  # the fp16 loss scaler's ``state_dict()``


class ZeroEngine(nn.Module):
    """A model, its optimizer and their sharding across the data-parallel ranks.

    Build it with :func:`ds_strategy.initialize`. Example (one process runs as a world of one;
    under ``torchrun --nproc-per-node=2`` the same script shards across two ranks)::

        import torch, ds_strategy
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = ds_strategy.initialize(model, opt, {"zero_optimization": {"stage": 2}})
        loss = engine(torch.randn(4, 8)).square().mean()
        engine.backward(loss)
        engine.step()

    Args:
        model: the model; its parameters are sharded in place. It may live on the meta
            device: ZeRO-3 then materialises it one unit at a time.
        optimizer: a ``torch.optim.Optimizer`` over ``model.parameters()``, or a callable
            ``params -> Optimizer``. It is rebuilt over this rank's shards with the same
            param groups. None: the config's ``optimizer`` section, or an evaluation engine.
        config: a dict keyed like DeepSpeed's JSON, a path to a ``.json`` or ``.yaml`` file,
            a preset's name, a :class:`~ds_strategy.ZeroConfig` or an omegaconf node.
        lr_scheduler: a scheduler built on ``optimizer`` (moved to the rebuilt one), or a
            callable ``optimizer -> scheduler``.
        process_group: the data-parallel group (None: the default group).
        param_init_fn: initialises a module materialised from the meta device, for modules
            without ``reset_parameters()``.
        pipeline_stage: set by a ``PipelineEngine`` for its stage's engine.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerLike | None,
        config: ConfigSource | DictConfig = None,
        *,
        lr_scheduler: SchedulerLike | None = None,
        process_group: torch.distributed.ProcessGroup | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        pipeline_stage: StageContext | None = None,
    ) -> None:
        super().__init__()
        init_process_group_from_env()
        # a pipeline stage's engine (core/pipeline): its stage, mesh and the whole model
        self.pipeline_stage = pipeline_stage
        self._init_loop_state()
        # [Note: engine assembly] in assembly.py: the parts, each from the resolved config
        meter = ModelStateMeter()  # the plan's; the composed collectives' scratch counts too
        builder = EngineBuilder(
            model,
            config,
            Comm(process_group, on_scratch=meter.scratch),
            process_group=process_group,
            pipeline_stage=pipeline_stage,
            loop=LoopHooks(
                reduce_every_backward=lambda: not self._no_sync,
                reduce_at_boundary=lambda: (
                    (not self._no_sync) and self.is_gradient_accumulation_boundary()
                ),
                loss_scale=lambda: self.loss_scale,
                global_steps=lambda: self.global_steps,
                steps_taken=lambda: self.global_steps - self.skipped_steps,
            ),
            meter=meter,
        )
        self.module = model
        self._install(builder.build(optimizer, lr_scheduler, param_init_fn))
        # the config's tensorboard / csv_monitor / wandb / comet sections (a pipeline's stage
        # engines have none: a stage's backward does not see the loss)
        self.monitor: TrainingMonitor | None = None
        if pipeline_stage is None:
            self.monitor = TrainingMonitor.from_config(self.config, self.comm, self.device)
        self._timeline = self._build_memory_timeline()
        self._checkpoints = CheckpointManager(self)  # roots, latest, periodic and async saves
        self._count_resident()
        self._compile_watch = CompileWatch(self.module)
        self._own_grads = False  # gradients of a backward() of this engine since zero_grad
        self._logged_foreign = False
        # False: another engine's backward through this model leaves gradients that this
        # engine's next backward drops (see _drop_foreign_grads). True: they stay until
        # zero_grad() or the step, as in a torch loop, for a front end whose loop zeroes
        # gradients itself (Lightning's optimizer.zero_grad() with several optimizers)
        self.keep_foreign_grads = False
        self._claimed = claim_parameters(self.module, self)
        self.flops_profiler = self._build_flops_profiler()
        self._post_step = self._post_step_consumers()
        if self.config.compile.enabled:
            self.compile()
        self._log_start()
        # ZeRO-3's forward all-gathers: generate() keeps the ranks in step (generation.py)
        sync_generation(
            self.module,
            collective_forward=self.plan.stage3 is not None,
            world_size=self.shard_comm.world_size,
        )
        for prefix, path, strict in pending_weights(model):  # ds_strategy.pretrained(...)
            self._load_weights(path, strict, prefix)

    def _log_start(self) -> None:
        """One INFO line on the job's first rank, once the engine is built.

        A pipeline logs it on each stage's first rank: its stages hold different layers. It
        says stage, ranks, precision, offload and this rank's model state
        (``core/start_summary.py``). Local figures only: no collective.
        """
        tp, ctx = self.tensor_parallel, self.pipeline_stage
        first = self.rank == 0 and (tp is None or tp.comm.rank == 0)
        if not first or not log.isEnabledFor(logging.INFO):
            return
        ranks = RankCounts(
            self.world_size,
            self.shard_comm.world_size,
            tp.size if tp is not None else 1,
            ctx.stage if ctx is not None else None,
            ctx.stages if ctx is not None else 1,
            self.experts.size if self.experts is not None else 1,
        )
        formula = self._formula_bytes()
        zc, memory = self.config.zero_optimization, self.memory_report()
        line = start_summary(self.stage, ranks, self.precision, self._scaler, zc, memory, formula)
        log.info("%s", line)

    def _init_loop_state(self) -> None:
        """Step counters and the flags of the accumulation window."""
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._skips_in_a_row = 0
        self._no_sync = False
        self._global_grad_norm: float | None = None
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._ready_norm: float | None = None  # this boundary's reduced-gradient norm
        self._clipped_norm: float | None = None  # their norm after clip_grad_norm_

    def _install(self, parts: EngineParts) -> None:
        """The built parts under the names the loop, the front ends and checkpoints read."""
        self.config: ZeroConfig = parts.config
        self.stage = parts.config.zero_optimization.stage
        self.topology = parts.topology
        self.device = parts.device
        self.qat = parts.qat
        ranks = parts.ranks
        self.comm, self.shard_comm = ranks.comm, ranks.shard_comm
        self.mesh, self.tensor_parallel = ranks.mesh, ranks.tensor_parallel
        # sequence / context parallelism: the batch split and attention across ranks
        self.sequence: SequenceParallel | None = ranks.sequence
        if self.sequence is not None:
            self.sequence.attach(self.module)
        # expert parallelism: each rank's experts and their whole-model names (core/moe)
        self.experts: ExpertParallel | None = ranks.experts
        place = parts.checkpoint
        self.checkpoint_comm = place.comm
        self.checkpoint_partial = place.partial
        self.checkpoint_stage = place.stage
        self.checkpoint_aliases = place.aliases
        # the swap files a checkpoint reads and writes in place, during one (core/offload)
        self.checkpoint_io: SwapFiles | None = None
        self.precision = parts.precision.policy
        self._scaler = parts.precision.scaler
        accumulation = parts.config.gradient_accumulation_steps
        assert accumulation is not None  # the resolved config has every batch size
        self.gradient_accumulation_steps: int = accumulation
        self.timers: StepTimers | None = parts.timers
        self._offload = parts.offload
        self.plan: ShardingPlan = parts.plan
        refuse_unset_forward(self.module, self.plan.unset_buffers)
        self.optimizer: torch.optim.Optimizer = parts.optimizer.optimizer
        self._sharded_opt = parts.optimizer.sharded
        me = weakref.ref(self)  # (no cycle: the engine is freed when its last user lets go)
        self._sharded_opt.clock = lambda: getattr(me(), "global_steps", 0)  # rounding key
        self.lr_scheduler: LRScheduler | None = parts.optimizer.lr_scheduler
        self.trainable = parts.optimizer.trainable
        self.compression: GradientCompression | None = parts.compression

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward.

        Under mixed precision, floating-point inputs are cast to the compute dtype.
        Floating-point outputs then come back in fp32.
        """
        with phase(self.timers, "forward"), self._memory_phase("forward"):
            args, kwargs = self.precision.cast_inputs((args, kwargs))
            with self._flops("forward", args), self._sequence_running():
                out = self.module(*args, **kwargs)
            return self.precision.cast_outputs(out)

    def _sequence_running(self) -> contextlib.AbstractContextManager[None]:
        seq = self.sequence
        return seq.running() if seq is not None else contextlib.nullcontext()

    def _build_flops_profiler(self) -> FlopsProfiler | None:
        """The config's ``flops_profiler`` (core/profiling/flops.py), when enabled."""
        if not self.config.flops_profiler.enabled:
            return None
        tp = self.config.tensor_parallel.autotp_size
        ctx = self.pipeline_stage  # a stage profiles its own layers (flops.py's note)
        pp = ctx.stages if ctx is not None else 1
        return FlopsProfiler(
            self.config.flops_profiler,
            self.module,
            device=self.device,
            dtype=self.precision.param_dtype,
            rank=self.rank,
            world_size=self.world_size * tp * pp,
            mp_size=tp * pp,
            stage=None if ctx is None else ctx.stage,
            micro_batches=self.gradient_accumulation_steps if ctx is not None else 1,
        )

    def _flops(self, phase_name: str, *args: object) -> contextlib.AbstractContextManager[object]:
        profiler = self.flops_profiler
        if profiler is None:
            return contextlib.nullcontext()
        return getattr(profiler, phase_name)(self.global_steps, *args)

    def flops_report(self) -> FlopsReport | dict[str, object]:
        """This rank's profile of the ``flops_profiler``'s ``profile_step``.

        Empty until that step has run, and without ``flops_profiler.enabled``. Its keys (see
        ``core/profiling/flops.py``):

        - ``params``, ``fwd_flops``, ``fwd_macs``, ``bwd_flops``, ``train_flops``;
        - the latencies, ``fwd_latency_s`` ... ``iter_latency_s``;
        - the rates, ``fwd_tflops`` ... ``achieved_tflops``;
        - ``peak_tflops`` with ``peak_source``, and ``mfu``;
        - ``samples_per_second``, ``batch_size``, ``world_size``, ``dp_size``, ``mp_size``,
          ``step``;
        - ``modules``: per ``named_modules()`` name (the root as ``""``), its ``type``,
          ``depth``, ``params``, ``flops``, ``macs`` and ``latency_s``.
        """
        return self.flops_profiler.report.copy() if self.flops_profiler is not None else {}

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next :meth:`step` runs the optimizer.

        That is every ``gradient_accumulation_steps``-th micro-step, unless
        :meth:`set_gradient_accumulation_boundary` says otherwise.
        """
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Let the training loop decide the accumulation boundary, as DeepSpeed's method does.

        Front ends whose framework owns accumulation (Accelerate's ``sync_gradients``) set
        it before every backward.

        Args:
            is_boundary: ``True``: the next backward reduces for an optimizer step, and the
                next :meth:`step` runs the optimizer. ``False``: both accumulate. ``None``:
                back to counting micro-steps.
        """
        self._boundary = None if is_boundary is None else bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss``, divided by the accumulation steps.

        The fp16 loss scale multiplies it too. Gradients are reduced bucket by bucket while
        backward runs.

        Args:
            loss: this micro-batch's loss, as the model gave it.
            retain_graph: keep the graph for another backward, as in ``Tensor.backward``.

        Returns:
            ``loss`` divided by the accumulation steps.
        """
        if self.monitor is not None:
            self.monitor.add_loss(loss)
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if not self.trainable:
            raise RuntimeError(
                "backward() on an engine built for evaluation: the model has no trainable "
                "parameters"
            )
        if (
            not self._own_grads
            and not self.keep_foreign_grads
            and any(g.holds_grads() for g in self.plan.groups)
        ):
            self._drop_foreign_grads()
        scaled = loss * self.loss_scale if self._scaler is not None else loss
        with (
            phase(self.timers, "backward"),
            self._flops("backward"),
            self._memory_phase("backward"),
            self._sequence_running(),  # recomputed blocks attend across the sequence ranks
        ):
            scaled.backward(retain_graph=retain_graph)
        self._own_grads = True
        return loss

    def _drop_foreign_grads(self) -> None:
        """Drop gradients from a backward this engine did not start.

        Another engine's loss may run through this model (a GAN's generator loss through
        the discriminator). Those gradients are not this step's. A torch loop's
        ``zero_grad()`` before its backward drops them; a front end's
        ``optimizer.zero_grad()`` does not reach the engine, so this does. Logged once per
        engine (logger ``ds_strategy.core.engine``).
        """
        if not self._logged_foreign:
            self._logged_foreign = True
            log.info(
                "gradients reached this engine's model (%s) from a backward it did not start "
                "(another engine's loss through it) since its last step: dropped before this "
                "backward, never added to its step; engine.zero_grad() after that backward "
                "drops them there, and a step meant to include them needs one backward of the "
                "summed losses through this engine",
                type(self.module).__name__,
            )
        self.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally without reducing them, like DDP's ``no_sync``.

        The first backward outside the context, or the next optimizer step, reduces them.
        Under stages 2/3 this gives up their memory bound. Every full-size gradient bucket
        stays alive from the first backward inside until that reduction. Without
        ``no_sync``, each micro-step reduce-scatters into the gradient shard, and at most
        two buckets are alive at any moment.
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def step(self, grad_norm: float | None = None) -> None:
        """The optimizer step, at an accumulation boundary.

        It finishes the gradient reduction and clips by the global norm. It runs the
        optimizer and the lr scheduler, rebuilds full parameters and zeroes gradients. A
        non-finite norm skips the step instead. Then the post-step work runs: timers,
        progress line, monitors, the config's periodic checkpoint.

        Args:
            grad_norm: replaces the norm of this engine's gradients, for clipping and
                overflow detection. A caller training a larger model, of which this engine
                holds one part (a pipeline stage), passes the whole model's L2 norm. It
                includes the loss scale, comes after :meth:`reduced_grad_norm`, and is the
                same on every rank of this engine.
        """
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with phase(self.timers, "step"), self._flops("step"), self._memory_phase("step"):
                self._optimizer_step(grad_norm)
            self.global_steps += 1
        elif grad_norm is not None:
            raise RuntimeError(
                "step(grad_norm=...) between accumulation boundaries: there is no optimizer "
                "step for the norm to apply to; pass it at a boundary only"
            )
        self.micro_steps += 1
        if boundary:
            for consumer in self._post_step:
                consumer(self.global_steps)

    def _post_step_consumers(self) -> list[PostStep]:
        """What runs after each optimizer step, in this order.

        The memory timeline closes the step, torch.compile's graphs are counted, the step
        timers report, the progress line prints, the monitors write, and the config's
        periodic checkpoint is saved. A feature that is off has no entry. They run once
        ``micro_steps`` counts the step, since a periodic save records the counters.
        """
        consumers: list[PostStep] = []
        if self._timeline is not None:
            consumers.append(self._end_memory_step)
        consumers.append(self._compile_watch.after_step)
        if self.timers is not None:
            consumers.append(self.timers.end_step)
        if self.config.steps_per_print is not None:
            consumers.append(self._report_progress)
        monitor, checkpoints = self.monitor, self._checkpoints
        if monitor is not None:
            consumers.append(lambda step: monitor.after_step(self))
        consumers.append(lambda step: checkpoints.after_step())  # checkpoint.save_interval
        return consumers

    def _report_progress(self, step: int) -> None:
        """DeepSpeed's progress line, every ``steps_per_print`` steps."""
        groups = self.optimizer.param_groups
        report_progress(self.config.steps_per_print, step, self.skipped_steps, groups)

    def reduced_grad_norm(self) -> float:
        """Finish this boundary's gradient reduction and return the gradients' global L2 norm.

        The norm is over this engine's ranks, as reduced, loss scale included. It is
        computed once; later calls return the same value. Collective: call it on every rank,
        at an accumulation boundary, before :meth:`step`.

        The norm is all-reduced, so an inf/nan gradient on any rank makes it non-finite
        everywhere. All ranks thus agree to skip without an overflow collective of their own.
        """
        if not self.is_gradient_accumulation_boundary():
            raise RuntimeError(
                "reduced_grad_norm() between accumulation boundaries: the gradients are still "
                "being accumulated; call it when is_gradient_accumulation_boundary() is True"
            )
        if self._ready_norm is None:
            self.plan.wait_params()  # the optimizer writes slices a late all-gather still reads
            self.plan.finish_reduction()  # MiCS's sum over replicas included
            self._ready_norm = self._sharded_opt.sync_grad_flags_and_norm()
        return self._ready_norm

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip this optimizer step's gradients by their global L2 norm.

        It acts like ``torch.nn.utils.clip_grad_norm_`` over the full, unsharded gradients.
        Call it at an accumulation boundary, after the last backward and before
        :meth:`step`. It finishes the gradient reduction, so the step applies only the
        clipped gradients. The config's ``gradient_clipping``, if set, clips on top, as a
        second clip would. Calling it twice clips twice, as torch does.

        Args:
            max_norm: the largest norm the gradients keep; must be > 0.
            norm_type: must be 2: ZeRO clips by the L2 norm only.

        Returns:
            The norm before clipping, loss scale removed. It is inf/nan on an fp16
            overflow, whose step :meth:`step` then skips.
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): ZeRO clips by L2 norm only")
        if not float(max_norm) > 0:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): must be > 0")
        if not self.is_gradient_accumulation_boundary():
            raise RuntimeError(
                "clip_grad_norm_ was called between accumulation boundaries: the gradients are "
                "still being accumulated (and, under stages 0/1, not yet reduced). Call it after "
                "the backward of the last micro-batch, when is_gradient_accumulation_boundary() "
                "is True, or let the config's gradient_clipping clip at every step"
            )
        norm = self.reduced_grad_norm()
        if not math.isfinite(norm):
            return norm
        if self._exchanged_step():
            raise RuntimeError(
                f"clip_grad_norm_: {type(self.optimizer).__name__} is in a compressed step, "
                "where the ranks exchange compressed momenta or gradients; set the config's "
                "gradient_clipping instead, which clips each rank's gradient before the "
                "exchange"
            )
        if self._clipped_norm is None:  # the first clip also removes the loss scale
            current, scale = norm / self.loss_scale, self.loss_scale
        else:
            current, scale = self._clipped_norm, 1.0
        self._sharded_opt.scale_grads(current * scale, float(max_norm), scale)
        self._clipped_norm = current * min(float(max_norm) / (current + 1e-6), 1.0)
        return current

    def _optimizer_step(self, grad_norm: float | None) -> None:
        norm = self.reduced_grad_norm()  # finishes the reduction even when grad_norm is given
        if grad_norm is not None:
            norm = float(grad_norm)
        scale = self.loss_scale
        if not math.isfinite(norm):
            self._skip_step(norm)
            return
        clip = self.config.gradient_clipping
        if self._exchanged_step():
            clip = 0.0  # a 1-bit exchange clipped each rank's gradient before it
        self._global_grad_norm = norm / scale
        if self._clipped_norm is None:
            self._sharded_opt.scale_grads(norm, clip, scale)
        elif clip > 0:  # clip_grad_norm_ already removed the loss scale
            self._sharded_opt.scale_grads(self._clipped_norm, clip)
        self._skips_in_a_row = 0
        self._sharded_opt.attach_grads()
        self._sharded_opt.step()
        self._count_resident()  # optimizer state appears at the first step
        if self._scaler is not None:
            self._scaler.update(overflow=False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.plan.after_optimizer_step()
        self.zero_grad()

    def _exchanged_step(self) -> bool:
        """This step's gradients came from a 1-bit / 0-1 optimizer's compressed exchange."""
        return self.compression is not None and self.compression.exchanged

    def _skip_step(self, norm: float) -> None:
        """An overflow: weights, optimizer state and lr schedule stay untouched."""
        self.skipped_steps += 1
        self._skips_in_a_row += 1
        self._global_grad_norm = norm
        scale = self.loss_scale
        if self._scaler is not None:
            self._scaler.update(overflow=True)  # raises once stuck at min_loss_scale
        elif self._skips_in_a_row >= self.config.max_consecutive_skipped_steps:
            self.zero_grad()
            raise FloatingPointError(
                f"step {self.global_steps}: the gradient norm was {norm} on "
                f"{self._skips_in_a_row} optimizer steps in a row, each skipped "
                f"(max_consecutive_skipped_steps={self.config.max_consecutive_skipped_steps}); "
                "training is not progressing. Usual causes: a learning rate too high, a NaN in "
                "the data or the loss, an operation unstable in bf16. Weights and optimizer "
                "state are those of the last good step."
            )
        if self.rank == 0:
            log.warning(
                "step %d: gradient overflow (norm %s); step skipped, loss scale %g -> %g",
                self.global_steps,
                norm,
                scale,
                self.loss_scale,
            )
        self.zero_grad()

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self._scaler.scale if self._scaler is not None else 1.0

    def zero_grad(self) -> None:  # type: ignore[override]
        """Drop every gradient of this engine, reduced or not.

        Unlike ``nn.Module.zero_grad`` it takes no ``set_to_none``: the flat gradient
        buffers are the engine's to keep or free.
        """
        self._ready_norm = self._clipped_norm = None
        self._own_grads = False
        for g in self.plan.groups:
            g.zero_grad()
        for pc in self._sharded_opt.pieces:
            if pc.tensor is not pc.group.params[pc.index]:
                pc.tensor.grad = None

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the gradients of the last optimizer step, before clipping."""
        return self._global_grad_norm

    def get_lr(self) -> list[float]:
        """Each param group's current learning rate."""
        return [g["lr"] for g in self.optimizer.param_groups]

    # -- state ---------------------------------------------------------------------------------

    @property
    def optimizer_pieces(self) -> tuple[OptimizerPiece, ...]:
        """The tensors :attr:`optimizer` updates on this rank; read-only.

        There is one per piece of a trainable parameter that this rank owns. Each has its
        ``group``, parameter ``index``, ``tensor``, and ``start`` (its offset in the
        flattened parameter). ``piece.grad()`` is its reduced gradient. Checkpoints save
        the optimizer state by these.
        """
        return tuple(self._sharded_opt.pieces)

    def checkpoint_shards(self) -> ShardedState:
        """This rank's weights, optimizer slots and compression buffers.

        Each comes with its place in the whole parameter (``checkpoint/seam.py``). They are
        views of the live storage, once the in-flight parameter gathers have landed. A
        checkpoint saves them, and loads into them.
        """
        return sharded_state(
            self.plan,
            self.module,
            self.tensor_parallel,
            self.optimizer_pieces,
            self.compression,
            stage=self.stage,
            world_size=self.world_size,
            tp_degree=self.mesh.tp,
            experts=self.experts,
        )

    def checkpoint_loaded(self) -> None:
        """A checkpoint load overwrote the shards: rebuild the resident full parameters,
        and keep loaded optimizer state in the dtype this engine stores it in."""
        self.plan.after_load()
        self._sharded_opt.after_load()

    def checkpoint_partial_window(self) -> int:
        """Micro-batches whose gradients are accumulated but not yet stepped.

        It is 0 at an accumulation boundary. A checkpoint holds no gradients, so a save now
        drops them.
        """
        if not any(g.holds_grads() for g in self.plan.groups):
            return 0
        return self.micro_steps % self.gradient_accumulation_steps or 1

    def checkpoint_state(self) -> LoopState:
        """The training-loop state a checkpoint records besides weights and optimizer state.

        Its keys are ``global_steps``, ``micro_steps`` and ``skipped_steps``, then the lr
        scheduler's and the fp16 loss scaler's ``state_dict()`` (``None`` without one). It is
        plain data, the same on every rank. :meth:`restore_checkpoint_state` puts it back.
        """
        sched, scaler = self.lr_scheduler, self._scaler
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "loss_scaler": cast(ScalerState, scaler.state_dict()) if scaler is not None else None,
        }

    def restore_checkpoint_state(
        self, state: Mapping[str, object], *, lr_scheduler: bool = True
    ) -> None:
        """Put back what :meth:`checkpoint_state` returned.

        Args:
            state: that dict. Keys an older checkpoint lacks keep their defaults.
            lr_scheduler: ``False`` leaves the schedule alone. It belongs to the optimizer,
                which a weights-only load does not restore.
        """
        # plain data read from disk: counters as the record holds them, states as saved
        self.global_steps = int(cast(SupportsInt, state["global_steps"]))
        self.micro_steps = int(cast(SupportsInt, state["micro_steps"]))
        self.skipped_steps = int(cast(SupportsInt, state.get("skipped_steps", 0)))
        sched_state = cast("dict[str, Any] | None", state.get("lr_scheduler"))
        if lr_scheduler and self.lr_scheduler is not None and sched_state is not None:
            load_scheduler_state(self.lr_scheduler, sched_state)
        scaler_state = cast("ScalerState | None", state.get("loss_scaler"))
        if self._scaler is not None and scaler_state is not None:
            self._scaler.load_state_dict(dict(scaler_state))

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights, on every rank. Collective.

        The keys and shapes are those of the original ``model.state_dict()``, buffers and
        every name of a tied weight included. A model given inside ``torch.compile`` or DDP
        gets the names of the model inside, without ``_orig_mod.`` or ``module.``.

        Args:
            rank0_only: gather the weights to rank 0 alone, for exports that rank 0 writes.
                The other ranks get ``{}`` and never hold a full-size copy.
        """
        tp = self.tensor_parallel
        plain = plain_names(self.module)  # a compiled or DDP-wrapped model: its model's names
        with self._offload_resident(dirty=False, optimizer_state=False):
            if self.experts is not None:  # every rank's experts joined under the model's names
                state = self.experts.full_state_dict(
                    self.plan.full_state_dict(self.module, False, self.rank)
                )
            elif tp is None:
                state = self.plan.full_state_dict(self.module, rank0_only, self.rank)
                return {plain(k): v for k, v in state.items()}
            else:
                # every rank gathers its tensor-parallel part over the data-parallel ranks,
                # then the parts are joined over the tensor-parallel ranks
                state = tp.full_state_dict(self.plan.full_state_dict(self.module, False, self.rank))
        if rank0_only and world_rank() != 0:
            return {}
        return {plain(k): v for k, v in state.items()}

    def gathered_parameters(
        self,
        params: nn.Parameter | Iterable[nn.Parameter] | None = None,
        modifier_rank: ModifierRank = None,
    ) -> GatheredParameters:
        """A ``with`` block inside which ``params`` hold their full values on every rank.

        It is DeepSpeed's ``zero.GatheredParameters``. Collective: every rank enters and
        leaves it. Values written inside are kept only with ``modifier_rank``. They then go
        into the shards and into the fp32 masters the optimizer steps. Training and saving
        afterwards see them (see ``core/zero/gathered.py``). Do not run the model's forward
        inside.

        Args:
            params: a parameter of the model, several, or ``None`` (every parameter).
            modifier_rank: ``None``: read only, changes are not kept. A rank: that rank's
                values are broadcast and kept. ``"all"``: every rank wrote the same values.

        Returns:
            The context manager (its ``hand_over()`` keeps the whole model gathered for
            good, as PEFT's ``merge_and_unload`` under a front end does).

        >>> with engine.gathered_parameters([lin.weight], modifier_rank=0):  # doctest: +SKIP
        ...     if engine.rank == 0:
        ...         lin.weight.data.fill_(0.5)
        """
        return GatheredParameters(self.plan, self.comm, self.module, params, modifier_rank)

    def save_weights(self, path: str | os.PathLike) -> Path:
        """Write the consolidated fp32 weights (:meth:`full_state_dict`) to one file.

        Collective: rank 0 gathers and writes.

        Args:
            path: the file: ``.safetensors`` by suffix, else ``torch.save``.

        Returns:
            ``path``.

        >>> engine.save_weights("model.safetensors")  # doctest: +SKIP
        """
        state = self.full_state_dict(rank0_only=True)
        path = Path(path)
        if self.rank == 0 and self.mesh.coordinates["tp"] == 0:
            write_weights(state, path)
        self.comm.barrier()
        if self.tensor_parallel is not None:
            Comm().barrier()  # the tensor-parallel ranks too: every rank of the job
        return path

    def load_weights(self, path: str | os.PathLike, *, strict: bool = True) -> LoadedWeights:
        """Read pretrained weights into the shards. Collective.

        It is the counterpart of :meth:`save_weights`, and of DeepSpeed's ``zero.Init``
        with ``from_pretrained``. Each rank reads only the bytes of its own shard, straight
        into it (with NVMe offload, into its swap file). So a model built on the meta device
        never exists whole on any rank. Persistent buffers are read too. Buffers the files
        do not hold (a rotary ``inv_freq``) keep what the model's initialisation computed at
        ``initialize``. One that nothing computed is an error naming it. The optimizer state
        and step counters are left as they are.

        Args:
            path: a ``.safetensors`` or ``torch.save`` file, or a directory as
                ``save_pretrained`` writes it (``model.safetensors``, or shards beside
                ``model.safetensors.index.json``; ``pytorch_model.bin`` likewise). Any dtype:
                values are cast to the shards' own.
            strict: a parameter the files lack is an error; ``False`` keeps its initial
                value and lists it in the result's ``missing``.

        Returns:
            :class:`LoadedWeights`: the names ``loaded``, ``missing`` and ``unexpected``
            (tensors of the files the model has no place for, ignored).

        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        >>> engine = ds_strategy.initialize(model, opt, "zero3")  # doctest: +SKIP
        >>> engine.load_weights(path)  # doctest: +SKIP
        """
        return self._load_weights(path, strict)

    def _load_weights(
        self, path: str | os.PathLike, strict: bool, prefix: str = ""
    ) -> LoadedWeights:
        with self._streamed(load=True):
            result = load_pretrained(
                self, self.module, path, strict=strict, unset=self.plan.unset_buffers, prefix=prefix
            )
        self._count_resident()
        return result

    def save_quantized(self, path: str | os.PathLike) -> Path:
        """Write the consolidated weights in a quantized inference format.

        The format is the config's ``quantization`` section: ``bits``, ``group_size``,
        ``symmetric``, ``modules_to_not_convert``. After quantization-aware training
        (``qat: true``) these are exactly the integers training computed with.
        ``ds_strategy.init_inference(model, checkpoint=path)`` loads the file as stored.
        Collective: rank 0 gathers and writes.

        Args:
            path: a ``.safetensors`` file.

        Returns:
            ``path``.

        >>> engine.save_quantized("model-int4.safetensors")  # doctest: +SKIP
        """
        qc = self.config.quantization
        path = Path(path)
        if qc.bits is None or path.suffix != ".safetensors":
            raise ValueError(
                f"save_quantized({str(path)!r}): needs a .safetensors path and a quantization "
                "section with bits 8 or 4 in the config"
            )
        state = self.full_state_dict(rank0_only=True)
        if self.rank == 0 and self.mesh.coordinates["tp"] == 0:
            write_quantized_state(
                state,
                unwrapped(self.module),  # named as the state is
                QuantScheme(qc.bits, qc.group_size, qc.symmetric),
                path,
                embeddings=qc.embeddings,
                modules_to_not_convert=list(qc.modules_to_not_convert),
            )
        self.comm.barrier()
        if self.tensor_parallel is not None:
            Comm().barrier()  # the tensor-parallel ranks too: every rank of the job
        return path

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        tag: str | None = None,
        client_state: object = None,
        save_latest: bool = True,
        *,
        include_optimizer: bool = True,
        async_save: bool | None = None,
    ) -> Path:
        """Write the whole training state. Collective: call it on every rank.

        Every rank writes its own shards, in parallel. The directory appears atomically: a
        crash mid-save leaves the previous checkpoint and ``latest`` intact. It loads into
        any world size or ZeRO stage.

        Args:
            path: with ``tag``, a root (DeepSpeed's layout). Without, the checkpoint
                directory itself; if it holds a ``latest`` file, a root again, and the tag
                is ``global_step<N>``.
            tag: the checkpoint goes to ``path/tag``, and ``path/latest`` names it. The
                config's ``checkpoint.keep_last`` prunes older tags.
            client_state: any picklable object; :meth:`load_checkpoint` returns it.
            save_latest: ``False``: ``path/latest`` keeps naming the previous tag.
            include_optimizer: ``False`` writes a weights-only checkpoint.
            async_save: copy the state and write it in the background (see
                :meth:`wait_for_checkpoint`). None: the config's ``checkpoint.async_save``.

        Returns:
            The checkpoint directory.

        >>> engine.save_checkpoint("ckpt", tag="step100", client_state={"epoch": 3})  # doctest: +SKIP
        """
        if self._offload is not None and self._offload.is_swap_path(path):
            raise ValueError(
                f"save_checkpoint({str(path)!r}): that is inside the offload swap "
                "directory, which is deleted at exit; save elsewhere"
            )
        use_async = self.config.checkpoint.async_save if async_save is None else async_save
        # an asynchronous save copies the state first, so it must be in memory; a synchronous
        # one reads what is in swap files a piece at a time (core/offload/streaming.py)
        context = self._offload_resident(dirty=False) if use_async else self._streamed(load=False)
        with context:
            return self._checkpoints.save(
                path, tag, client_state, save_latest, include_optimizer, use_async
            )

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        tag: str | None = None,
        *,
        load_optimizer: bool = True,
        require_checksums: bool = True,
        trust_checkpoint: bool = False,
    ) -> Any:
        """Restore a checkpoint written by :meth:`save_checkpoint`, at any world size or stage.

        It restores weights, optimizer state, lr scheduler, step counters and RNG state. A
        damaged or foreign checkpoint raises on every rank, naming the file. So does one
        whose ``latest`` or metadata points outside its directory. Nothing in the checkpoint
        can run code: metadata and saved objects are read by allow-listing unpicklers.

        Args:
            path: a root whose ``latest`` file names the checkpoint, or the checkpoint
                directory. A pipeline's checkpoint (its root, holding ``stage_<k>``) loads
                too, whatever its stages.
            tag: the checkpoint ``path/tag``.
            load_optimizer: ``False`` restores the weights and counters only. The engine's
                optimizer may then differ, e.g. in an engine built for evaluation.
            require_checksums: ``False`` accepts a checkpoint that records no checksums.
            trust_checkpoint: ``True`` accepts a ``client_state`` (or scheduler state)
                holding objects other than tensors and plain data. Otherwise such a state
                is refused, naming the type.

        Returns:
            The saved ``client_state``, as it was given.
        """
        with self._streamed(load=True):
            client_state = self._checkpoints.load(
                path, tag, load_optimizer, require_checksums, trust_checkpoint
            )
        if self.compression is not None:
            self.compression.reset()  # errors restart; 1-bit momenta come from the loaded state
        self._count_resident()
        return client_state

    def compile(  # type: ignore[override]
        self, backend: CompileBackend | None = None, compile_kwargs: dict[str, Any] | None = None
    ) -> None:
        """``torch.compile`` the model one unit at a time, as DeepSpeed's ``engine.compile``.

        A unit is a block that ZeRO-3 gathers as one, the same blocks at every stage. A model
        without blocks is compiled whole (``compile_units`` in ``core/compiled.py``). The
        gather and release around a unit run eagerly between its compiled graphs (see [Note:
        compiled units] in ``zero/stage3.py``). A unit compiled already, or a model compiled
        as a whole, is left as it is. The config's ``compile.enabled`` calls this at
        ``initialize``.

        Args:
            backend: torch.compile's backend. None: the config's ``compile.backend``.
            compile_kwargs: torch.compile's ``mode``, ``dynamic``, ``fullgraph``,
                ``options``. None: the config's ``compile.kwargs``.
        """
        section = self.config.compile
        fn = compile_backend(section.backend if backend is None else backend)
        kwargs = dict(section.kwargs if compile_kwargs is None else compile_kwargs)
        check_compile_kwargs(kwargs)
        compile_units(self.module, fn, kwargs)

    def compile_report(self) -> CompileReport:
        """What torch.compile did since the engine was built.

        Dynamo counts per process: see ``core/compiled.py``. The keys:

        - ``compiled_units``: modules that run compiled;
        - ``graphs``: graphs Dynamo compiled. It is 0 when the units reuse the graphs
          compiled for an earlier engine's copy of the model;
        - ``graph_breaks``, and ``break_reasons``: each reason's first line, with its count;
        - ``last_new_graph_step``: the optimizer step that compiled the latest graph (None if
          none did). A model whose guards hold compiles nothing after its first train and
          evaluation steps.
        """
        return self._compile_watch.report()

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The engine's saves and loads (how many saves began, whether one is being written)."""
        return self._checkpoints

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save is written, renamed into place and in ``latest``.

        A save that failed re-raises its error here. Call this (or :meth:`destroy`) before
        destroying the process group: the writer's collectives need it.
        """
        self._checkpoints.wait()

    @contextlib.contextmanager
    def _streamed(self, load: bool) -> Iterator[None]:
        """A checkpoint save or load that reads and writes swapped state in place, a piece at
        a time (``checkpoint_io`` is set for the checkpoint code meanwhile)."""
        if self._offload is None:
            yield
            return
        with self._offload.streamed(load) as files:
            self.checkpoint_io = files
            try:
                yield
            finally:
                self.checkpoint_io = None

    def _offload_resident(
        self, dirty: bool, optimizer_state: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """State swapped to NVMe is brought in for an asynchronous save or a consolidation."""
        if self._offload is None:
            return contextlib.nullcontext()
        return self._offload.resident(dirty, optimizer_state)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds now.

        The keys:

        - ``params``, ``grads``, ``optimizer_state``;
        - ``compression_state``: top-k residuals, 1-bit momenta and errors;
        - ``total``: the sum of the four. Bytes swapped to NVMe files are not in it;
        - ``offloaded_nvme``: those bytes in files;
        - ``swap_buffers``: host bytes of swapped tensors back in memory now (a step's
          buckets, shards read for a gather);
        - ``peak``: the most model-state bytes held at any moment since the engine was built,
          or since :meth:`reset_peak_memory`. Transient buffers count: ZeRO-3's gathered
          parameters, full-size gradient buckets, reductions in flight, the step's fp32
          gradient copies. With NVMe offload the gradient shards, in memory only during a
          step, count there and not in ``grads``;
        - ``peak_gathered_params``: the most bytes of ZeRO-3 parameters gathered at once;
        - with expert parallelism, ``expert_params``, ``expert_grads`` and
          ``expert_optimizer_state``: the experts' part of the first three (the rest is
          the dense layers');
        - with CPU ranks exchanging through shared memory (``topology.shared_memory``),
          ``shared_memory``: the bytes of this rank's exchange areas, not in ``total``.
        """
        report = self._resident_report()
        if self._offload is not None:  # bytes moved out to files: not in total
            report.update(self._offload.report())
        comms = {id(g.comm): g.comm for g in self.plan.groups}
        shared = sum(c.shared_memory_nbytes for c in comms.values())
        if shared:
            report["shared_memory"] = shared
        report["peak"] = self.plan.meter.peak
        return report

    def memory_timeline(self) -> list[TimelineEvent]:
        """The model-state meter's events of the latest finished optimizer step.

        Before the first step ends, those of the step under way. Empty without the config's
        ``memory_timeline.enabled``. Each event has ``seq``, ``time_s``, ``step``, ``phase``
        (``forward``, ``backward``, ``step`` or ``idle``) and ``event`` (``alloc``,
        ``free``, ``resident``, ``touch``). Then ``nbytes``, and the bytes held after it:
        ``resident``, ``transient``, ``total``, and the ``peak`` so far (see
        ``core/memory_timeline.py``). With ``csv_monitor`` on, every rank also writes them
        to ``memory_timeline_<rank>.csv`` in the monitor's directory. It does so every
        ``steps_per_print`` steps and at :meth:`destroy`.
        """
        return self._timeline.events() if self._timeline is not None else []

    def _build_memory_timeline(self) -> MemoryTimeline | None:
        section = self.config.memory_timeline
        if not section.enabled:
            return None
        timeline = MemoryTimeline(section.max_events)
        self.plan.meter.timeline = timeline
        return timeline

    def _memory_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        timeline = self._timeline
        return contextlib.nullcontext() if timeline is None else timeline.phase(name)

    def _end_memory_step(self, step: int) -> None:
        """The timeline's step ends; every ``steps_per_print`` steps it is written out."""
        if self._timeline is None:
            return
        self._timeline.end_step(step)
        if step % self.config.report_every == 0:
            self._write_memory_timeline()

    def _write_memory_timeline(self) -> None:
        """The timeline to the csv_monitor's directory, when both are on (every rank)."""
        csv_section = self.config.csv_monitor
        if self._timeline is None or csv_section.enabled is not True:
            return
        path = timeline_path(csv_section.output_path, csv_section.job_name, world_rank())
        self._timeline.write_csv(path, self._formula_bytes())

    def _formula_bytes(self) -> float:
        """This rank's model state by the ZeRO formula of the chosen precision and optimizer."""
        matrix, other = self.precision.formula_bytes()
        return zero_formula_bytes(self.plan.groups, per_element=other, per_matrix_element=matrix)

    def reset_peak_memory(self) -> None:
        """Start ``memory_report()``'s two peaks again from the bytes held now.

        They are ``peak`` and ``peak_gathered_params``.
        """
        self.plan.meter.reset_peak()
        if self.plan.stage3 is not None:
            self.plan.stage3.peak_live_numel = self.plan.stage3.live_numel

    def _resident_report(self) -> dict[str, int]:
        report = self.plan.memory_report()
        report["optimizer_state"] = self._sharded_opt.state_bytes()
        # top-k residuals and velocities, 1-bit momenta and errors: state the step keeps
        report["compression_state"] = self.compression.state_bytes() if self.compression else 0
        report["total"] = (
            report["params"]
            + report["grads"]
            + report["optimizer_state"]
            + report["compression_state"]
        )
        if self.experts is not None:  # the experts' part of each (core/moe)
            experts = [g for g in self.plan.groups if self.experts.is_expert(g.params[0])]
            held = [g.resident_bytes() for g in experts]
            report["expert_params"] = sum(h["params"] for h in held)
            report["expert_grads"] = sum(h["grads"] for h in held)
            ids = {id(g) for g in experts}
            report["expert_optimizer_state"] = self._sharded_opt.state_bytes(ids)
        return report

    def _count_resident(self) -> None:
        self.plan.meter.set_resident(self._resident_report()["total"])

    def timing_report(self) -> dict[str, float]:
        """The latest per-step means of each phase's time, with ``wall_clock_breakdown``.

        Empty without it. The phases are forward, backward, reduce, gather and step, as
        ``<phase>_ms``; a pipeline stage adds ``schedule_ms`` (see ``timers.py``). Bytes
        sent per collective kind come as ``<kind>_bytes``. All are refreshed every
        ``steps_per_print`` steps.
        """
        return dict(self.timers.last_report) if self.timers is not None else {}

    def comm_report(self) -> dict[str, int]:
        """Bytes this rank sent per collective kind since the previous call.

        With tensor parallelism the tensor-parallel group's kinds are prefixed ``tp_``; with
        expert parallelism the expert group's (the tokens' ``expert_all_to_all``) ``ep_``
        and the expert-data-parallel group's (the experts' gradients and weights) ``edp_``.
        The rest are the data-parallel group's, and ``total`` counts them all. ``intra_machine`` and
        ``inter_machine`` split ``total`` by the link of the group each was sent on. A group
        with ranks on several machines is ``inter`` (see ``core/topology.py``).
        """
        report = self.comm.take_report()
        report.update(self.comm.take_links())
        if self.tensor_parallel is not None:
            self.tensor_parallel.comm.take_into(report, "tp_")
        if self.experts is not None:
            self.experts.comm.take_into(report, "ep_")
            self.experts.data.take_into(report, "edp_")
        return report

    def comms_report(self) -> CommsReport:
        """The ``comms_logger``'s timings, per collective kind, since the engine was built.

        They cover the engine's data-parallel groups (see ``core/profiling/comms.py``). Per
        kind: ``count``, ``msg_bytes``, and ``sent_bytes`` (what :meth:`comm_report`
        counts). Then ``total_ms``, ``avg_ms``, ``algbw_gbps``, ``busbw_gbps``, and the
        straggler gap ``straggler_ms``, with every rank's total in ``rank_total_ms``. A
        collective: call it on every rank. Without ``comms_logger.enabled`` it is
        ``{"enabled": False, ...}`` with no ops, and no collective.
        """
        logger = self.comm.comms_logger
        if logger is None:
            return CommsLogger.disabled_report()
        return logger.report(self.comm.all_gather_object)

    def log_summary(self, show_straggler: bool = True) -> CommsReport:
        """:meth:`comms_report`, printed on rank 0 as DeepSpeed's ``comm.log_summary`` does.

        The table is a report of the ``ds_strategy.core.engine`` logger (see
        ``ds_strategy/_logging.py``). A collective.

        Args:
            show_straggler: include the straggler breakdown.

        Returns:
            The :meth:`comms_report`.
        """
        report = self.comms_report()
        if report["enabled"] and self.comm.rank == 0:
            show_report(log, format_summary(report, show_straggler))
        return report

    @property
    def world_size(self) -> int:
        """How many ranks the engine's data-parallel group has."""
        return self.comm.world_size

    @property
    def rank(self) -> int:
        """This rank's index in the engine's data-parallel group."""
        return self.comm.rank

    def destroy(self) -> None:
        """Wait for an asynchronous checkpoint save, then remove the engine's hooks from the
        model and its offload swap files."""
        try:
            self._checkpoints.wait()  # raises if that save failed, after cleaning up below
        finally:
            self._checkpoints.release()  # the checkpoint roots it locked
            self.plan.remove_hooks()
            if self.sequence is not None:
                self.sequence.detach()
            if self._offload is not None:
                self._offload.close()
            release_parameters(self._claimed, self)
            if self.monitor is not None:
                self.monitor.close()
            self._write_memory_timeline()
