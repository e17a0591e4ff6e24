"""A :class:`~ds_strategy.accelerate.ZeroAccelerator` training one model with a ZeRO engine.
Before ``prepare``, and for objects it did not prepare, Accelerate's own behaviour applies.

[Note: who decides the accumulation boundary]
Accelerate (``accelerator.sync_gradients``: every k-th batch inside ``accumulate()``, and at
the end of a dataloader), not the engine's step count: before every backward its decision goes
to ``engine.set_gradient_accumulation_boundary``, as in Accelerate's DeepSpeed integration.
A boundary backward leaves the optimizer step pending, so ``clip_grad_norm_`` (the engine's:
it finishes the reduction and clips the shards) and then ``optimizer.step()`` keep the order
and meaning of plain Accelerate.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils.deepspeed import DummyScheduler
from torch import nn
from torch.utils.data import DataLoader

from ..config._auto import fill_auto
from ..core import ZeroEngine
from ..frontends.engines import move_real_tensors, move_schedulers, timing_sink
from ._front import Front, prepared, torch_optimizer

__all__ = ["EngineFront", "ZeroOptimizerWrapper"]


class ZeroOptimizerWrapper(AcceleratedOptimizer):
    """What ``prepare`` returns for the optimizer: the engine's, over this rank's shards (so is
    its ``state_dict()``: use ``accelerator.save_state``). ``step()`` runs the pending engine
    step; ``zero_grad()`` is a no-op: the engine zeroes gradients after every step."""

    def __init__(self, engine: ZeroEngine, front: EngineFront) -> None:
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self.front = front
        self.skipped = False

    def step(self, closure: object = None) -> None:
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported by ZeroAccelerator: the engine steps "
                "once per accumulation boundary; compute the loss before calling step()"
            )
        if not self.front.step_pending:
            return
        skipped_before = self.engine.skipped_steps
        self.engine.set_gradient_accumulation_boundary(True)
        try:
            self.engine.step()
        finally:
            self.front.step_pending = False
        self.skipped = self.engine.skipped_steps != skipped_before

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass

    @property
    def step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow)."""
        return self.skipped


