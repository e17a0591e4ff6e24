"""The model-state meter's timeline: every allocation and free of one optimizer step, with
the bytes held after it, for ``engine.memory_timeline()`` and ``ds-strategy plot``.

[Note: one step, bounded]
A timeline of a whole run grows without end, and every step of a steady run looks alike. So
the timeline keeps the events of the step under way and of the latest finished step only,
each at most ``max_events`` long (events past the cap are counted in ``dropped``, not kept):
memory is bounded by two steps' events whatever the run's length. A step runs from the end
of the previous optimizer step to the end of this one (its micro-batches' forwards and
backwards, then the step), so its events start and end at the resident state.

Each event says what happened (``alloc``, ``free``, ``resident`` when the resident bytes
were counted again, ``touch`` for a gradient that exists for an instant before it is copied
into a bucket), its ``nbytes``, the phase the engine was in (``forward``, ``backward``,
``step``, or ``idle`` between them), and after it the bytes held by kind: ``resident``
(parameters, gradient buffers, masters, optimizer state), ``transient`` (gathered
parameters, gradient buckets, reductions in flight, the step's copies) and their ``total``,
with the meter's ``peak`` so far. A ``touch`` event's ``transient`` includes the touched
gradient, as the meter's peak counts it at that instant.

The file also records, as ``formula``, this rank's model state by the ZeRO paper's formula
with Adam (:func:`zero_formula_bytes`), the line a plot draws the timeline against.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    from .collectives import Comm

__all__ = ["FIELDS", "MemoryTimeline", "TimelineEvent", "timeline_path", "zero_formula_bytes"]

FIELDS = (
    "seq",
    "time_s",
    "step",
    "phase",
    "event",
    "nbytes",
    "resident",
    "transient",
    "total",
    "peak",
)


class TimelineEvent(TypedDict):
    """One allocation or free (see the module note for each field)."""

    seq: int
    time_s: float
    step: int
    phase: str
    event: str
    nbytes: int
    resident: int
    transient: int
    total: int
    peak: int


class MemoryTimeline:
    """Events of the step under way and of the latest finished one (see the module note).

    >>> t = MemoryTimeline(max_events=10)
    >>> t.record("alloc", 40, resident=100, transient=40, peak=140)
    >>> with t.phase("step"):
    ...     t.record("free", 40, resident=100, transient=0, peak=140)
    >>> t.end_step(1)
    >>> [(e["phase"], e["event"], e["total"]) for e in t.events()]
    [('idle', 'alloc', 140), ('step', 'free', 100)]
    """

    def __init__(self, max_events: int = 100_000) -> None:
        self.max_events = int(max_events)
        self.dropped = 0
        self.step = 0  # optimizer steps finished: the step under way is step + 1
        self.current_phase = "idle"
        self._current: list[TimelineEvent] = []
        self._last: list[TimelineEvent] = []
        self._seq = 0
        self._t0 = time.perf_counter()

    def record(self, event: str, nbytes: int, *, resident: int, transient: int, peak: int) -> None:
        """One event, with the bytes held after it."""
        self._seq += 1
        if len(self._current) >= self.max_events:
            self.dropped += 1
            return
        self._current.append(
            {
                "seq": self._seq,
                "time_s": time.perf_counter() - self._t0,
                "step": self.step + 1,
                "phase": self.current_phase,
                "event": event,
                "nbytes": int(nbytes),
                "resident": int(resident),
                "transient": int(transient),
                "total": int(resident) + int(transient),
                "peak": int(peak),
            }
        )

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Events recorded inside are tagged ``name``."""
        previous, self.current_phase = self.current_phase, name
        try:
            yield
        finally:
            self.current_phase = previous

    def end_step(self, step: int) -> None:
        """Optimizer step ``step`` finished: its events become the latest finished step's."""
        self._last, self._current = self._current, []
        self.step = int(step)

    def events(self) -> list[TimelineEvent]:
        """The latest finished step's events (the step under way's before any finished)."""
        return list(self._last if self.step > 0 else self._current)

    def write_csv(self, path: str | os.PathLike, formula: float) -> Path:
        """:meth:`events` to ``path`` (replaced), with ``formula`` on every row."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*FIELDS, "formula"])
            writer.writeheader()
            for row in self.events():
                writer.writerow({**row, "formula": int(formula)})
        os.replace(tmp, path)  # a reader (a plot during training) never sees half a file
        return path


def timeline_path(output_path: str, job_name: str, rank: int) -> Path:
    """Where a rank's timeline goes: beside the CSV monitor's files."""
    return Path(output_path or ".", job_name, f"memory_timeline_{rank}.csv")


class _Sharding(Protocol):
    @property
    def shard_optimizer(self) -> bool: ...

    @property
    def shard_grads(self) -> bool: ...

    @property
    def shard_params(self) -> bool: ...


class _Group(Protocol):
    """What the formula reads of a flat group: its shapes, ranks, policy and trainability."""

    @property
    def shapes(self) -> Sequence[Iterable[int]]: ...

    @property
    def comm(self) -> Comm: ...

    @property
    def policy(self) -> _Sharding: ...

    @property
    def trainable(self) -> bool: ...


def zero_formula_bytes(
    groups: Iterable[_Group],
    mixed: bool = False,
    per_element: tuple[float, float, float] | None = None,
    per_matrix_element: tuple[float, float, float] | None = None,
) -> float:
    """This rank's model state by the ZeRO paper's formula with Adam, over the engine's flat
    groups: per element ``P`` bytes of parameter, ``G`` of gradient (trainable groups) and
    ``K`` of optimizer state (fp32: P=G=4, K=8 for the two moments; mixed precision: P=G=2,
    K=12 with the fp32 master), each divided by the group's shard count where its policy
    shards it (stage 1: K, stage 2: G too, stage 3: P too; stage 3's small persistent
    parameters: G and K). Unpadded element counts: the padding of flat groups is not in it.

    Args:
        groups: the engine's flat groups.
        mixed: mixed precision with fp32 masters (the paper's K=12), when ``per_element`` is
            not given.
        per_element: ``(P, G, K)`` of the chosen precision and optimizer state
            (``PrecisionPolicy.formula_bytes``).
        per_matrix_element: the same for the elements of 2-D parameters, where they differ
            (Muon keeps one momentum there); None: ``per_element``.
    """
    other = per_element or ((2, 2, 12) if mixed else (4, 4, 8))
    matrix = per_matrix_element or other
    total = 0.0
    for g in groups:
        n = g.comm.world_size
        for shape in g.shapes:
            shape = tuple(shape)
            psi = _numel(shape)
            e, g_bytes, k = matrix if len(shape) == 2 else other
            total += e * psi / (n if g.policy.shard_params else 1)
            if g.trainable:
                total += g_bytes * psi / (n if g.policy.shard_grads else 1)
                total += k * psi / (n if g.policy.shard_optimizer else 1)
    return total


def _numel(shape: Iterable[int]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
