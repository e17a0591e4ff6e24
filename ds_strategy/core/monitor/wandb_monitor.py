"""``wandb``: the events as W&B metrics, in a run of their own or in the one already active."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from .base import Event, Monitor, import_package

__all__ = ["SAMPLES_METRIC", "WandbMonitor"]

# the x axis of the events in a run whose own step belongs to someone else
SAMPLES_METRIC = "Train/Samples/global_samples"


class WandbMonitor(Monitor):
    """Logs each write's events at ``step=global_samples`` in a run started with the
    section's ``project``, ``group`` and ``team`` (W&B's entity), as DeepSpeed does.

    When a run is already active in this process (a Lightning ``WandbLogger``, Accelerate's
    or the HF Trainer's W&B tracker started it), no second run is started: the events go into
    that run, plotted against ``Train/Samples/global_samples`` (W&B's ``define_metric``)
    instead of the run's own step, which the framework advances and W&B refuses to see go
    back. The monitor is then :attr:`shared`, and the engine leaves out the timings the
    framework's loggers receive already (``wall_clock/*``)."""

    def __init__(
        self, project: str, group: str | None = None, team: str | None = None, **init: object
    ) -> None:
        wandb = import_package("wandb", "wandb", "wandb")
        self.shared = wandb.run is not None
        if self.shared:
            self.run = wandb.run
            self.run.define_metric(SAMPLES_METRIC)
            self.run.define_metric("Train/Samples/*", step_metric=SAMPLES_METRIC)
        else:
            self.run = wandb.init(project=project, group=group, entity=team, **init)
        self._owned = not self.shared

    def write_events(self, events: Sequence[Event]) -> None:
        for step, same in groupby(events, key=lambda e: e.step):
            values = {e.name: e.value for e in same}
            if self.shared:
                self.run.log({**values, SAMPLES_METRIC: step})
            else:
                self.run.log(values, step=step)

    def close(self) -> None:
        if self._owned:
            self.run.finish()
            self._owned = False
