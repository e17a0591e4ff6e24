"""Every use of ``transformers.Trainer``'s private API, in one place. Checked against
transformers 5.25.0 (the ``hf`` extra allows ``>=5.24,<5.26``). A transformers that renames them
breaks here, and only here.

The Trainer has no public hook for what a sharded engine changes: the arguments it builds its
Accelerator from, what a checkpoint holds instead of ``optimizer.pt``, how the best model is
loaded at the end; nor a public way to write a given state dict as ``save_pretrained`` does, or
to keep a scheduler it did not create from being rebuilt on the next ``train()``.

[Note: the one hook on transformers]
``import ds_strategy.hf`` wraps ``Trainer.create_accelerator_and_postprocess`` once, so that a
Trainer that is not a ``ZeroTrainer`` first checks that no ``DS_STRATEGY_*`` variable asks for
the ZeRO engine it would not use (``ds_strategy.hf._unhonoured``). It is the only method every
Trainer calls before it builds its Accelerator. It is installed only on the transformers range
below, where that is checked; elsewhere a warning says the check is off.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

__all__ = [
    "TrainerHooks",
    "install_accelerator_check",
    "save_pretrained_state",
    "scheduler_is_rebuilt",
]

CHECKED_TRANSFORMERS = ("5.24", "5.26")  # the hook's range: >= first, < second (the hf extra)


class TrainerHooks:
    """Mixed in before ``transformers.Trainer``: the private methods the ZeRO trainer changes,
    each handing over to a public method of the subclass (which returns False to leave it to
    the Trainer)."""

    accelerator_args: dict[str, Any]

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        self.accelerator_args = dict(built)
        # the plain Accelerator the Trainer builds first (and the ZeRO one replaces) would
        # refuse a parallelism config off FSDP and DeepSpeed; the ZeRO one folds it into its
        # config
        return {k: v for k, v in built.items() if k != "parallelism_config"}

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        # a model built on the meta device (ds_strategy.hf.from_pretrained) has no storage to
        # move: the engine materialises it on its device
        if not any(p.is_meta for p in model.parameters()):
            super()._move_model_to_device(model, device)  # type: ignore[misc]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.save_engine_state(output_dir):  # type: ignore[attr-defined]
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.load_engine_state(checkpoint):  # type: ignore[attr-defined]
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]

    def _load_best_model(self) -> None:
        if not self.load_best_engine_state():  # type: ignore[attr-defined]
            super()._load_best_model()  # type: ignore[misc]


def save_pretrained_state(trainer: Any, output_dir: str, state: dict[str, Any]) -> None:
    """Write ``state`` as the Trainer writes its model (``save_pretrained``, safetensors) on the
    ranks that save."""
    trainer._save(output_dir, state_dict=state)


def scheduler_is_rebuilt(trainer: Any) -> None:
    """Mark the Trainer's lr scheduler as its own creation, which the next ``train()`` drops
    and builds again (for the new run's step count)."""
    trainer._created_lr_scheduler = True


def install_accelerator_check(check: Callable[[Any], None]) -> None:
    """Make every ``Trainer`` call ``check(trainer)`` before it builds its Accelerator (see the
    note on the one hook); installing again changes nothing."""
    import transformers
    from packaging.version import Version
    from transformers import Trainer

    from ..core.warnings import FrontEndWarning

    original = Trainer.create_accelerator_and_postprocess
    if getattr(original, "_ds_strategy_check", None) is not None:
        return
    low, high = (Version(v) for v in CHECKED_TRANSFORMERS)
    if not low <= Version(transformers.__version__) < high:
        warnings.warn(
            f"transformers {transformers.__version__} is outside the range ds_strategy.hf was "
            f"checked with (>={low},<{high}): a DS_STRATEGY_* variable that a plain Trainer "
            "would ignore is not detected; use ds_strategy.hf.zero(TrainerClass) or ZeroTrainer",
            FrontEndWarning,
            stacklevel=2,
        )
        return

    @functools.wraps(original)
    def create_accelerator_and_postprocess(self: Any) -> None:
        check(self)
        original(self)

    wrapped: Any = create_accelerator_and_postprocess
    wrapped._ds_strategy_check = check  # marks it installed
    Trainer.create_accelerator_and_postprocess = wrapped  # type: ignore[method-assign]
