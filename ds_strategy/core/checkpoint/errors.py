"""The error a checkpoint that cannot be loaded raises, and the first failing rank's error in
DCP's gathered ones: their own module, so that every reader (the metadata unpickler in
``trust.py`` as much as the checks in ``validate.py``) and the writer (``store.py``) use them
without importing one another."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["CheckpointError", "first_failure", "not_a_checkpoint"]

# what save_pretrained writes beside config.json
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class CheckpointError(ValueError):
    """A checkpoint is damaged, incomplete or does not belong to this model."""


CheckpointError.__module__ = "ds_strategy"


def first_failure(e: BaseException, rank: int) -> tuple[int, BaseException]:
    """(rank, exception) of the first failing rank in DCP's gathered failures (a
    ``CheckpointException``); ``(rank, e)`` for any other error."""
    if isinstance(e, CheckpointException) and e.failures:
        first = min(e.failures)
        cause = e.failures[first]
        return first, cause[0] if isinstance(cause, tuple) else cause
    return rank, e


def not_a_checkpoint(path: Path, meta_file: str) -> CheckpointError:
    """The error for a directory without ``meta_file``, pointing a model directory as
    ``save_pretrained`` writes it to ``load_weights``."""
    message = (
        f"{path}: not a ds_strategy checkpoint ({meta_file} is missing; an interrupted save "
        f"leaves only '{path.name}.tmp', which is never loaded)"
    )
    if any((path / name).is_file() for name in _WEIGHTS):
        message += (
            "; it holds a model's weights as save_pretrained writes them: read them into the "
            "engine with engine.load_weights(path)"
        )
    return CheckpointError(message)
