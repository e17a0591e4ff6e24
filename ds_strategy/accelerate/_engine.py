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
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from torch import nn
from torch.utils.data import DataLoader

from ..config.loop import fill_auto
from ..core import ZeroEngine
from ..core.loop import clipped_engine, norm_only
from ..core.optimizers import engine_schedule
from ..core.several import backward_of_models, pair_optimizers
from ..frontends.engines import move_real_tensors, move_schedulers, timing_sink
from ._front import EngineOptimizer, Front, torch_optimizer
from ._private import is_prepared, track

__all__ = ["EngineFront", "Slot", "ZeroOptimizerWrapper"]


class ZeroOptimizerWrapper(EngineOptimizer):
    """``step()`` runs the pending engine step. ``zero_grad()``: with one model a no-op (the
    engine zeroes gradients after every step); with several, at an accumulation boundary it
    zeroes the engine's gradients, as Accelerate's optimizer does (see [Note: several models])."""

    engine: ZeroEngine

    def __init__(self, slot: Slot, front: EngineFront) -> None:
        super().__init__(slot.engine)
        self.slot = slot
        self.front = front

    def step(self, closure: object = None) -> None:
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported by ZeroAccelerator: the engine steps "
                "once per accumulation boundary; compute the loss before calling step()"
            )
        if not self.slot.step_pending or not self.front.acc.sync_gradients:
            return  # as Accelerate's optimizer, which steps at a boundary only
        self.engine.set_gradient_accumulation_boundary(True)
        before = self.engine.skipped_steps
        try:
            self.engine.step()
        finally:
            self.slot.step_pending = False
        self.skipped = self.engine.skipped_steps != before

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.front.several and self.front.acc.sync_gradients:
            self.engine.zero_grad()


@dataclass(eq=False)
class Slot:
    """One prepared model: its engine, and for a trained one its optimizer wrapper and whether
    a boundary backward left its step pending (see the module note)."""

    engine: ZeroEngine
    wrapper: ZeroOptimizerWrapper | None = None  # None: frozen, sharded for evaluation
    user_optimizer: weakref.ref[Any] | None = None
    step_pending: bool = False

    def steps(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` is this model's: the user's, its wrapper, or the engine's."""
        mine = (self.user_optimizer and self.user_optimizer(), self.wrapper, self.engine.optimizer)
        return optimizer is not None and any(optimizer is o for o in mine)


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
        self.slots: list[Slot] = []

    @property
    def zero_engine(self) -> ZeroEngine | None:
        return self.trained

    @property
    def several(self) -> bool:
        """Whether more than one trained model was prepared (see [Note: several models])."""
        return len(self._trained_slots()) > 1

    def _trained_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.wrapper is not None]

    def slot_of(self, model: Any) -> Slot | None:
        for slot in self.slots:
            if any(model is m for m in (slot.engine, slot.engine.module)):
                return slot
        return None

    def engine_of(self, model: Any) -> ZeroEngine | None:
        slot = self.slot_of(model)
        return slot.engine if slot is not None else None

    def owns_optimizer(self, optimizer: Any) -> bool:
        return any(optimizer is s.wrapper for s in self.slots if s.wrapper is not None)

    def prepare_loader(self, loader: DataLoader) -> Any:
        if loader.batch_size is not None:
            split = (
                self.acc.num_processes // self.tensor_parallel_size if self.acc.split_batches else 1
            )
            self.batch_sizes.append(loader.batch_size // split)
        return self.acc.prepare_data_loader(loader)

    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module) and not isinstance(obj, ZeroEngine)

    def pair_up(
        self, args: tuple[Any, ...], models: list[int], opts: list[int], scheds: list[int]
    ) -> list[tuple[int, int | None]]:
        """Each optimizer with the model holding its parameters; a model without one must be
        frozen (see [Note: several models])."""
        if len(models) == 1 and len(opts) == 1 and not self.slots:
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
        slot = Slot(engine, user_optimizer=weakref.ref(user_opt))
        slot.wrapper = ZeroOptimizerWrapper(slot, self)
        self.slots.append(slot)
        if self.trained is None:
            self.trained = self.model = engine
        for s in self._trained_slots():  # see [Note: several models]
            s.engine.keep_foreign_grads = self.several
        return engine, slot.wrapper, self.register(engine, slot.wrapper, engine.lr_scheduler)

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
        self.slots.append(Slot(engine))
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
        slot = next((s for s in self._trained_slots() if s.steps(bound)), None)
        if slot is None:
            if not self._trained_slots():
                raise ValueError(
                    "prepare the model and optimizer before (or together with) the lr scheduler"
                )
            raise ValueError(
                "the lr scheduler is built on an optimizer this ZeroAccelerator did not prepare; "
                "build it on the optimizer passed to (or returned by) prepare()"
            )
        move_schedulers(slot.engine, [scheduler])
        out = AcceleratedScheduler(
            scheduler,
            slot.wrapper,
            step_with_optimizer=self.acc.step_scheduler_with_optimizer,
            split_batches=self.acc.split_batches,
        )
        track(self.acc, "scheduler", out)
        return out

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        trained = self._trained_slots()
        if not trained:
            return Accelerator.backward(self.acc, loss, **kwargs)
        unknown = sorted(set(kwargs) - {"retain_graph"})
        if unknown:
            raise TypeError(f"ZeroAccelerator.backward does not support {', '.join(unknown)}")
        boundary = self.acc.sync_gradients
        for slot in trained:
            # Accelerate's setter may change the steps after prepare(); its value divides the loss
            slot.engine.gradient_accumulation_steps = self.acc.gradient_accumulation_steps
        engines, retain = [s.engine for s in trained], bool(kwargs.get("retain_graph", False))
        reached_by = backward_of_models(loss, engines, boundary, retain)
        for slot, reached in zip(trained, reached_by, strict=True):
            if boundary and reached:
                slot.step_pending = True
            elif not boundary and reached and not slot.step_pending:
                slot.engine.step()  # not a boundary: only counts the micro-step

    def check_accumulate(self) -> None:
        """Accelerate's ``accumulate()`` drives the engine's boundaries (see the module note)."""

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        slot = self.slot_of(model)
        if slot is None or slot.wrapper is None:
            with Accelerator.no_sync(self.acc, model):
                yield
            return
        engine = slot.engine
        # Stages 2/3 reduce every backward into the gradient shards: skipping that would hold
        # full-size unreduced gradients, as Accelerate's DeepSpeed integration also avoids.
        with engine.no_sync() if engine.stage < 2 else contextlib.nullcontext():
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        trained = self._trained_slots()
        if not trained:
            return Accelerator.clip_grad_norm_(self.acc, parameters, max_norm, norm_type)
        engines = [s.engine for s in trained]
        slot = trained[clipped_engine(engines, parameters, max_norm, norm_type)]
        if not slot.step_pending:
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
        return torch.tensor(slot.engine.clip_grad_norm_(float(max_norm)), device=self.acc.device)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self.trained is None:
            return Accelerator.clip_grad_value_(self.acc, parameters, clip_value)
        raise RuntimeError(norm_only("clip_grad_value_", "accelerator.clip_grad_norm_"))

    def engines(self) -> dict[str, ZeroEngine]:  # type: ignore[override]
        return {f"model_{i}": s.engine for i, s in enumerate(self.slots)}

    def load_state(self, input_dir: str | None, trust_checkpoint: bool) -> None:
        for slot in self.slots:
            slot.step_pending = False
        super().load_state(input_dir, trust_checkpoint)

    def free(self) -> None:
        super().free()
        self.slots = []
