"""Accelerate's training loop run on a :class:`~ds_strategy.ZeroEngine`.

[Note: who decides the accumulation boundary]
Accelerate decides when gradients are synchronised (``accelerator.sync_gradients``: every
``gradient_accumulation_steps``-th batch inside ``accumulate()``, and always at the end of a
dataloader); the engine decides by counting ``step()`` calls. They disagree at the end of an
epoch whose length is not a multiple of the accumulation steps, and in a loop that never
enters ``accumulate()``. :class:`AcceleratedEngine` therefore takes the boundary from Accelerate,
the way Accelerate's DeepSpeed integration calls ``set_gradient_accumulation_boundary``.

[Note: where the optimizer step runs]
The engine finishes the gradient reduction, takes the global norm, clips and steps in one
``step()``. A plain loop calls ``accelerator.clip_grad_norm_(params, max_norm)`` *before*
``optimizer.step()`` and expects the norm back and the gradients clipped by ``max_norm``; the
engine offers no way to clip the sharded gradients without stepping. So at a boundary,
``clip_grad_norm_`` runs the engine's step with ``gradient_clipping = max_norm`` for that one
step and returns the norm it computed; the following ``optimizer.step()`` finds nothing left
to do. Without a ``clip_grad_norm_`` call, ``optimizer.step()`` runs it (clipping by the
config's ``gradient_clipping``). Numerically identical to torch's ``clip_grad_norm_``
followed by ``optimizer.step()``; the one visible difference is that gradients are already
applied (and zeroed) when ``clip_grad_norm_`` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from ..core import ZeroEngine

__all__ = [
    "AcceleratedEngine",
    "EngineDriver",
    "EngineSchedulerWrapper",
    "ZeroOptimizerWrapper",
    "track_optimizer_step",
]


class AcceleratedEngine(ZeroEngine):
    """A :class:`ZeroEngine` whose accumulation boundary is set from outside (see the note)."""

    # A class attribute, so it exists while ZeroEngine.__init__ builds the gradient hooks.
    accumulation_boundary: bool = True

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.accumulation_boundary


class EngineDriver:
    """The state Accelerate's loop needs on top of the engine: whether a boundary backward is
    waiting for its optimizer step, and whether the last step was skipped."""

    def __init__(self, engine: AcceleratedEngine) -> None:
        self.engine = engine
        self.step_pending = False
        self.step_was_skipped = False

    def backward(
        self, loss: torch.Tensor, *, boundary: bool, accumulation_steps: int, retain_graph: bool
    ) -> None:
        engine = self.engine
        # Accelerate's setter may change the steps after prepare(); its value divides the loss.
        engine.gradient_accumulation_steps = accumulation_steps
        engine.accumulation_boundary = boundary  # stages 0/1 reduce only in a boundary backward
        engine.backward(loss, retain_graph=retain_graph)
        if boundary:
            self.step_pending = True
        elif not self.step_pending:
            engine.step()  # not a boundary: only counts the micro-step

    def step(self, max_norm: float | None = None) -> float | None:
        """Run the pending optimizer step (clipping by ``max_norm`` if given); returns the
        global gradient norm before clipping."""
        engine = self.engine
        skipped_before = getattr(engine, "skipped_steps", 0)  # set once fp16 loss scaling exists
        config = engine.config
        if max_norm is not None:
            engine.config = dataclasses.replace(config, gradient_clipping=max_norm)
        engine.accumulation_boundary = True
        try:
            engine.step()
        finally:
            engine.config = config
            self.step_pending = False
        self.step_was_skipped = getattr(engine, "skipped_steps", 0) != skipped_before
        return engine.get_global_grad_norm()


class ZeroOptimizerWrapper(AcceleratedOptimizer):
    """What ``prepare`` returns for the optimizer: the engine's rebuilt optimizer (this rank's
    shards), stepped through the engine.

    ``step()`` runs the engine's step at an accumulation boundary, ``zero_grad()`` is a no-op
    because the engine zeroes gradients after every step (as in Accelerate's DeepSpeed
    integration), and ``state_dict()`` holds only this rank's shard of the optimizer state:
    use ``accelerator.save_state`` for a checkpoint.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, driver: EngineDriver) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.driver = driver

    def step(self, closure: object = None) -> None:
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported by ZeroAccelerator: the engine steps "
                "once per accumulation boundary; compute the loss before calling step()"
            )
        if self.driver.step_pending:
            self.driver.step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass  # the engine zeroed the gradients at the end of its step

    @property
    def step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow)."""
        return self.driver.step_was_skipped


class EngineSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine owns and steps (from ``DummyScheduler(lr_scheduler_callable=...)``);
    ``step()`` is a no-op, as for Accelerate's ``DeepSpeedSchedulerWrapper``."""

    def step(self, *args: object, **kwargs: object) -> None:
        pass


def track_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way ``LRScheduler`` does when it is built, for a scheduler
    moved onto the engine's rebuilt optimizer: otherwise its first ``step()`` warns that the
    optimizer never stepped."""
    step: Any = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    def wrapper(*args: object, **kwargs: object) -> object:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign,assignment]
