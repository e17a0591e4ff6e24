"""``comet``: the events as Comet metrics, at most once per ``samples_log_interval``."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Event, Monitor, import_package

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    """An experiment from ``comet_ml.start`` with the section's keys (unset ones are left to
    Comet's config file and environment: ``COMET_API_KEY``, ``COMET_PROJECT_NAME``, ...).
    As DeepSpeed's Comet monitor, an event is logged when its name is new or when at least
    ``samples_log_interval`` samples have passed since it was last logged."""

    def __init__(
        self,
        samples_log_interval: int = 100,
        experiment_name: str | None = None,
        **start: object,
    ) -> None:
        comet_ml = import_package("comet", "comet_ml", "comet_ml")
        self.samples_log_interval = samples_log_interval
        self.experiment = comet_ml.start(**start)
        if experiment_name is not None:
            self.experiment.set_name(experiment_name)
        self._last: dict[str, int] = {}

    def due(self, name: str, samples: int) -> bool:
        """Whether ``name`` is logged at ``samples`` (and, if so, remember it was)."""
        last = self._last.get(name)
        if last is not None and samples - last < self.samples_log_interval:
            return False
        self._last[name] = samples
        return True

    def write_events(self, events: Sequence[Event]) -> None:
        for event in events:
            if self.due(event.name, event.step):
                self.experiment.log_metric(event.name, event.value, step=event.step)

    def close(self) -> None:
        self.experiment.end()
