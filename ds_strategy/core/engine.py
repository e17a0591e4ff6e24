"""``ZeroEngine``: the one object front ends talk to. It composes the sharding pieces that the
config's ZeRO stage asks for and runs DeepSpeed's loop: ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._logging import report as show_report
from ..config import ZeroConfig
from .assembly import EngineBuilder, EngineParts, LoopHooks
from .checkpoint.manager import CheckpointManager
from .checkpoint.pretrained import LoadedWeights, load_pretrained, pending_weights
from .checkpoint.seam import ShardedState
from .checkpoint.weights_file import write_weights
from .collectives import Comm, init_process_group_from_env
from .compiled import CompileWatch, check_compile_kwargs, compile_backend, compile_units
from .compression.onebit_reduce import OneBitReduction
from .compression.zeroone_reduce import ZeroOneReduction
from .engine_shards import sharded_state
from .generation import sync_generation
from .materialize import refuse_unset_forward
from .memory import ModelStateMeter
from .memory_timeline import MemoryTimeline, timeline_path, zero_formula_bytes
from .mics import MiCSComm
from .monitor import TrainingMonitor
from .names import plain_names, unwrapped
from .offload.streaming import SwapFiles
from .optim.onebit import CompressedExchange
from .ownership import claim_parameters, release_parameters
from .profiling.comms import CommsLogger, format_summary
from .profiling.flops import FlopsProfiler
from .quant.export import write_quantized_state
from .quant.scheme import QuantScheme
from .schedulers import load_scheduler_state
from .stage_context import StageContext
from .start_summary import RankLayout, start_summary
from .step_line import report_progress
from .timers import phase
from .zero.builders import ShardingPlan
from .zero.gathered import GatheredParameters, ModifierRank
from .zero.optimizer import OptimizerLike, OptimizerPiece

__all__ = ["ZeroEngine"]

log = logging.getLogger(__name__)

SchedulerLike = Any  # an LRScheduler bound to the user's optimizer, or optimizer -> scheduler


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
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerLike | None,
        config: Any = None,
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
        """One INFO line on the job's first rank once the engine is built (a pipeline: on each
        stage's first rank, its stages holding different layers): stage, ranks, precision,
        offload and this rank's model state (``core/start_summary.py``); local figures only,
        no collective."""
        tp, ctx = self.tensor_parallel, self.pipeline_stage
        first = self.rank == 0 and (tp is None or tp.comm.rank == 0)
        if not first or not log.isEnabledFor(logging.INFO):
            return
        ranks = RankLayout(
            self.world_size,
            self.shard_comm.world_size,
            tp.size if tp is not None else 1,
            ctx.stage if ctx is not None else None,
            ctx.stages if ctx is not None else 1,
        )
        formula = zero_formula_bytes(self.plan.groups, self.precision.mixed)
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
        place = parts.checkpoint
        self.checkpoint_comm = place.comm
        self.checkpoint_partial = place.partial
        self.checkpoint_stage = place.stage
        self.checkpoint_aliases = place.aliases
        # the swap files a checkpoint reads and writes in place, during one (core/offload)
        self.checkpoint_io: SwapFiles | None = None
        self.precision = parts.precision.policy
        self._scaler = parts.precision.scaler
        self.gradient_accumulation_steps: int = parts.config.gradient_accumulation_steps
        self.timers = parts.timers
        self._offload = parts.offload
        self.plan: ShardingPlan = parts.plan
        refuse_unset_forward(self.module, self.plan.unset_buffers)
        self.optimizer = parts.optimizer.optimizer
        self._sharded_opt = parts.optimizer.sharded
        self.lr_scheduler = parts.optimizer.lr_scheduler
        self.trainable = parts.optimizer.trainable
        self.compression = parts.compression

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; under mixed precision floating-point inputs are cast
        to the compute dtype and floating-point outputs come back in fp32."""
        with phase(self.timers, "forward"), self._memory_phase("forward"):
            args, kwargs = self.precision.cast_inputs((args, kwargs))
            with self._flops("forward", args):
                out = self.module(*args, **kwargs)
            return self.precision.cast_outputs(out)

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
            micro_batches=self.config.gradient_accumulation_steps if ctx is not None else 1,
        )

    def _flops(self, phase_name: str, *args: Any) -> contextlib.AbstractContextManager[Any]:
        profiler = self.flops_profiler
        if profiler is None:
            return contextlib.nullcontext()
        return getattr(profiler, phase_name)(self.global_steps, *args)

    def flops_report(self) -> dict[str, Any]:
        """With ``flops_profiler.enabled``, once its ``profile_step`` has run: this rank's
        profile of that step (``core/profiling/flops.py``): ``params``, ``fwd_flops``,
        ``fwd_macs``, ``bwd_flops``, ``train_flops``, the latencies (``fwd_latency_s`` ...
        ``iter_latency_s``), ``fwd_tflops`` ... ``achieved_tflops``, ``peak_tflops`` with
        ``peak_source``, ``mfu``, ``samples_per_second``, ``batch_size``, ``world_size``,
        ``dp_size``, ``mp_size``, ``step`` and ``modules`` (per ``named_modules()`` name, the
        root as ``""``: ``type``, ``depth``, ``params``, ``flops``, ``macs``, ``latency_s``);
        else ``{}``."""
        return dict(self.flops_profiler.report) if self.flops_profiler is not None else {}

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next :meth:`step` runs the optimizer: every
        ``gradient_accumulation_steps``-th micro-step, unless
        :meth:`set_gradient_accumulation_boundary` says otherwise."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Let the training loop decide the accumulation boundary (as DeepSpeed's method of
        the same name): ``True`` makes the next backward reduce for an optimizer step and
        the next :meth:`step` run the optimizer, ``False`` makes them accumulate; ``None``
        returns to counting micro-steps. Front ends whose framework owns accumulation
        (Accelerate's ``sync_gradients``) set it before every backward."""
        self._boundary = None if is_boundary is None else bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps (and multiplied by the fp16
        loss scale); gradients are reduced bucket by bucket while backward runs."""
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
        ):
            scaled.backward(retain_graph=retain_graph)
        self._own_grads = True
        return loss

    def _drop_foreign_grads(self) -> None:
        """Gradients that reached this model since its last step from a backward this engine
        did not start (another engine's loss through this model: a GAN's generator loss
        through the discriminator) are not this step's: dropped, as the ``zero_grad()`` a
        torch loop calls before its backward drops them (a front end's ``optimizer.zero_grad()``
        does not reach the engine). Logged once per engine (logger ``ds_strategy.core.engine``)."""
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
        """Accumulate gradients locally without reducing them (like DDP's ``no_sync``).
        The first backward outside the context (or the next optimizer step) reduces the
        accumulated gradients. Under stages 2/3 this gives up their memory bound: every
        full-size gradient bucket stays alive from the first backward inside the context
        until that reduction (without ``no_sync``, each micro-step reduce-scatters into the
        gradient shard and at most two buckets are alive at any moment)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def step(self, grad_norm: float | None = None) -> None:
        """At an accumulation boundary: finish gradient reduction, clip by the global norm,
        run the optimizer and the lr scheduler, rebuild full parameters, zero gradients; a
        non-finite norm skips the step instead. Then the config's periodic checkpoint.

        ``grad_norm`` replaces the norm of this engine's gradients for clipping and overflow
        detection: a caller that trains a larger model of which this engine holds one part
        (a pipeline stage) passes the whole model's L2 norm, loss scale included, after
        :meth:`reduced_grad_norm`. It must be the same on every rank of this engine."""
        if self.is_gradient_accumulation_boundary():
            with phase(self.timers, "step"), self._flops("step"), self._memory_phase("step"):
                self._optimizer_step(grad_norm)
            self.global_steps += 1
            self._end_memory_step()
            self._compile_watch.after_step(self.global_steps)
            if self.timers is not None:
                self.timers.end_step(self.global_steps)
            report_progress(
                self.config.steps_per_print,
                self.global_steps,
                self.skipped_steps,
                self.optimizer.param_groups,
            )
            if self.monitor is not None:
                self.monitor.after_step(self)
        elif grad_norm is not None:
            raise RuntimeError(
                "step(grad_norm=...) between accumulation boundaries: there is no optimizer "
                "step for the norm to apply to; pass it at a boundary only"
            )
        self.micro_steps += 1
        self._checkpoints.after_step()  # the config's checkpoint.save_interval

    def reduced_grad_norm(self) -> float:
        """Finish this boundary's gradient reduction (once; later calls return the same value)
        and return the global L2 norm of the gradients over this engine's ranks, as reduced,
        loss scale included. Collective; call it at an accumulation boundary, before
        :meth:`step`, on every rank.

        The norm is all-reduced, so an inf/nan gradient on any rank makes it non-finite on
        every rank: all ranks agree to skip without a separate overflow collective."""
        if not self.is_gradient_accumulation_boundary():
            raise RuntimeError(
                "reduced_grad_norm() between accumulation boundaries: the gradients are still "
                "being accumulated; call it when is_gradient_accumulation_boundary() is True"
            )
        if self._ready_norm is None:
            self.plan.wait_params()  # the optimizer writes slices a late all-gather still reads
            self.plan.finish_reduction()
            if isinstance(self.shard_comm, MiCSComm):
                shards = [g.ensure_grad_shard() for g in self.plan.groups if g.trainable]
                self.shard_comm.sum_over_replicas(shards)
            self._ready_norm = self._sharded_opt.sync_grad_flags_and_norm()
        return self._ready_norm

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of this optimizer step by their global L2 norm, like
        ``torch.nn.utils.clip_grad_norm_`` over the full (unsharded) gradients, and return
        that norm before clipping (loss scale removed; inf/nan on an fp16 overflow, whose
        step :meth:`step` then skips).

        Call it at an accumulation boundary, after the last backward and before :meth:`step`:
        it finishes the gradient reduction, so the optimizer step that follows only applies
        the clipped gradients (the config's ``gradient_clipping``, if set, clips on top as a
        second clip would). Calling it twice clips twice, as torch does."""
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
        return isinstance(self.optimizer, CompressedExchange) and self.optimizer.exchanged

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

    def zero_grad(self) -> None:
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
        """The tensors :attr:`optimizer` updates on this rank, one per piece of a trainable
        parameter that this rank owns (its ``group``, parameter ``index``, ``tensor``, and
        ``start``, its offset in the flattened parameter); ``piece.grad()`` is its reduced
        gradient. Checkpoints save the optimizer state by these; read-only."""
        return tuple(self._sharded_opt.pieces)

    def checkpoint_shards(self) -> ShardedState:
        """This rank's weights, optimizer slots and compression buffers, each with its place
        in the whole parameter (``checkpoint/seam.py``): views of the live storage, once the
        in-flight parameter gathers have landed. What a checkpoint saves and loads into."""
        return sharded_state(
            self.plan,
            self.module,
            self.tensor_parallel,
            self.optimizer_pieces,
            self.compression,
            stage=self.stage,
            world_size=self.world_size,
            tp_degree=self.mesh.tp,
        )

    def checkpoint_loaded(self) -> None:
        """A checkpoint load overwrote the shards: rebuild the resident full parameters."""
        self.plan.after_load()

    def checkpoint_partial_window(self) -> int:
        """Micro-batches whose gradients are accumulated but not yet stepped (0 at an
        accumulation boundary): a checkpoint holds no gradients, so a save now drops them."""
        if not any(g.holds_grads() for g in self.plan.groups):
            return 0
        return self.micro_steps % self.gradient_accumulation_steps or 1

    def checkpoint_state(self) -> dict[str, Any]:
        """The training-loop state a checkpoint records besides weights and optimizer state:
        ``global_steps``, ``micro_steps``, ``skipped_steps``, the lr scheduler's and the fp16
        loss scaler's ``state_dict()`` (``None`` without one). Plain data, the same on every
        rank; :meth:`restore_checkpoint_state` puts it back."""
        sched = self.lr_scheduler
        return {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
            "lr_scheduler": sched.state_dict() if sched is not None else None,
            "loss_scaler": self._scaler.state_dict() if self._scaler is not None else None,
        }

    def restore_checkpoint_state(self, state: dict[str, Any], *, lr_scheduler: bool = True) -> None:
        """Put back what :meth:`checkpoint_state` returned (keys missing from an older
        checkpoint keep their defaults). ``lr_scheduler=False`` leaves the schedule alone: it
        belongs to the optimizer, which a weights-only load does not restore."""
        self.global_steps = int(state["global_steps"])
        self.micro_steps = int(state["micro_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        sched_state = state.get("lr_scheduler")
        if lr_scheduler and self.lr_scheduler is not None and sched_state is not None:
            load_scheduler_state(self.lr_scheduler, sched_state)
        if self._scaler is not None and state.get("loss_scaler") is not None:
            self._scaler.load_state_dict(state["loss_scaler"])

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights on every rank: the keys and shapes of the original
        ``model.state_dict()`` (buffers and every name of a tied weight included); for a
        model given inside ``torch.compile`` or DDP, the names of the model inside, without
        ``_orig_mod.`` or ``module.``. Collective. ``rank0_only=True`` gathers them to rank 0
        alone (the other ranks get ``{}`` and never hold a full-size copy), for exports that
        rank 0 writes."""
        tp = self.tensor_parallel
        plain = plain_names(self.module)  # a compiled or DDP-wrapped model: its model's names
        with self._offload_resident(dirty=False, optimizer_state=False):
            if tp is None:
                state = self.plan.full_state_dict(self.module, rank0_only, self.rank)
                return {plain(k): v for k, v in state.items()}
            # every rank gathers its tensor-parallel part over the data-parallel ranks, then
            # the parts are joined over the tensor-parallel ranks (original names and shapes)
            state = tp.full_state_dict(self.plan.full_state_dict(self.module, False, self.rank))
        if rank0_only and torch.distributed.get_rank() != 0:
            return {}
        return {plain(k): v for k, v in state.items()}

    def gathered_parameters(
        self,
        params: nn.Parameter | Iterable[nn.Parameter] | None = None,
        modifier_rank: ModifierRank = None,
    ) -> GatheredParameters:
        """A ``with`` block inside which ``params`` hold their full values on every rank, as
        DeepSpeed's ``zero.GatheredParameters``. Collective: every rank enters and leaves it.

        Values written inside are kept only with ``modifier_rank``: they go into the shards
        and into the fp32 masters the optimizer steps, so training and saving afterwards see
        them (see ``core/zero/gathered.py``). Do not run the model's forward inside.

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
        """Write the consolidated fp32 weights (:meth:`full_state_dict`) to one file:
        ``.safetensors`` by suffix, else ``torch.save``. Collective; rank 0 gathers and writes.

        >>> engine.save_weights("model.safetensors")  # doctest: +SKIP
        """
        state = self.full_state_dict(rank0_only=True)
        path = Path(path)
        if self.rank == 0 and self.mesh.coordinates["tp"] == 0:
            write_weights(state, path)
        self.comm.barrier()
        if self.tensor_parallel is not None:
            torch.distributed.barrier()
        return path

    def load_weights(self, path: str | os.PathLike, *, strict: bool = True) -> LoadedWeights:
        """Read pretrained weights into the shards: the counterpart of :meth:`save_weights`,
        and of DeepSpeed's ``zero.Init`` with ``from_pretrained``. Collective.

        Each rank reads only the bytes of its own shard, straight into it (with NVMe
        offload, into its swap file), so a model built on the meta device never exists
        whole on any rank. Persistent buffers are read too. Buffers the files do not hold
        (a rotary ``inv_freq``) keep what the model's initialisation computed at
        ``initialize``; one that nothing computed is an error naming it. The optimizer
        state and step counters are left as they are.

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
        """Write the consolidated weights in the quantized inference format of the config's
        ``quantization`` section (``bits``, ``group_size``, ``symmetric``,
        ``modules_to_not_convert``): after quantization-aware training (``qat: true``) these
        are exactly the integers training computed with. ``ds_strategy.init_inference(model,
        checkpoint=path)`` loads the file as stored. Collective; rank 0 gathers and writes.

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
            torch.distributed.barrier()
        return path

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        tag: str | None = None,
        client_state: Any = None,
        save_latest: bool = True,
        *,
        include_optimizer: bool = True,
        async_save: bool | None = None,
    ) -> Path:
        """Write the whole training state; every rank writes its own shards in parallel.
        Collective: call it on every rank. Returns the checkpoint directory.

        With ``tag`` (DeepSpeed's layout) ``path`` is a root: the checkpoint goes to
        ``path/tag`` and ``path/latest`` names it (unless ``save_latest=False``); the config's
        ``checkpoint.keep_last`` prunes older tags. Without ``tag``, ``path`` is the
        checkpoint directory itself (or, if it holds a ``latest`` file, a root and the tag is
        ``global_step<N>``). The directory appears atomically (a crash mid-save leaves the
        previous checkpoint and ``latest`` intact) and loads into any world size or ZeRO
        stage. ``client_state`` (any picklable object) comes back from
        :meth:`load_checkpoint`. ``include_optimizer=False`` writes a weights-only checkpoint.
        ``async_save=True`` (default: the config's ``checkpoint.async_save``) copies the state
        and writes it in the background; see :meth:`wait_for_checkpoint`.

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
        """Restore weights, optimizer state, lr scheduler, step counters and RNG state from a
        checkpoint written by :meth:`save_checkpoint`, at any world size or stage: ``path/tag``,
        the checkpoint a root's ``latest`` file names, or the directory ``path``; or a
        pipeline's checkpoint (its root, holding ``stage_<k>``), whatever its stages. Returns
        the saved ``client_state``. ``load_optimizer=False`` restores the weights (and counters)
        only, into an engine whose optimizer may differ, e.g. one built for evaluation. A
        damaged or foreign checkpoint raises on every rank, naming the file; so does one that
        records no checksums, unless ``require_checksums=False``, and one whose ``latest`` or
        metadata points outside its directory. Nothing in the checkpoint can run code:
        metadata and saved objects are read by allow-listing unpicklers, so a
        ``client_state`` (or scheduler state) holding objects other than tensors and plain
        data is refused, naming the type, unless ``trust_checkpoint=True``."""
        with self._streamed(load=True):
            client_state = self._checkpoints.load(
                path, tag, load_optimizer, require_checksums, trust_checkpoint
            )
        if isinstance(self.compression, (OneBitReduction, ZeroOneReduction)):
            self.compression.reset()  # errors restart; 1-bit momenta come from the loaded state
        self._count_resident()
        return client_state

    def compile(  # type: ignore[override]
        self, backend: Any = None, compile_kwargs: dict[str, Any] | None = None
    ) -> None:
        """``torch.compile`` the model one unit at a time, as DeepSpeed's ``engine.compile``:
        each block that ZeRO-3 gathers as one (the same blocks at every stage), or the whole
        model when it has none (which blocks: ``compile_units`` in ``core/compiled.py``). The gather and
        release around a unit run eagerly between its compiled graphs (see [Note: compiled
        units] in ``zero/stage3.py``). ``backend`` and ``compile_kwargs`` (``mode``,
        ``dynamic``, ``fullgraph``, ``options``): torch.compile's; by default the config's
        ``compile`` section's. A unit compiled already, or a model compiled as a whole, is
        left as it is. The config's ``compile.enabled`` calls this at ``initialize``."""
        section = self.config.compile
        fn = compile_backend(section.backend if backend is None else backend)
        kwargs = dict(section.kwargs if compile_kwargs is None else compile_kwargs)
        check_compile_kwargs(kwargs)
        compile_units(self.module, fn, kwargs)

    def compile_report(self) -> dict[str, Any]:
        """What torch.compile did since the engine was built: ``compiled_units`` (modules
        that run compiled), ``graphs`` (graphs Dynamo compiled; 0 when the units reuse the
        graphs compiled for an earlier engine's copy of the model), ``graph_breaks`` and
        ``break_reasons`` (the first line of each reason, with its count), and
        ``last_new_graph_step`` (the optimizer step during which the latest graph was compiled,
        ``None`` if none was; a model whose guards hold compiles nothing after its first train
        and evaluation steps). Dynamo counts per process: see ``core/compiled.py``."""
        return self._compile_watch.report()

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The engine's saves and loads (how many saves began, whether one is being written)."""
        return self._checkpoints

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save has been written, renamed into place and
        ``latest`` updated; re-raise its error if it failed. Call it (or :meth:`destroy`)
        before destroying the process group: the writer's collectives need it."""
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
        """Bytes of model state this rank holds now: ``params``, ``grads``,
        ``optimizer_state`` and ``compression_state`` (top-k residuals, 1-bit momenta and
        errors; ``total`` is their sum; bytes swapped to NVMe files are not in
        it, ``offloaded_nvme`` counts them, and ``swap_buffers`` the host bytes of swapped tensors
        back in memory now: a step's buckets, shards read for a gather); ``peak``, the most model-state bytes held at
        any moment since the engine was built or :meth:`reset_peak_memory` was called,
        transient buffers included (ZeRO-3's gathered parameters, full-size gradient
        buckets, reductions in flight, the step's fp32 gradient copies; with NVMe offload
        the gradient shards, in memory only during a step, are counted there and not in
        ``grads``); and ``peak_gathered_params``, the bytes of ZeRO-3 parameters
        gathered at once."""
        report = self._resident_report()
        if self._offload is not None:  # bytes moved out to files: not in total
            report.update(self._offload.report())
        report["peak"] = self.plan.meter.peak
        return report

    def memory_timeline(self) -> list[dict[str, Any]]:
        """With the config's ``memory_timeline.enabled``: the model-state meter's events of
        the latest finished optimizer step (of the step under way before the first one ends),
        each a dict of ``seq``, ``time_s``, ``step``, ``phase`` (``forward``, ``backward``,
        ``step`` or ``idle``), ``event`` (``alloc``, ``free``, ``resident``, ``touch``),
        ``nbytes`` and the bytes held after it: ``resident``, ``transient``, ``total``, and
        the ``peak`` so far (see ``core/memory_timeline.py``); else ``[]``. With
        ``csv_monitor`` on, every rank also writes them to ``memory_timeline_<rank>.csv`` in
        the monitor's directory every ``steps_per_print`` steps and at :meth:`destroy`."""
        return self._timeline.events() if self._timeline is not None else []

    def _build_memory_timeline(self) -> MemoryTimeline | None:
        section = self.config.memory_timeline
        if not section.enabled:
            return None
        timeline = MemoryTimeline(section.max_events)
        self.plan.meter.timeline = timeline
        return timeline

    def _memory_phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        timeline = self._timeline
        return contextlib.nullcontext() if timeline is None else timeline.phase(name)

    def _end_memory_step(self) -> None:
        if self._timeline is None:
            return
        self._timeline.end_step(self.global_steps)
        if self.global_steps % self.config.report_every == 0:
            self._write_memory_timeline()

    def _write_memory_timeline(self) -> None:
        """The timeline to the csv_monitor's directory, when both are on (every rank)."""
        csv_section = self.config.csv_monitor
        if self._timeline is None or csv_section.enabled is not True:
            return
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_initialized() else self.rank
        path = timeline_path(csv_section.output_path, csv_section.job_name, rank)
        mixed = self.precision.param_dtype != torch.float32
        self._timeline.write_csv(path, zero_formula_bytes(self.plan.groups, mixed))

    def reset_peak_memory(self) -> None:
        """Start ``memory_report()["peak"]`` and ``["peak_gathered_params"]`` again from the
        bytes held now."""
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
        return report

    def _count_resident(self) -> None:
        self.plan.meter.set_resident(self._resident_report()["total"])

    def timing_report(self) -> dict[str, float]:
        """With ``wall_clock_breakdown``: the latest per-step means of the forward / backward
        / reduce / gather / step milliseconds (``<phase>_ms``; a pipeline stage adds
        ``schedule_ms``, see ``timers.py``) and bytes sent per collective kind
        (``<kind>_bytes``), refreshed every ``steps_per_print`` steps; else ``{}``."""
        return dict(self.timers.last_report) if self.timers is not None else {}

    def comm_report(self) -> dict[str, int]:
        """Bytes this rank sent per collective kind since the previous call; with tensor
        parallelism the tensor-parallel group's kinds are prefixed ``tp_`` (the rest are the
        data-parallel group's) and ``total`` counts both. ``intra_machine`` and
        ``inter_machine`` split ``total`` by the link of the group each was sent on (a group
        with ranks on several machines is ``inter``, see ``core/topology.py``)."""
        report = self.comm.take_report()
        report.update(self.comm.take_links())
        if self.tensor_parallel is not None:
            self.tensor_parallel.comm.take_into(report, "tp_")
        return report

    def comms_report(self) -> dict[str, Any]:
        """With ``comms_logger.enabled``: per collective kind of the engine's data-parallel
        groups since the engine was built, ``count``, ``msg_bytes``, ``sent_bytes`` (the bytes
        :meth:`comm_report` counts), ``total_ms``, ``avg_ms``, ``algbw_gbps``, ``busbw_gbps``
        and the straggler gap ``straggler_ms`` (every rank's total in ``rank_total_ms``), see
        ``core/profiling/comms.py``; a collective, called on every rank. Disabled:
        ``{"enabled": False, ...}`` with no ops, and no collective."""
        logger = self.comm.comms_logger
        if logger is None:
            return CommsLogger.disabled_report()
        return logger.report(self.comm.all_gather_object)

    def log_summary(self, show_straggler: bool = True) -> dict[str, Any]:
        """:meth:`comms_report`, printed on rank 0 as DeepSpeed's ``comm.log_summary`` prints
        it (with the straggler breakdown unless ``show_straggler`` is false; a report of the
        ``ds_strategy.core.engine`` logger, see ``ds_strategy/_logging.py``); a collective."""
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
            if self._offload is not None:
                self._offload.close()
            release_parameters(self._claimed, self)
            if self.monitor is not None:
                self.monitor.close()
            self._write_memory_timeline()
