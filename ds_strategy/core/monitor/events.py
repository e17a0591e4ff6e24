"""The training events an engine writes to the config's monitors, and when.

[Note: which events, measured how]
Every ``steps_per_print`` optimizer steps, at x = global samples (optimizer steps times
``train_batch_size``, DeepSpeed's x axis; the steps alone, with a warning, when the config
gives no batch size), rank 0 writes:

- ``Train/Samples/train_loss``: the mean of the losses passed to ``engine.backward`` during
  that step, over its micro-batches and the data-parallel ranks (one all-reduce of two
  numbers on the engine's group, every rank, at that step only; DeepSpeed logs rank 0's);
- ``Train/Samples/lr``: the first param group's learning rate after the step;
- ``Train/Samples/loss_scale``: with fp16, the loss scale after the step;
- with ``wall_clock_breakdown``, DeepSpeed's ``Train/Samples/elapsed_time_ms_<phase>``
  family from the engine's timers (``core/timers.py``), per-step means over the window:
  ``forward``, ``backward``, ``backward_inner`` (backward less the time blocked on gradient
  reductions inside it), ``backward_allreduce`` (all time blocked on gradient reductions,
  inside backward or at the step) and ``step``;
- ours: ``Train/Samples/model_state_bytes`` and ``peak_model_state_bytes`` (rank 0's
  ``memory_report()`` ``total`` and ``peak``), ``Train/Samples/sent_bytes`` (bytes rank 0
  sent per step, mean over the steps since the previous write, ``comm_report()``'s count) and
  the same split by link, ``sent_bytes_intra_machine`` and ``sent_bytes_inter_machine``.

Under a pipeline (``PipelineEngine``) the loss is the one ``train_batch`` returns (already
the global batch's mean), the memory is rank 0's stage's, the bytes sent include the
activations and gradients sent between stages, and the timings are ``elapsed_time_ms_schedule``
(the forward and backward of every micro-batch, which the schedule interleaves, so there is
no forward / backward split), ``backward_allreduce`` and ``step``.

A monitor that writes into a run a training framework started (``Monitor.shared``) gets no
timings when the engine's timers also feed the framework's loggers (a front end's timing
sink): the same numbers would otherwise reach the same run twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..collectives import Comm, world_rank
from ..timers import StepTimers
from .base import Event, Monitor, require_package
from .comet_monitor import CometMonitor
from .csv_monitor import CSVMonitor
from .tensorboard_monitor import INSTALL, TensorBoardMonitor
from .wandb_monitor import WandbMonitor

if TYPE_CHECKING:
    from ...config import ZeroConfig

__all__ = ["TIMING_EVENTS", "TrainingMonitor", "build_monitors", "engine_comms"]

log = logging.getLogger(__name__)


class _TensorParallel(Protocol):
    @property
    def comm(self) -> Comm: ...


class MonitoredEngine(Protocol):
    """What the monitor reads of a ``ZeroEngine``: its public surface, nothing more."""

    @property
    def global_steps(self) -> int: ...

    @property
    def loss_scale(self) -> float: ...

    @property
    def timers(self) -> StepTimers | None: ...

    @property
    def comm(self) -> Comm: ...

    @property
    def tensor_parallel(self) -> _TensorParallel | None: ...

    def get_lr(self) -> list[float]: ...

    def memory_report(self) -> dict[str, int]: ...


PREFIX = "Train/Samples/"
# DeepSpeed's timing event (without PREFIX and "elapsed_time_ms_") -> the timers' report key
TIMING_EVENTS = {
    "forward": "forward_ms",
    "backward": "backward_ms",
    "backward_inner": None,  # backward_ms - backward_reduce_ms
    "backward_allreduce": "reduce_ms",
    "step": "step_ms",
}
_PACKAGES = {
    "tensorboard": ("tensorboard", INSTALL),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml"),
}
# the comet section's keys that go to comet_ml.start as they are
_COMET_START = ("api_key", "project", "workspace", "experiment_key", "mode", "online")


def build_monitors(config: ZeroConfig, rank: int) -> list[Monitor]:
    """The writers of the config's enabled monitor sections: on ``rank`` 0 only (the others
    get ``[]``), after checking on every rank that their packages are installed."""
    enabled = [s for s in ("tensorboard", "csv_monitor", "wandb", "comet") if _on(config, s)]
    for section in enabled:
        if section in _PACKAGES:
            require_package(section, *_PACKAGES[section])
    if rank != 0:
        return []
    tb, csv_, wb, cm = config.tensorboard, config.csv_monitor, config.wandb, config.comet
    make = {
        "tensorboard": lambda: TensorBoardMonitor(tb.output_path, tb.job_name),
        "csv_monitor": lambda: CSVMonitor(csv_.output_path, csv_.job_name),
        "wandb": lambda: WandbMonitor(wb.project, wb.group, wb.team),
        "comet": lambda: CometMonitor(
            cm.samples_log_interval,
            cm.experiment_name,
            **{k: getattr(cm, k) for k in _COMET_START},
        ),
    }
    return [make[section]() for section in enabled]


def _on(config: ZeroConfig, section: str) -> bool:
    return getattr(config, section).enabled is True


class TrainingMonitor:
    """Collects one optimizer step's losses and writes the step's events to ``monitors``
    every ``steps_per_print`` steps (see the module note). Exists on every rank, since the
    loss is averaged over the ranks; only rank 0 holds writers."""

    def __init__(
        self,
        monitors: Sequence[Monitor],
        comm: Comm,
        device: torch.device,
        *,
        steps_per_print: int,
        train_batch_size: int,
        fp16: bool,
    ) -> None:
        self.monitors = list(monitors)
        self.comm = comm
        self.device = device
        self.steps_per_print = max(1, int(steps_per_print))
        self.train_batch_size = int(train_batch_size)
        self.fp16 = fp16
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._sent_seen: tuple[dict[str, int], int] = ({}, 0)  # (bytes sent, step) last written

    @classmethod
    def from_config(
        cls, config: ZeroConfig, comm: Comm, device: torch.device
    ) -> TrainingMonitor | None:
        """A monitor when one of the config's monitor sections is enabled, else None."""
        if not any(_on(config, s) for s in ("tensorboard", "csv_monitor", "wandb", "comet")):
            return None
        batch = config.train_batch_size
        if batch is None and world_rank() == 0:
            log.warning(
                "monitor: the config gives no batch size (train_batch_size or "
                "train_micro_batch_size_per_gpu), so the events' x axis counts optimizer "
                "steps, not samples"
            )
        return cls(
            build_monitors(config, world_rank()),
            comm,
            device,
            steps_per_print=config.report_every,
            train_batch_size=1 if batch is None else batch,
            fp16=config.fp16.enabled is True,
        )

    def add_loss(self, loss: torch.Tensor) -> None:
        """A loss passed to ``engine.backward`` (as given, before any scaling)."""
        value = loss.detach().float().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def after_step(
        self,
        engine: MonitoredEngine,
        loss: float | None = None,
        comms: Sequence[Comm] | None = None,
    ) -> None:
        """An optimizer step finished (``engine.global_steps`` counts it): write when due.
        ``loss``: the step's mean loss over every rank when the caller knows it (a pipeline),
        else the losses given to :meth:`add_loss` are averaged over the ranks; ``comms``: the
        groups whose bytes count as sent (default: the engine's, see :func:`engine_comms`)."""
        step = engine.global_steps
        if step % self.steps_per_print == 0:
            if loss is None:
                loss = self._reduced_loss()  # collective: every rank, at the same steps
            if self.monitors:
                sent = self._sent_per_step(engine_comms(engine) if comms is None else comms, step)
                self.write(self.events(engine, step, loss, sent), engine)
        self._loss_sum, self._loss_count = None, 0

    def _reduced_loss(self) -> float:
        both = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self._loss_sum is not None:
            both[0] = self._loss_sum.to(self.device, torch.float64)
            both[1] = self._loss_count
        self.comm.all_reduce(both, kind="control")
        total, count = both.tolist()
        return total / count if count else math.nan

    def events(
        self, engine: MonitoredEngine, step: int, loss: float, sent: dict[str, float] | None = None
    ) -> list[Event]:
        """This step's events (see the module note), read from the engine's public surface;
        ``sent``: the bytes-sent events (:meth:`_sent_per_step`), left out when None."""
        samples = step * self.train_batch_size
        values = {"train_loss": loss, "lr": float(engine.get_lr()[0])}
        if self.fp16:
            values["loss_scale"] = float(engine.loss_scale)
        report = engine.timers.last_report if engine.timers is not None else {}
        if report:
            for name, key in _timing_events(report).items():
                ms = report.get(key, 0.0) if key else _backward_inner(report)
                values[f"elapsed_time_ms_{name}"] = float(ms)
        memory = engine.memory_report()
        values["model_state_bytes"] = float(memory["total"])
        values["peak_model_state_bytes"] = float(memory["peak"])
        values.update(sent or {})
        return [Event(PREFIX + name, value, samples) for name, value in values.items()]

    def _sent_per_step(self, comms: Sequence[Comm], step: int) -> dict[str, float]:
        """``sent_bytes`` per step since the previous write, and the same by link
        (``sent_bytes_intra_machine`` / ``_inter_machine``, as ``comm_report()`` splits it)."""
        sent = {"sent_bytes": sum(sum(c.sent_total.values()) for c in comms)}
        for link in ("intra", "inter"):
            sent[f"sent_bytes_{link}_machine"] = sum(c.link_total.get(link, 0) for c in comms)
        last_sent, last_step = self._sent_seen
        self._sent_seen = (sent, step)
        steps = max(1, step - last_step)
        return {k: (v - last_sent.get(k, 0)) / steps for k, v in sent.items()}

    def write(self, events: list[Event], engine: MonitoredEngine) -> None:
        """Hand ``events`` to every writer (timings left out where a framework has them)."""
        timed_elsewhere = engine.timers is not None and bool(engine.timers.sinks)
        untimed = [e for e in events if "/elapsed_time_ms_" not in e.name]
        for monitor in self.monitors:
            monitor.write_events(untimed if monitor.shared and timed_elsewhere else events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()


def engine_comms(engine: MonitoredEngine) -> list[Comm]:
    """The groups a ``ZeroEngine``'s ``comm_report()`` counts: data-parallel and, with tensor
    parallelism, the tensor-parallel one."""
    comms = [engine.comm]
    if engine.tensor_parallel is not None:
        comms.append(engine.tensor_parallel.comm)
    return comms


def _timing_events(report: dict[str, float]) -> dict[str, str | None]:
    """The timing events of a timers' report: DeepSpeed's family, or under a pipeline (whose
    report has ``schedule_ms``) the schedule, the blocked reductions and the step."""
    if "schedule_ms" not in report:
        return TIMING_EVENTS
    return {"schedule": "schedule_ms", "backward_allreduce": "reduce_ms", "step": "step_ms"}


def _backward_inner(report: dict[str, float]) -> float:
    return max(0.0, report.get("backward_ms", 0.0) - report.get("backward_reduce_ms", 0.0))
