"""``wall_clock_breakdown``: where each training step's time goes, and the bytes it moved.

[Note: what the phases measure]
``forward``, ``backward`` and ``step`` are wall-clock intervals around ``engine(batch)``,
``engine.backward(loss)`` and the optimizer step (gradient reduction finished, clipping,
optimizer, post-step gather), summed over the micro-steps of one optimizer step.
``reduce`` and ``gather`` are the time this rank spent *blocked* on gradient reductions
(all-reduce / reduce-scatter) and parameter all-gathers: ``Comm`` times every wait on an
in-flight collective and every synchronous one. Communication that overlapped computation
costs nothing here, so ``reduce`` and ``gather`` lie inside the other three phases; they
are the exposed communication, not extra time (``backward_reduce``: the part of
``reduce`` blocked inside ``backward``). ``intra_machine`` and ``inter_machine`` split
all blocked collective time (and the bytes, ``*_machine_bytes``) by the link of the group it
ran on (see [Note: byte accounting] in ``collectives.py``). Bytes are what this rank sent, per
kind, counted by ``Comm``.

Under a pipeline config there is no ``engine(batch)`` / ``engine.backward`` per micro-batch:
the schedule interleaves the forward and backward of every micro-batch with the transfers
between stages, so that whole interval is one phase, ``schedule`` (in the report only when
measured); ``step`` is then the tied-weight sum, the gradient reduction, the norm exchanged
between stages and the stage engine's optimizer step.

The line is a report of the ``ds_strategy.core.timers`` logger on rank 0: printed on stdout
when the application configures no logging, else an INFO record its handlers get (see
``ds_strategy/_logging.py``); a loop that owns the terminal sets ``engine.timers.printer``
instead (``tqdm.write`` keeps a progress bar
intact), and front ends also receive every report through ``add_sink``.

On CUDA the phase boundaries synchronise the device, so the times are the GPU's; that costs
a little overlap, which is why the breakdown is off by default. Disabled, the engine holds
no ``StepTimers`` and a phase is a shared ``nullcontext``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from .._logging import report
from .collectives import Comm
from .profiling.ranges import profiling, range_name, record_function

if TYPE_CHECKING:
    from ..config import ZeroConfig

__all__ = ["OPTIONAL_PHASES", "PHASES", "StepTimers", "format_report", "phase"]

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "reduce", "gather", "step")
# reported only by the engines that measure them: a pipeline's forward + backward of all
# micro-batches (see the note above)
OPTIONAL_PHASES = ("schedule",)
# Comm's byte kinds -> the phase whose blocked time they show up in.
WAIT_KIND = {
    "all_reduce": "reduce",
    "reduce_scatter": "reduce",
    "qgz": "reduce",  # ZeRO++'s quantized gradient reduce-scatters
    "all_gather": "gather",
    "qwz": "gather",  # ZeRO++'s quantized parameter all-gathers
    "broadcast": "gather",
}
Sink = Callable[[dict[str, float], int], None]

_NULL = contextlib.nullcontext()


def _log_line(line: str) -> None:
    """``StepTimers``' default printer: the line as a report of this module's logger (shown
    without any logging set up; see ``ds_strategy/_logging.py``)."""
    report(log, line)


def phase(timers: StepTimers | None, name: str) -> contextlib.AbstractContextManager[None]:
    """``timers.phase(name)``, or a no-op when the breakdown is off; while a profiler records,
    inside the range ``ds_strategy::<name>`` too (``step``: ``::optimizer_step``; see
    ``core/profiling/ranges.py``)."""
    if profiling():
        return _ranged(timers, name)
    return _NULL if timers is None else timers.phase(name)


@contextlib.contextmanager
def _ranged(timers: StepTimers | None, name: str) -> Iterator[None]:
    with record_function(range_name(name)), _NULL if timers is None else timers.phase(name):
        yield


class StepTimers:
    """Accumulates phase times and bytes per optimizer step; every ``steps_per_print`` steps
    turns the window into a report (per-step means), hands its line to ``printer`` on rank 0
    (by default a report of the ``ds_strategy.core.timers`` logger; any
    ``Callable[[str], None]`` may replace it) and the report to the sinks (front ends log it to
    Lightning loggers / Accelerate trackers)."""

    def __init__(self, comm: Comm, steps_per_print: int, device: torch.device) -> None:
        self.comm = comm
        self.steps_per_print = max(1, int(steps_per_print))
        self._sync = device.type == "cuda"
        self._step_times: dict[str, float] = defaultdict(float)
        self._active: list[str] = []  # the phases running now, innermost last
        self._window: dict[str, float] = defaultdict(float)
        self._window_steps = 0
        self._bytes_seen: dict[str, int] = {}
        self._last_boundary = time.perf_counter()
        self.last_report: dict[str, float] = {}
        self.sinks: list[Sink] = []
        self.printer: Callable[[str], None] = _log_line
        comm.wait_timer = self.record_wait

    @classmethod
    def from_config(cls, config: ZeroConfig, comm: Comm, device: torch.device) -> StepTimers | None:
        """A ``StepTimers`` when ``config.wall_clock_breakdown`` is true, else None."""
        if config.wall_clock_breakdown is not True:
            return None
        return cls(comm, config.report_every, device)

    def add_sink(self, sink: Sink) -> None:
        """Call ``sink(report, global_step)`` with every report (on every rank)."""
        self.sinks.append(sink)

    # -- measuring ----------------------------------------------------------------------------

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        self._active.append(name)
        try:
            yield
        finally:
            self._active.pop()
            self._step_times[name] += self._now() - start

    def record_wait(self, kind: str, seconds: float, link: str = "intra") -> None:
        """Called by ``Comm`` with the time a collective of ``kind`` on a group of ``link``
        (``"intra"`` / ``"inter"`` machine) blocked this rank."""
        name = WAIT_KIND.get(kind)
        if name is not None:
            self._step_times[name] += seconds
            if name == "reduce" and "backward" in self._active:
                # the part of backward spent blocked on reductions: what DeepSpeed's
                # backward_inner leaves out (the monitor's elapsed_time_ms_backward_inner)
                self._step_times["backward_reduce"] += seconds
        self._step_times[f"{link}_machine"] += seconds

    def _bytes_delta(self) -> dict[str, int]:
        """This step's bytes per kind and (``<link>_machine``) per link."""
        total = dict(self.comm.sent_total)
        total.update({f"{k}_machine": v for k, v in self.comm.link_total.items()})
        delta = {k: v - self._bytes_seen.get(k, 0) for k, v in total.items()}
        self._bytes_seen = total
        return delta

    # -- reporting ----------------------------------------------------------------------------

    def end_step(self, global_step: int) -> None:
        """An optimizer step finished: fold it into the window; report when due."""
        now = self._now()
        self._step_times["iteration"] = now - self._last_boundary
        self._last_boundary = now
        for name, seconds in self._step_times.items():
            self._window[f"{name}_ms"] += seconds * 1e3
        for kind, n in self._bytes_delta().items():
            self._window[f"{kind}_bytes"] += n
        self._step_times.clear()
        self._window_steps += 1
        if global_step % self.steps_per_print == 0:
            self._report(global_step)

    def _report(self, global_step: int) -> None:
        steps = self._window_steps
        report = {k: v / steps for k, v in self._window.items()}
        for name in (*PHASES, "iteration", "intra_machine", "inter_machine"):
            report.setdefault(f"{name}_ms", 0.0)
        report["sent_bytes"] = sum(
            v for k, v in report.items() if k.endswith("_bytes") and "_machine" not in k
        )
        self.last_report = report
        self._window.clear()
        self._window_steps = 0
        if self.comm.rank == 0:
            self.printer(format_report(report, global_step, steps))
        for sink in self.sinks:
            sink(report, global_step)


def format_report(report: dict[str, float], global_step: int, steps: int = 1) -> str:
    """One line: per-step milliseconds of each phase and MB sent per collective kind."""
    shown = [*PHASES, *(p for p in OPTIONAL_PHASES if f"{p}_ms" in report)]
    times = "  ".join(f"{name} {report.get(f'{name}_ms', 0.0):.1f}" for name in shown)
    moved = "  ".join(
        f"{k[: -len('_bytes')]} {v / 1e6:.2f}"
        for k, v in sorted(report.items())
        if k.endswith("_bytes") and k != "sent_bytes" and v > 0
    )
    return (
        f"[wall_clock_breakdown] step {global_step} (mean of {steps}): ms/step: "
        f"{times}  (iteration {report.get('iteration_ms', 0.0):.1f}) | MB sent/step: "
        f"{moved or 'none'}"
    )
