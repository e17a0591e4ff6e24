"""A :class:`~ds_strategy.accelerate.ZeroAccelerator` training one model with a ZeRO engine:
what ``prepare`` builds and how Accelerate's loop calls reach the engine (``_driver.py``).
Before ``prepare`` built the engine, and for objects it did not prepare, Accelerate's own
behaviour applies."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils.deepspeed import DummyScheduler
from torch import nn
from torch.utils.data import DataLoader

from ..config._auto import fill_auto
from ..core import ZeroEngine
from ..frontends.engines import move_schedulers, timing_sink
from ._driver import EngineDriver, ZeroOptimizerWrapper
from ._front import Front, prepared, torch_optimizer

__all__ = ["EngineFront"]


class EngineFront(Front):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.driver: EngineDriver | None = None
        self.wrapper: ZeroOptimizerWrapper | None = None
        self.user_optimizer: weakref.ref[Any] | None = None
        self.batch_sizes: list[int | None] = []

    @property
    def zero_engine(self) -> ZeroEngine | None:
        return self.driver.engine if self.driver is not None else None

    def prepare_loader(self, loader: DataLoader) -> Any:
        if prepared(loader):
            return loader
        size = loader.batch_size
        if size is not None and self.acc.split_batches:
            size //= self.acc.num_processes
        self.batch_sizes.append(size)
        return self.acc.prepare_data_loader(loader)

    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module) and not isinstance(obj, ZeroEngine)

    def engine_scheduler(self, obj: Any) -> bool:
        return isinstance(obj, DummyScheduler)  # the loop's own go through prepare_scheduler

    def scheduler_alone(self) -> NoReturn:
        raise ValueError(
            "accelerate.utils.DummyScheduler must be passed to prepare() together with the "
            "model and its DummyOptim"
        )

    def build(self, model: nn.Module, user_opt: Any, dummy: Any) -> tuple[Any, Any, Any]:
        engine, owned = self._build(model, user_opt, dummy)
        return engine, self.wrapper, owned

    def _build(self, model: nn.Module, user_opt: Any, dummy: Any) -> tuple[ZeroEngine, Any]:
        cfg = self.cfg
        sched = _engine_scheduler(cfg, dummy)
        sizes = [s for s in self.batch_sizes if s is not None]
        facts = self.facts(
            user_opt,
            self.acc.num_processes,
            min(sizes) if sizes else None,  # Accelerate's is_train_batch_min default
            hidden_size=_hidden_size(model),
            base_lr=_lr(user_opt),  # a DummyOptim has no param groups: its lr is optimizer_lr
            warmup_num_steps=getattr(dummy, "warmup_num_steps", None),
            total_num_steps=getattr(dummy, "total_num_steps", None),
        )
        resolved = fill_auto(cfg, facts)
        optimizer = torch_optimizer(resolved, user_opt)
        if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model.to(self.acc.device)  # a meta model is materialised by the engine, unit by unit
        engine = ZeroEngine(model, optimizer, resolved, lr_scheduler=sched)
        if engine.timers is not None:  # wall_clock_breakdown: also to the trackers, once started
            engine.timers.add_sink(timing_sink(self._log))
        self.adopt_steps(engine.gradient_accumulation_steps)
        self.trained, self.driver = engine, EngineDriver(engine)
        self.wrapper = ZeroOptimizerWrapper(engine.optimizer, self.driver)
        self.user_optimizer = weakref.ref(user_opt)
        return engine, self.register(engine, self.wrapper, engine.lr_scheduler)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.acc.trackers:  # init_trackers() was called; log() writes on the main process only
            self.acc.log(metrics, step=step)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Wrap ``scheduler`` as Accelerate does (stepped at optimizer steps, ``num_processes``
        times each unless ``split_batches``), after moving it onto the engine's optimizer."""
        if prepared(scheduler):
            return scheduler
        wrapper = self.wrapper
        if wrapper is None or self.driver is None:
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
        move_schedulers(self.driver.engine, [scheduler])
        acc = self.acc
        out = AcceleratedScheduler(
            scheduler,
            wrapper,
            step_with_optimizer=acc.step_scheduler_with_optimizer,
            split_batches=acc.split_batches,
        )
        acc._schedulers.append(out)
        return out

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.driver is None:
            return Accelerator.backward(self.acc, loss, **kwargs)
        unknown = sorted(set(kwargs) - {"retain_graph"})
        if unknown:
            raise TypeError(f"ZeroAccelerator.backward does not support {', '.join(unknown)}")
        self.driver.backward(
            loss,
            boundary=self.acc.sync_gradients,
            accumulation_steps=self.acc.gradient_accumulation_steps,
            retain_graph=bool(kwargs.get("retain_graph", False)),
        )

    def check_accumulate(self) -> None:
        """Accelerate's ``accumulate()`` drives the engine's boundaries (see ``_driver.py``)."""

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not self.owns(model):
            with Accelerator.no_sync(self.acc, model):
                yield
            return
        engine = self.driver.engine  # type: ignore[union-attr]
        # Stages 2/3 reduce every backward into the gradient shards: skipping that would hold
        # full-size unreduced gradients, as Accelerate's DeepSpeed integration also avoids.
        with engine.no_sync() if engine.stage < 2 else contextlib.nullcontext():
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        if self.driver is None:
            return Accelerator.clip_grad_norm_(self.acc, parameters, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): ZeRO clips by L2 norm only")
        if not float(max_norm) > 0:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): must be > 0")
        module = self.driver.engine.module
        wanted = {id(p) for p in module.parameters() if p.requires_grad}
        given = {id(p) for p in parameters}
        if not given <= {id(p) for p in module.parameters()} or not wanted <= given:
            raise ValueError(
                "clip_grad_norm_ clips the global norm of all the model's gradients at once; "
                "pass model.parameters() of the prepared model (a subset, or parameters of "
                "another model, cannot be clipped separately under ZeRO)"
            )
        if not self.driver.step_pending:
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
        norm = self.driver.engine.clip_grad_norm_(float(max_norm))
        return torch.tensor(norm, device=self.acc.device)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self.driver is None:
            return Accelerator.clip_grad_value_(self.acc, parameters, clip_value)
        raise RuntimeError(
            "clip_grad_value_ is not supported by ZeroAccelerator (gradients are sharded and "
            "clipped inside the engine's step); use clip_grad_norm_"
        )

    def unwrap(self, model: Any) -> nn.Module | None:
        return self.trained.module if self.owns(model) else None  # type: ignore[union-attr]

    def load_state(self, input_dir: str | None, trust_checkpoint: bool) -> None:
        assert self.driver is not None
        self.driver.step_pending = False
        super().load_state(input_dir, trust_checkpoint)

    def free(self) -> None:
        super().free()
        self.driver = self.wrapper = self.user_optimizer = None
        self.batch_sizes = []


