"""DeepSpeed's comms logger: per collective kind, how many ran, their message sizes, the
bytes this rank sent, the time they took, the algorithmic and bus bandwidth, and how far the
slowest rank lagged the fastest.

[Note: what the comms logger measures]
Every collective goes through ``core/collectives.py``'s ``Comm``, which counts the bytes each
one sends (``comm_report()``). With ``comms_logger.enabled`` the engine gives its group a
:class:`CommsLogger`; ``Comm`` then hands each collective it issues to :meth:`CommsLogger.issue`
with the *same* byte count it files for ``comm_report()`` (so the two agree by construction),
and calls the returned :class:`Timing` when the collective has completed: right after a
synchronous one, or when its ``Work`` is waited for (an asynchronous one is timed from issue
to completion, compute that overlapped it included). The times are wall clock, on the CPU;
on CUDA they end when the host learned of the completion, not when the kernel ended.
Disabled, the engine's group holds no logger, ``Comm`` finds none (an attribute test per
collective) and no collective carries a timing.

Message size is the whole buffer of the collective: the full (unsharded) buffer of an
all-gather or a reduce-scatter, the tensor of an all-reduce or a broadcast. Bandwidths follow
DeepSpeed's ``calc_bw_log`` (after nccl-tests): ``tput`` (algbw) is size / time, twice that
for an all-reduce; ``busbw`` is algbw x (n-1)/n for all-gather, reduce-scatter and
all-to-all, size / time x 2(n-1)/n for an all-reduce, and algbw for the rest (broadcast,
gather), n being the ranks of the group the collective ran on.

The straggler gap of a kind is the slowest rank's total time in it minus the fastest rank's:
the ranks all take part in every collective of the group, so the time one spends beyond the
fastest is time spent waiting for a late rank (or on a slow link). Reporting gathers every
rank's totals, so :meth:`CommsLogger.report` is a collective, called on every rank.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from ..._logging import report
from ...config._schema import CommsLoggerConfig

log = logging.getLogger(__name__)

__all__ = [
    "CommKindReport",
    "CommSizeRow",
    "CommsLogger",
    "CommsReport",
    "Timing",
    "bandwidth_factors",
    "format_summary",
]

_COL = 20  # DeepSpeed's column width
_HEADER = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "tput_avg (Gbps)",
    "busbw_avg (Gbps)",
)
_STRAGGLER_HEADER = ("Comm. Op", "Count", "Fastest rank(ms)", "Slowest rank(ms)", "Straggler(ms)")
# frames of these files are the collective itself, not its caller (``debug``)
_OWN_FILES = ("collectives.py", "hierarchical.py", "mics.py", "ranges.py", "comms.py")


def bandwidth_factors(op: str, n: int) -> tuple[float, float]:
    """(algbw, busbw) per byte of message per second for ``op`` on ``n`` ranks, as DeepSpeed's
    ``calc_bw_log`` computes them (see the module note).

    >>> bandwidth_factors("all_reduce", 4)
    (2.0, 1.5)
    >>> bandwidth_factors("all_gather", 2)
    (1.0, 0.5)
    """
    if op == "all_reduce":
        return 2.0, 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return 1.0, (n - 1) / n
    return 1.0, 1.0


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def convert_size(nbytes: float) -> str:
    """DeepSpeed's message size: ``convert_size(1536)`` -> ``'1.5 KB'`` (powers of 1024)."""
    size = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return "0B" if nbytes == 0 else f"{round(size, 2):g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def trim_mean(values: list[float], trim: float = 0.1) -> float:
    """The mean without the ``trim`` share of the smallest and of the largest values
    (DeepSpeed's ``trim_mean``, which drops outliers from the printed averages)."""
    if not values:
        return 0.0
    data = sorted(values)
    k = int(round(len(data) * trim))
    kept = data[k : len(data) - k] or data
    return sum(kept) / len(kept)


class CommSizeRow(TypedDict):
    """The completed calls of one kind with one message size, as DeepSpeed prints them."""

    count: int
    total_latency_ms: float
    avg_latency_ms: float  # trimmed means, as DeepSpeed's
    tput_avg_gbps: float
    busbw_avg_gbps: float


class CommKindReport(TypedDict):
    """One collective kind of :meth:`CommsLogger.report`."""

    op: str
    count: int
    msg_bytes: int
    sent_bytes: int
    total_ms: float
    avg_ms: float
    algbw_gbps: float
    busbw_gbps: float
    straggler_ms: float
    rank_total_ms: list[float]
    sizes: dict[int, CommSizeRow]  # by message size in bytes


