"""What every monitor is: a writer of ``(name, value, step)`` events, on rank 0.

[Note: DeepSpeed's event model]
DeepSpeed's engine hands its monitors lists of ``(name, value, global_samples)`` tuples, named
``Train/Samples/<what>`` and plotted against the samples seen so far (optimizer steps times
``train_batch_size``), and each monitor writes them its own way: TensorBoard scalars, one CSV
file per name, W&B or Comet metrics. The writers here take the same events, so files written
here read like DeepSpeed's and the other way round. Which events exist and when they are
written is ``events.py``'s business; a writer only writes.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

__all__ = ["Event", "Monitor", "require_package"]


class Event(NamedTuple):
    """One scalar: its DeepSpeed name (``Train/Samples/train_loss``), value and x value
    (global samples)."""

    name: str
    value: float
    step: int


class Monitor(ABC):
    """A destination for events. ``shared`` is true when it writes into a run that something
    else in the process started (a training framework's W&B logger), whose own logs may
    already hold some of the same numbers."""

    shared: bool = False

    @abstractmethod
    def write_events(self, events: Sequence[Event]) -> None:
        """Write ``events`` (in order); called on rank 0 only."""

    def close(self) -> None:  # noqa: B027 - optional: most writers hold nothing open
        """Flush and release what the monitor holds open."""


def require_package(section: str, module: str, install: str) -> None:
    """Raise ``ImportError`` naming the config section and what to install when ``module`` is
    not importable. Checked on every rank, so that no rank goes on alone into a collective
    while rank 0 fails."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{section}.enabled is true in the config, but the {module} package is not "
            f"installed: pip install {install} (or set {section}.enabled to false)"
        )


def import_package(section: str, module: str, install: str) -> ModuleType:
    """``module`` imported, after :func:`require_package`."""
    require_package(section, module, install)
    return importlib.import_module(module)
