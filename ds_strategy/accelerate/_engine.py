"""A :class:`~ds_strategy.accelerate.ZeroAccelerator` training models with ZeRO engines, one
per prepared model (see [Note: several models]). Before ``prepare``, and for objects it did
not prepare, Accelerate's own behaviour applies.

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
from accelerate.scheduler import AcceleratedScheduler
from torch import nn
from torch.utils.data import DataLoader

from ..config.loop import fill_auto, model_hidden_size
from ..core import ZeroEngine
from ..core.loop import norm_only
from ..core.optimizers import engine_schedule
from ..core.several import PendingSteps, pair_optimizers
from ..frontends.engines import move_real_tensors, move_schedulers, timing_sink
from ._front import EngineOptimizer, Front, torch_optimizer
from ._private import is_prepared, track

__all__ = ["EngineFront", "ZeroOptimizerWrapper"]


class ZeroOptimizerWrapper(EngineOptimizer):
    """``step()`` runs the pending engine step. ``zero_grad()``: with one model a no-op (the
    engine zeroes gradients after every step); with several, at an accumulation boundary it
    zeroes the engine's gradients, as Accelerate's optimizer does (see [Note: several models])."""

    engine: ZeroEngine

    def __init__(self, engine: ZeroEngine, front: EngineFront, user_optimizer: Any) -> None:
        super().__init__(engine)
        self.front = front
        self.user_optimizer = weakref.ref(user_optimizer)

    def owns(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` is this model's: the user's, this wrapper, or the engine's."""
        mine = (self.user_optimizer(), self, self.engine.optimizer)
        return optimizer is not None and any(optimizer is o for o in mine)

    def step(self, closure: object = None) -> None:
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported by ZeroAccelerator: the engine steps "
                "once per accumulation boundary; compute the loss before calling step()"
            )
        skipped = self.front.steps.step(self.engine, self.front.acc.sync_gradients)
        if skipped is not None:  # as Accelerate's optimizer, which steps at a boundary only
            self.skipped = skipped

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.front.several and self.front.acc.sync_gradients:
            self.engine.zero_grad()


# [Note: several models]
# ``prepare(model_a, opt_a, model_b, opt_b, ref_model)`` (in one call or several) builds one
# engine per model: each optimizer goes with the model holding its parameters, and a model
# whose parameters are all frozen gets an engine for evaluation (a reference or reward model,
# sharded at ZeRO-3). The loop then keeps plain Accelerate's semantics: gradients add up over
# backward calls until ``optimizer.zero_grad()`` at a boundary (the engines keep what another
# engine's backward left, ``keep_foreign_grads``), so a generator's loss through the
# discriminator lands there exactly as in plain Accelerate; every backward sets the boundary
# of every trained engine, and leaves the step pending on those it reached. Under fp16 each
# backward must reach one trained model, whose loss scale it uses.