class CommsReport(TypedDict):
    """What :meth:`CommsLogger.report` returns: whether it ran, on how many ranks, per kind."""

    enabled: bool
    ranks: int
    ops: dict[str, CommKindReport]


@dataclass
class _Sized:
    """The completed calls of one kind with one message size: DeepSpeed's table row."""

    count: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    algbw: list[float] = field(default_factory=list)
    busbw: list[float] = field(default_factory=list)


@dataclass
class _Kind:
    """One collective kind (``comm_report()``'s name): counts and bytes at issue, time and
    bandwidth at completion."""

    op: str
    count: int = 0
    msg_bytes: int = 0
    sent_bytes: int = 0
    seconds: float = 0.0
    alg_bytes: float = 0.0  # message bytes x the op's algbw factor, of completed calls
    bus_bytes: float = 0.0
    sizes: dict[int, _Sized] = field(default_factory=dict)


class Timing:
    """One collective in flight; calling it (once) when the collective has completed records
    its time. ``Comm`` keeps it on the collective's ``Work`` until then."""

    __slots__ = ("_logger", "_name", "_kind", "_msg", "_n", "_start")

    def __init__(self, logger: CommsLogger, name: str, kind: _Kind, msg: int, n: int) -> None:
        self._logger, self._name, self._kind = logger, name, kind
        self._msg, self._n = msg, n
        self._start = time.perf_counter()

    def __call__(self) -> None:
        self._logger._complete(self._name, self._kind, self._msg, self._n, self._start)


class CommsLogger:
    """DeepSpeed's ``comms_logger`` for one engine's collectives (see the module note).

    ``prof_all``: every kind; else only the kinds (``comm_report()``'s names, such as
    ``"all_gather"`` or ``"control"``) or ops (``"all_reduce"``, ...) in ``prof_ops``.
    ``verbose``: rank 0 prints each collective as it completes (to ``printer``; by default a
    report of this module's logger). ``debug``: a kind is recorded
    per calling function, as ``"<kind> | [Caller Func: <name>]"``.

    >>> logger = CommsLogger(prof_all=False, prof_ops=["all_gather"])
    >>> logger.issue("all_gather", "all_gather", 1024, 512, 2)()
    >>> logger.issue("reduce_scatter", "reduce_scatter", 1024, 512, 2) is None
    True
    >>> r = logger.report(lambda mine: [mine, mine])
    >>> (r["ops"]["all_gather"]["count"], r["ops"]["all_gather"]["straggler_ms"])
    (1, 0.0)
    """

    def __init__(
        self,
        *,
        prof_all: bool = True,
        prof_ops: list[str] | tuple[str, ...] = (),
        verbose: bool = False,
        debug: bool = False,
        rank: int = 0,
        printer: Callable[[str], None] | None = None,
    ) -> None:
        self.prof_all = prof_all
        self.prof_ops = frozenset(prof_ops)
        self.verbose = verbose
        self.debug = debug
        self.rank = rank
        # by default a report of this module's logger: stdout without logging set up, else the
        # application's handlers (ds_strategy/_logging.py)
        self.printer = printer or (lambda line: report(log, line))
        self._kinds: dict[str, _Kind] = {}

    @classmethod
    def from_config(cls, config: CommsLoggerConfig, rank: int) -> CommsLogger | None:
        """A logger for the config's ``comms_logger`` section when enabled, else None."""
        if not config.enabled:
            return None
        return cls(
            prof_all=config.prof_all,
            prof_ops=tuple(config.prof_ops),
            verbose=config.verbose,
            debug=config.debug,
            rank=rank,
        )

    def wants(self, kind: str, op: str) -> bool:
        return self.prof_all or kind in self.prof_ops or op in self.prof_ops

    # -- recording ----------------------------------------------------------------------------

    def issue(self, kind: str, op: str, msg_bytes: int, sent_bytes: int, n: int) -> Timing | None:
        """Count a collective of ``kind`` (torch's ``op``) as it is issued, with its message
        size and the bytes this rank sends, on a group of ``n`` ranks; returns what to call at
        its completion, or None for a kind not profiled."""
        if not self.wants(kind, op):
            return None
        name = f"{kind} | [Caller Func: {_caller()}]" if self.debug else kind
        record = self._kinds.get(name)
        if record is None:
            record = self._kinds[name] = _Kind(op)
        record.count += 1
        record.msg_bytes += msg_bytes
        record.sent_bytes += sent_bytes
        return Timing(self, name, record, msg_bytes, n)

    def _complete(self, name: str, record: _Kind, msg: int, n: int, start: float) -> None:
        seconds = time.perf_counter() - start
        alg, bus = bandwidth_factors(record.op, n)
        record.seconds += seconds
        record.alg_bytes += alg * msg
        record.bus_bytes += bus * msg
        row = record.sizes.get(msg)
        if row is None:
            row = record.sizes[msg] = _Sized()
        algbw, busbw = _gbps(alg * msg, seconds), _gbps(bus * msg, seconds)
        row.count += 1
        row.latencies_ms.append(seconds * 1e3)
        row.algbw.append(algbw)
        row.busbw.append(busbw)
        if self.verbose and self.rank == 0:
            self.printer(
                f"rank={self.rank} | comm op: {name} | time (ms): {seconds * 1e3:.2f} | "
                f"msg size: {convert_size(msg)} | algbw (Gbps): {algbw:.2f}  | "
                f"busbw (Gbps): {busbw:.2f} "
            )

    # -- reporting ----------------------------------------------------------------------------

    def report(self, gather: Callable[[object], list[object]]) -> CommsReport:
        """Per kind: ``op``, ``count``, ``msg_bytes``, ``sent_bytes`` (``comm_report()``'s
        bytes), ``total_ms``, ``avg_ms``, ``algbw_gbps``, ``busbw_gbps``, the straggler gap
        ``straggler_ms`` with every rank's ``rank_total_ms``, and DeepSpeed's per message size
        rows under ``sizes``. ``gather(obj)`` returns every rank's ``obj`` (a collective)."""
        mine = {name: k.seconds for name, k in self._kinds.items()}
        every: list[dict[str, float]] = gather(mine)  # type: ignore[assignment]
        ops = {name: self._kind_report(name, every) for name in self._kinds}
        return {"enabled": True, "ranks": len(every), "ops": ops}

    def _kind_report(self, name: str, every: list[dict[str, float]]) -> CommKindReport:
        k = self._kinds[name]
        done = sum(row.count for row in k.sizes.values())
        totals = [rank.get(name, 0.0) * 1e3 for rank in every]
        return {
            "op": k.op,
            "count": k.count,
            "msg_bytes": k.msg_bytes,
            "sent_bytes": k.sent_bytes,
            "total_ms": k.seconds * 1e3,
            "avg_ms": k.seconds * 1e3 / done if done else 0.0,
            "algbw_gbps": _gbps(k.alg_bytes, k.seconds),
            "busbw_gbps": _gbps(k.bus_bytes, k.seconds),
            "straggler_ms": max(totals) - min(totals),
            "rank_total_ms": totals,
            "sizes": {
                msg: {
                    "count": row.count,
                    "total_latency_ms": sum(row.latencies_ms),
                    "avg_latency_ms": trim_mean(row.latencies_ms),
                    "tput_avg_gbps": trim_mean(row.algbw),
                    "busbw_avg_gbps": trim_mean(row.busbw),
                }
                for msg, row in sorted(k.sizes.items())
            },
        }

    @staticmethod
    def disabled_report() -> CommsReport:
        """What the engine reports with ``comms_logger`` off: nothing was timed."""
        return {"enabled": False, "ranks": 0, "ops": {}}


