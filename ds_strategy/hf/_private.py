"""Every use of ``transformers.Trainer``'s private API, in one place. Checked against
transformers 5.25.0 (the ``hf`` extra allows ``>=5.24,<6``). A transformers that renames them
breaks here, and only here.

The Trainer has no public hook for what a sharded engine changes: the arguments it builds its
Accelerator from, what a checkpoint holds instead of ``optimizer.pt``, how the best model is
loaded at the end; nor a public way to write a given state dict as ``save_pretrained`` does, or
to keep a scheduler it did not create from being rebuilt on the next ``train()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TrainerHooks", "save_pretrained_state", "scheduler_is_rebuilt"]


class TrainerHooks:
    """Mixed in before ``transformers.Trainer``: the private methods the ZeRO trainer changes,
    each handing over to a public method of the subclass (which returns False to leave it to
    the Trainer)."""

    accelerator_args: dict[str, Any]

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        self.accelerator_args = dict(built)
        return built

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
