"""What a training loop does around a :class:`~ds_strategy.core.pipeline.PipelineEngine`,
whichever framework drives it (Lightning's Trainer, Accelerate, a plain PyTorch loop): a batch
taken as ``(inputs, targets)``, run as a training or an evaluation step with the stage in the
matching mode, whether that step was skipped, the model a loop holds in its model's place, and
the calls of a plain loop that the schedule makes itself, refused with the reason and what to
write instead.

[Note: what the schedule does itself]
One ``train_batch`` runs forward and backward of ``gradient_accumulation_steps`` micro-batches,
reduces the gradients once, clips by the global norm across stages and steps the optimizer and
the lr scheduler. A loop's own ``backward``, accumulation window, ``no_sync``, clip, scheduler
step or forward would do that work a second time, or on one stage only, so a front end refuses
them: :data:`SCHEDULE_DOES` says why, keyed by the call, and each front end adds its fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from torch import Tensor, nn

from ..training import TrainingEngine

__all__ = [
    "LOOP",
    "SCHEDULE_DOES",
    "PipelineLoop",
    "PipelineModel",
    "PipelineSteps",
    "refusing",
    "schedule_does",
    "split_batch",
]

LOOP = "loss = model.train_batch(inputs, targets)"  # what a pipeline loop writes

SCHEDULE_DOES = {
    "backward": "the loss is computed and back-propagated inside the schedule",
    "accumulate": "train_batch runs gradient_accumulation_steps micro-batches itself",
    "no_sync": "train_batch reduces gradients once per step itself",
    "clip_grad_norm_": "train_batch clips by the global norm across stages",
    "clip_grad_value_": "train_batch clips by the global norm only",
    "scheduler": "the engine steps the lr scheduler inside train_batch",
    "step": f"`{LOOP}` steps the optimizer",
    "forward": "each rank holds one stage, so the model is not called directly",
    "predict": "the pipeline returns losses, not outputs",
}


def schedule_does(call: str, does: str, fix: str = "") -> str:
    """The error of ``call`` under a pipeline config: the schedule does ``does`` itself
    (a key of :data:`SCHEDULE_DOES`); then ``fix``.

    >>> schedule_does("no_sync()", "no_sync", "drop it")
    'no_sync(): under a pipeline config train_batch reduces gradients once per step itself; drop it'
    """
    return f"{call}: under a pipeline config {SCHEDULE_DOES[does]}" + (f"; {fix}" if fix else "")


def refusing(call: str, does: str, fix: str) -> Callable[..., NoReturn]:
    """A method raising :func:`schedule_does`'s error as a ``RuntimeError``, whatever its
    arguments: a front end's hook for a call the schedule makes itself."""

    def refuse(self: object, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(schedule_does(call, does, fix))

    return refuse


def split_batch(batch: object, where: str) -> tuple[Any, Any]:  # the user's own values
    """A loop's batch as the ``(inputs, targets)`` that :meth:`PipelineEngine.train_batch`
    takes, or an error naming ``where`` it came from."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"{where}: under a pipeline config each batch must be (inputs, targets); got "
        f"{type(batch).__name__}"
    )


class PipelineSteps(TrainingEngine, Protocol):
    """What :class:`PipelineLoop` asks of a pipeline (a :class:`PipelineEngine`)."""

    @property
    def skipped_steps(self) -> int: ...

    # inputs: the first stage's input; targets: the last stage's (None on the other stages)
    def train_batch(
        self, inputs: Tensor | None = None, targets: Tensor | None = None
    ) -> Tensor: ...

    def eval_batch(self, inputs: Tensor | None = None, targets: Tensor | None = None) -> Tensor: ...


class PipelineLoop:
    """A loop's steps on ``engine`` (a :class:`PipelineEngine`, or anything with its
    ``module``, ``train_batch``, ``eval_batch`` and ``skipped_steps``)::

        loop = PipelineLoop(engine)
        loss = loop.run_batch("train", (x, y))  # one optimizer step
        loop.step_was_skipped                   # an fp16 overflow, a non-finite norm
        loss = loop.run_batch("val", (x, y))    # the mean loss, no step
    """

    def __init__(self, engine: PipelineSteps) -> None:
        self.engine = engine
        self.step_was_skipped = False  # by the last training step

    def run(
        self, train: bool, inputs: Tensor | None = None, targets: Tensor | None = None
    ) -> Tensor:
        """``train_batch`` with the stage in training mode, or ``eval_batch`` in evaluation
        mode; the global batch's mean loss on every rank (collective)."""
        engine = self.engine
        engine.module.train(train)
        if not train:
            return engine.eval_batch(inputs, targets)
        before = engine.skipped_steps
        loss = engine.train_batch(inputs, targets)
        self.step_was_skipped = engine.skipped_steps != before
        return loss

    def run_batch(self, kind: str, batch: object) -> Tensor:
        """:meth:`run` on a loop's ``(inputs, targets)`` batch: a training step for ``kind``
        ``"train"``, else an evaluation step (``kind`` names the batch in errors)."""
        inputs, targets = split_batch(batch, f"{kind} batch")
        return self.run(kind == "train", inputs, targets)


class PipelineModel(nn.Module):
    """What a loop holds in its model's place (Accelerate's ``prepare`` returns it):
    ``train_batch`` / ``eval_batch(inputs, targets)`` run :class:`PipelineLoop`'s steps and
    return the global batch's mean loss on every rank (collective). ``module`` is this rank's
    stage; ``engine`` the pipeline, whose attributes this model answers too. Calling the model
    is refused, ``fix`` saying what to write instead."""

    def __init__(self, engine: PipelineSteps, fix: str) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine
        self.loop = PipelineLoop(engine)
        self.fix = fix

    def __getattr__(self, name: str) -> Any:  # the pipeline's attribute, whatever it is
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "engine":  # not set yet (construction, unpickling)
                raise
            return getattr(self.engine, name)

    def train_batch(self, inputs: Tensor | None = None, targets: Tensor | None = None) -> Tensor:
        return self.loop.run(True, inputs, targets)

    def eval_batch(self, inputs: Tensor | None = None, targets: Tensor | None = None) -> Tensor:
        return self.loop.run(False, inputs, targets)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``train_batch`` skipped its step (an fp16 overflow, a non-finite
        norm)."""
        return self.loop.step_was_skipped

    def forward(self, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(schedule_does("model(...)", "forward", self.fix))
