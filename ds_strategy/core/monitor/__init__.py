"""DeepSpeed's monitor sections (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``): the
engine's training events, written on rank 0 (``events.py``) by one writer per section."""

from __future__ import annotations

from .base import Event, Monitor
from .comet_monitor import CometMonitor
from .csv_monitor import CSVMonitor
from .events import TrainingMonitor, build_monitors
from .tensorboard_monitor import TensorBoardMonitor
from .wandb_monitor import WandbMonitor

__all__ = [
    "CSVMonitor",
    "CometMonitor",
    "Event",
    "Monitor",
    "TensorBoardMonitor",
    "TrainingMonitor",
    "WandbMonitor",
    "build_monitors",
]
