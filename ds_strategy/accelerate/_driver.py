"""Accelerate's training loop run on a :class:`~ds_strategy.ZeroEngine`.

[Note: who decides the accumulation boundary]
Accelerate (``accelerator.sync_gradients``: every k-th batch inside ``accumulate()``, and at
the end of a dataloader), not the engine's step count: before every backward the driver
hands its decision to ``engine.set_gradient_accumulation_boundary``, as Accelerate's
DeepSpeed integration does. A boundary backward leaves the optimizer step pending, so
``clip_grad_norm_`` (the engine's: it finishes the reduction and clips the shards) and then
``optimizer.step()`` keep the order and meaning of plain Accelerate.
"""

from __future__ import annotations

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from ..core import ZeroEngine

__all__ = ["EngineDriver", "EngineSchedulerWrapper", "ZeroOptimizerWrapper"]


class EngineDriver:
    """The engine under Accelerate's loop: whether a boundary backward is waiting for its
    optimizer step (see the notes above), and whether the last step was skipped."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self.step_pending = False
        self.step_was_skipped = False

    def backward(
        self, loss: torch.Tensor, *, boundary: bool, accumulation_steps: int, retain_graph: bool
    ) -> None:
        engine = self.engine
        # Accelerate's setter may change the steps after prepare(); its value divides the loss.
        engine.gradient_accumulation_steps = accumulation_steps
        engine.set_gradient_accumulation_boundary(boundary)  # stages 0/1 reduce only then
        engine.backward(loss, retain_graph=retain_graph)
        if boundary:
            self.step_pending = True
        elif not self.step_pending:
            engine.step()  # not a boundary: only counts the micro-step

    def step(self) -> None:
        """Run the pending optimizer step."""
        engine = self.engine
        skipped_before = engine.skipped_steps
        engine.set_gradient_accumulation_boundary(True)
        try:
            engine.step()
        finally:
            self.step_pending = False
        self.step_was_skipped = engine.skipped_steps != skipped_before


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