class EngineFront(Front):
    trained: ZeroEngine | None = None  # the first trained engine

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.prepared: list[ZeroEngine] = []  # every model's engine, trained or frozen
        self.wrappers: dict[ZeroEngine, ZeroOptimizerWrapper] = {}  # a trained one's optimizer
        self.steps = PendingSteps()  # the trained engines (see the module note)

    @property
    def several(self) -> bool:
        """Whether more than one trained model was prepared (see [Note: several models])."""
        return len(self.wrappers) > 1

    def engine_of(self, model: Any) -> ZeroEngine | None:
        return next((e for e in self.prepared if model is e or model is e.module), None)

    def owns_optimizer(self, optimizer: Any) -> bool:
        return any(optimizer is w for w in self.wrappers.values())

    def prepare_loader(self, loader: DataLoader) -> Any:
        if loader.batch_size is not None:
            split = self.acc.num_processes // self.ranks_per_batch if self.acc.split_batches else 1
            self.batch_sizes.append(loader.batch_size // split)
        return self.acc.prepare_data_loader(loader)

    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module) and not isinstance(obj, ZeroEngine)

    def pair_up(
        self, args: tuple[Any, ...], models: list[int], opts: list[int], scheds: list[int]
    ) -> list[tuple[int, int | None]]:
        """Each optimizer with the model holding its parameters; a model without one must be
        frozen (see [Note: several models])."""
        if len(models) == 1 and len(opts) == 1 and not self.prepared:
            return super().pair_up(args, models, opts, scheds)  # one model: any scheduler
        if scheds:
            raise ValueError(
                "a DummyScheduler (the engine's own scheduler) goes with one model and its "
                "optimizer prepared alone; with several models pass torch lr schedulers"
            )
        owners = pair_optimizers([args[m] for m in models], [args[o] for o in opts])
        return [(m, None if k is None else opts[k]) for m, k in zip(models, owners, strict=True)]

    def scheduler_alone(self) -> NoReturn:
        raise ValueError(
            "accelerate.utils.DummyScheduler must be passed to prepare() together with the "
            "model and its DummyOptim"
        )

    def _resolved(self, model: nn.Module, user_opt: Any, dummy: Any) -> Any:
        groups = getattr(user_opt, "param_groups", None)
        facts = self.facts(
            user_opt,
            self.acc.num_processes // self.ranks_per_batch,  # data-parallel ranks
            min(self.batch_sizes, default=None),  # Accelerate's is_train_batch_min default
            hidden_size=model_hidden_size(model),
            base_lr=float(groups[0]["lr"]) if groups else None,  # a DummyOptim's: optimizer_lr
            warmup_num_steps=getattr(dummy, "warmup_num_steps", None),
            total_num_steps=getattr(dummy, "total_num_steps", None),
        )
        return fill_auto(self.cfg, facts)

    def build(self, model: nn.Module, user_opt: Any, dummy: Any) -> tuple[Any, Any, Any]:
        callable_ = getattr(dummy, "lr_scheduler_callable", None)
        sched = engine_schedule(self.cfg.scheduler, dummy, callable_, "DummyScheduler")
        resolved = self._resolved(model, user_opt, dummy)
        optimizer = torch_optimizer(resolved, user_opt)
        move_real_tensors(model, self.acc.device)  # meta tensors: the engine materialises them
        engine = ZeroEngine(model, optimizer, resolved, lr_scheduler=sched)
        if engine.timers is not None:  # wall_clock_breakdown: also to the trackers, once started
            engine.timers.add_sink(timing_sink(self._log))
        self.adopt_steps(engine.gradient_accumulation_steps)
        wrapper = self.wrappers[engine] = ZeroOptimizerWrapper(engine, self, user_opt)
        self.prepared.append(engine)
        self.steps.add(engine)
        if self.trained is None:
            self.trained = self.model = engine
        for trained in self.wrappers:  # see [Note: several models]
            trained.keep_foreign_grads = self.several
        return engine, wrapper, self.register(engine, wrapper, engine.lr_scheduler)

    def build_frozen(self, model: nn.Module) -> nn.Module:
        """A model prepared without an optimizer: frozen, sharded for evaluation."""
        if any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"ZeroAccelerator.prepare got {type(model).__name__} without an optimizer but "
                "with trainable parameters: pass it with its optimizer (prepare(model, "
                "optimizer)), or freeze it (model.requires_grad_(False)) to prepare a frozen "
                "reference or reward model, sharded for evaluation"
            )
        resolved = self._resolved(model, None, None).replace(optimizer=None, scheduler=None)
        move_real_tensors(model, self.acc.device)
        engine = ZeroEngine(model, None, resolved)
        self.prepared.append(engine)
        track(self.acc, "model", engine)
        return engine

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.acc.trackers:  # init_trackers() was called; log() writes on the main process only
            self.acc.log(metrics, step=step)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Wrap ``scheduler`` as Accelerate does, after moving it onto the engine's optimizer."""
        if is_prepared(scheduler):
            return scheduler
        bound = getattr(scheduler, "optimizer", None)
        wrapper = next((w for w in self.wrappers.values() if w.owns(bound)), None)
        if wrapper is None:
            if not self.wrappers:
                raise ValueError(
                    "prepare the model and optimizer before (or together with) the lr scheduler"
                )
            raise ValueError(
                "the lr scheduler is built on an optimizer this ZeroAccelerator did not prepare; "
                "build it on the optimizer passed to (or returned by) prepare()"
            )
        move_schedulers(wrapper.engine, [scheduler])
        out = AcceleratedScheduler(
            scheduler,
            wrapper,
            step_with_optimizer=self.acc.step_scheduler_with_optimizer,
            split_batches=self.acc.split_batches,
        )
        track(self.acc, "scheduler", out)
        return out

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if not self.steps.engines:
            return Accelerator.backward(self.acc, loss, **kwargs)
        unknown = sorted(set(kwargs) - {"retain_graph"})
        if unknown:
            raise TypeError(f"ZeroAccelerator.backward does not support {', '.join(unknown)}")
        # Accelerate's setter may change the steps after prepare(); its value divides the loss
        steps, retain = self.acc.gradient_accumulation_steps, bool(kwargs.get("retain_graph"))
        self.steps.backward(loss, self.acc.sync_gradients, steps, retain)

    def check_accumulate(self) -> None:
        """Accelerate's ``accumulate()`` drives the engine's boundaries (see the module note)."""

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        engine = self.engine_of(model)
        if engine not in self.wrappers:  # not prepared here, or frozen
            with Accelerator.no_sync(self.acc, model):
                yield
            return
        # Stages 2/3 reduce every backward into the gradient shards: skipping that would hold
        # full-size unreduced gradients, as Accelerate's DeepSpeed integration also avoids.
        with engine.no_sync() if engine.stage < 2 else contextlib.nullcontext():
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        if not self.steps.engines:
            return Accelerator.clip_grad_norm_(self.acc, parameters, max_norm, norm_type)
        where = (
            "before accelerator.backward(loss) or after optimizer.step()"
            if self.acc.sync_gradients
            else "at a micro-step that is not an accumulation boundary "
            "(accelerator.sync_gradients is False)"
        )
        unpending = (
            f"clip_grad_norm_ was called {where}; ZeRO clips the reduced, accumulated "
            "gradients of an optimizer step: call it under `if accelerator.sync_gradients:` "
            "between backward and optimizer.step()"
        )
        norm = self.steps.clip(parameters, max_norm, norm_type, unpending)
        return torch.tensor(norm, device=self.acc.device)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self.trained is None:
            return Accelerator.clip_grad_value_(self.acc, parameters, clip_value)
        raise RuntimeError(norm_only("clip_grad_value_", "accelerator.clip_grad_norm_"))

    def engines(self) -> dict[str, ZeroEngine]:  # type: ignore[override]
        return {f"model_{i}": engine for i, engine in enumerate(self.prepared)}

    def load_state(self, input_dir: str | None, trust_checkpoint: bool) -> None:
        self.steps.forget()
        super().load_state(input_dir, trust_checkpoint)

    def free(self) -> None:
        super().free()
        self.prepared, self.wrappers, self.steps = [], {}, PendingSteps()
