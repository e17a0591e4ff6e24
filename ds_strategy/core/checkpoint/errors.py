"""The error a checkpoint that cannot be loaded raises: its own module, so that every reader
(the metadata unpickler in ``trust.py`` as much as the checks in ``validate.py``) raises it
without importing the others."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint is damaged, incomplete or does not belong to this model."""


CheckpointError.__module__ = "ds_strategy"
