"""``csv_monitor``: one CSV file per event name, as DeepSpeed's ``csvMonitor`` writes them."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path

from .base import Event, Monitor

__all__ = ["CSVMonitor", "csv_file_name"]


def csv_file_name(name: str) -> str:
    """DeepSpeed's file name for an event: ``Train/Samples/lr`` -> ``Train_Samples_lr.csv``."""
    return name.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor(Monitor):
    """Appends ``step,value`` rows to ``<output_path>/<job_name>/<name>.csv``; a new file
    starts with the header ``step,<last part of the name>`` (DeepSpeed's columns). A file that
    already exists (a resumed run) is appended to without a second header. Each write opens
    and closes its files, so nothing is lost if the process dies.

    >>> import tempfile
    >>> m = CSVMonitor(tempfile.mkdtemp(), "job")
    >>> m.write_events([Event("Train/Samples/lr", 0.1, 8)])
    >>> (m.log_dir / "Train_Samples_lr.csv").read_text().split()
    ['step,lr', '8,0.1']
    """

    def __init__(self, output_path: str | os.PathLike, job_name: str) -> None:
        self.log_dir = Path(output_path or ".", job_name)

    def write_events(self, events: Sequence[Event]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for event in events:
            path = self.log_dir / csv_file_name(event.name)
            new = not path.exists() or path.stat().st_size == 0
            with path.open("a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", event.name.rsplit("/", 1)[-1]])
                writer.writerow([event.step, event.value])