def _engine_scheduler(cfg: Any, dummy: DummyScheduler | None) -> Any:
    """The scheduler the engine builds and steps: None when the config's ``scheduler`` section
    names it (the engine builds it; a DummyScheduler only supplies its "auto" step counts),
    else a DummyScheduler's ``lr_scheduler_callable``."""
    callable_ = dummy.lr_scheduler_callable if dummy is not None else None
    if cfg.scheduler is not None:
        if callable_ is not None:
            raise ValueError(
                f"the ZeRO config's scheduler section ({cfg.scheduler.type}) and "
                "DummyScheduler(lr_scheduler_callable=...) both define the lr schedule; keep one"
            )
        return None
    if dummy is not None and callable_ is None:
        raise ValueError(
            "DummyScheduler without lr_scheduler_callable needs a 'scheduler' section in the "
            "ZeRO config (e.g. WarmupLR); add one or pass lr_scheduler_callable"
        )
    return callable_


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)  # a Hugging Face model's
    hidden = getattr(config, "hidden_size", None)
    sizes = getattr(config, "hidden_sizes", None)
    return max(sizes) if hidden is None and sizes else hidden


def _lr(optimizer: Any) -> float | None:
    groups = getattr(optimizer, "param_groups", None)
    return float(groups[0]["lr"]) if groups else None
