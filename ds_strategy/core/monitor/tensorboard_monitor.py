"""``tensorboard``: the events as TensorBoard scalars, through torch's ``SummaryWriter``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .base import Event, Monitor, require_package

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["INSTALL", "TensorBoardMonitor"]

INSTALL = "'ds_strategy[monitor]' (or tensorboard)"


class TensorBoardMonitor(Monitor):
    """Scalars tagged with the event names in ``<output_path>/<job_name>/`` (DeepSpeed's
    directory), flushed after every write. The event file is created at the first write, so
    a run that never reaches ``steps_per_print`` leaves no empty one.

    >>> import tempfile
    >>> m = TensorBoardMonitor(tempfile.mkdtemp(), "job")
    >>> m.write_events([Event("Train/Samples/lr", 0.1, 8)]); m.close()
    >>> len(list(m.log_dir.glob("events.out.tfevents.*")))
    1
    """

    def __init__(self, output_path: str | os.PathLike, job_name: str) -> None:
        require_package("tensorboard", "tensorboard", INSTALL)
        self.log_dir = Path(output_path or ".", job_name)
        self._writer: SummaryWriter | None = None

    def write_events(self, events: Sequence[Event]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        for event in events:
            self._writer.add_scalar(event.name, event.value, event.step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