class EngineFront(Front):
    trained: ZeroEngine | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.wrapper: ZeroOptimizerWrapper | None = None
        self.user_optimizer: weakref.ref[Any] | None = None
        self.step_pending = False  # a boundary backward waits for optimizer.step() (see the note)

    @property
    def zero_engine(self) -> ZeroEngine | None:
        return self.trained

    def prepare_loader(self, loader: DataLoader) -> Any:
        if loader.batch_size is not None:
            split = (
                self.acc.num_processes // self.tensor_parallel_size if self.acc.split_batches else 1
            )
            self.batch_sizes.append(loader.batch_size // split)
        return self.acc.prepare_data_loader(loader)

    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module) and not isinstance(obj, ZeroEngine)

    def scheduler_alone(self) -> NoReturn:
        raise ValueError(
            "accelerate.utils.DummyScheduler must be passed to prepare() together with the "
            "model and its DummyOptim"
        )

    def build(self, model: nn.Module, user_opt: Any, dummy: Any) -> tuple[Any, Any, Any]:
        sched = _engine_scheduler(self.cfg, dummy)
        groups = getattr(user_opt, "param_groups", None)
        config = getattr(model, "config", None)  # a Hugging Face model's
        hidden, sizes = getattr(config, "hidden_size", None), getattr(config, "hidden_sizes", None)
        facts = self.facts(
            user_opt,
            self.acc.num_processes // self.tensor_parallel_size,  # data-parallel ranks
            min(self.batch_sizes, default=None),  # Accelerate's is_train_batch_min default
            hidden_size=max(sizes) if hidden is None and sizes else hidden,
            base_lr=float(groups[0]["lr"]) if groups else None,  # a DummyOptim's: optimizer_lr
            warmup_num_steps=getattr(dummy, "warmup_num_steps", None),
            total_num_steps=getattr(dummy, "total_num_steps", None),
        )
        resolved = fill_auto(self.cfg, facts)
        optimizer = torch_optimizer(resolved, user_opt)
        move_real_tensors(model, self.acc.device)  # meta tensors: the engine materialises them
        engine = ZeroEngine(model, optimizer, resolved, lr_scheduler=sched)
        if engine.timers is not None:  # wall_clock_breakdown: also to the trackers, once started
            engine.timers.add_sink(timing_sink(self._log))
        self.adopt_steps(engine.gradient_accumulation_steps)
        self.trained = self.model = engine
        self.wrapper = ZeroOptimizerWrapper(engine, self)
        self.user_optimizer = weakref.ref(user_opt)
        return engine, self.wrapper, self.register(engine, self.wrapper, engine.lr_scheduler)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.acc.trackers:  # init_trackers() was called; log() writes on the main process only
            self.acc.log(metrics, step=step)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Wrap ``scheduler`` as Accelerate does, after moving it onto the engine's optimizer."""
        if prepared(scheduler):
            return scheduler
        wrapper = self.wrapper
        if wrapper is None or self.trained is None:
            raise ValueError(
                "prepare the model and optimizer before (or together with) the lr scheduler"
            )
        bound = getattr(scheduler, "optimizer", None)
        user_opt = self.user_optimizer() if self.user_optimizer is not None else None
        if bound is None or all(bound is not o for o in (user_opt, wrapper, wrapper.optimizer)):
            raise ValueError(
                "the lr scheduler is built on an optimizer this ZeroAccelerator did not prepare; "
                "build it on the optimizer passed to (or returned by) prepare()"
            )
        move_schedulers(self.trained, [scheduler])
        out = AcceleratedScheduler(
            scheduler,
            wrapper,
            step_with_optimizer=self.acc.step_scheduler_with_optimizer,
            split_batches=self.acc.split_batches,
        )
        self.acc._schedulers.append(out)
        return out

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        engine = self.trained
        if engine is None:
            return Accelerator.backward(self.acc, loss, **kwargs)
        unknown = sorted(set(kwargs) - {"retain_graph"})
        if unknown:
            raise TypeError(f"ZeroAccelerator.backward does not support {', '.join(unknown)}")
        boundary = self.acc.sync_gradients
        # Accelerate's setter may change the steps after prepare(); its value divides the loss.
        engine.gradient_accumulation_steps = self.acc.gradient_accumulation_steps
        engine.set_gradient_accumulation_boundary(boundary)  # stages 0/1 reduce only then
        engine.backward(loss, retain_graph=bool(kwargs.get("retain_graph", False)))
        if boundary:
            self.step_pending = True
        elif not self.step_pending:
            engine.step()  # not a boundary: only counts the micro-step

    def check_accumulate(self) -> None:
        """Accelerate's ``accumulate()`` drives the engine's boundaries (see the module note)."""

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not self.owns(model):
            with Accelerator.no_sync(self.acc, model):
                yield
            return
        engine = self.trained
        assert engine is not None
        # Stages 2/3 reduce every backward into the gradient shards: skipping that would hold
        # full-size unreduced gradients, as Accelerate's DeepSpeed integration also avoids.
        with engine.no_sync() if engine.stage < 2 else contextlib.nullcontext():
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        engine = self.trained
        if engine is None:
            return Accelerator.clip_grad_norm_(self.acc, parameters, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): ZeRO clips by L2 norm only")
        if not float(max_norm) > 0:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): must be > 0")
        wanted = {id(p) for p in engine.module.parameters() if p.requires_grad}
        given = {id(p) for p in parameters}
        if not given <= {id(p) for p in engine.module.parameters()} or not wanted <= given:
            raise ValueError(
                "clip_grad_norm_ clips the global norm of all the model's gradients at once; "
                "pass model.parameters() of the prepared model (a subset, or parameters of "
                "another model, cannot be clipped separately under ZeRO)"
            )
        if not self.step_pending:
            where = (
                "before accelerator.backward(loss) or after optimizer.step()"
                if self.acc.sync_gradients
                else "at a micro-step that is not an accumulation boundary "
                "(accelerator.sync_gradients is False)"
            )
            raise RuntimeError(
                f"clip_grad_norm_ was called {where}; ZeRO clips the reduced, accumulated "
                "gradients of an optimizer step: call it under `if accelerator.sync_gradients:` "
                "between backward and optimizer.step()"
            )
        return torch.tensor(engine.clip_grad_norm_(float(max_norm)), device=self.acc.device)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self.trained is None:
            return Accelerator.clip_grad_value_(self.acc, parameters, clip_value)
        raise RuntimeError(
            "clip_grad_value_ is not supported by ZeroAccelerator (gradients are sharded and "
            "clipped inside the engine's step); use clip_grad_norm_"
        )

    def load_state(self, input_dir: str | None, trust_checkpoint: bool) -> None:
        self.step_pending = False
        super().load_state(input_dir, trust_checkpoint)

    def free(self) -> None:
        super().free()
        self.wrapper = self.user_optimizer = None
        self.step_pending = False


def _engine_scheduler(cfg: Any, dummy: DummyScheduler | None) -> Any:
    """What the engine builds its scheduler from: None when the config has a ``scheduler``
    section (a DummyScheduler then only gives its "auto" step counts), else the callable."""
    callable_ = dummy.lr_scheduler_callable if dummy is not None else None
    if cfg.scheduler is not None and callable_ is not None:
        raise ValueError(
            f"the ZeRO config's scheduler section ({cfg.scheduler.type}) and "
            "DummyScheduler(lr_scheduler_callable=...) both define the lr schedule; keep one"
        )
    if cfg.scheduler is None and dummy is not None and callable_ is None:
        raise ValueError(
            "DummyScheduler without lr_scheduler_callable needs a 'scheduler' section in the "
            "ZeRO config (e.g. WarmupLR); add one or pass lr_scheduler_callable"
        )
    return callable_