def _row(cells: tuple[object, ...]) -> str:
    return "".join(f"{c: <{_COL}}" for c in cells).rstrip()


def format_summary(report: CommsReport, show_straggler: bool = True) -> str:
    """``report`` (:meth:`CommsLogger.report`) as DeepSpeed's ``log_summary`` prints it: a
    row per kind, then one per message size; with ``show_straggler`` a breakdown of each
    kind's straggler gap."""
    lines = [_row(_HEADER)]
    for name, k in report["ops"].items():
        lines.append(name)
        for msg, s in k["sizes"].items():
            lines.append(
                _row(
                    (
                        " ",
                        convert_size(msg),
                        s["count"],
                        f"{s['total_latency_ms']:.2f}",
                        f"{s['avg_latency_ms']:.2f}",
                        f"{s['tput_avg_gbps']:.2f}",
                        f"{s['busbw_avg_gbps']:.2f}",
                    )
                )
            )
    if show_straggler:
        lines += ["_______________________________", "Breakdown with straggler effect"]
        lines += ["-------------------------------", _row(_STRAGGLER_HEADER)]
        for name, k in report["ops"].items():
            totals = k["rank_total_ms"]
            cells = (" ", k["count"], f"{min(totals):.2f}", f"{max(totals):.2f}")
            lines += [name, _row((*cells, f"{k['straggler_ms']:.2f}"))]
    return "\n".join(lines)


def _caller() -> str:
    """The function that asked for the collective: the first frame outside the collectives'
    own files (``debug``)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.endswith(_OWN_FILES):
        frame = frame.f_back
    return frame.f_code.co_name
