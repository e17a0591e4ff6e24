"""Progress of long operations, on rank 0: building a large model unit by unit (and writing
it to NVMe), the first swap-out, a checkpoint save or load of swapped state.

On a terminal (rank 0's stderr is a TTY) the progress is a ``tqdm`` bar, shown once an
operation has lasted ``DS_STRATEGY_PROGRESS_EVERY`` seconds (default 10). Elsewhere (a log
file, a batch job) it is lines to the ``ds_strategy.core.progress`` logger at INFO (shown once
the application configures logging, see ``ds_strategy/_logging.py``), at most every
``DS_STRATEGY_PROGRESS_EVERY`` seconds (default 10) and once at the end of an operation that
logged or lasted that long, so a short operation says nothing. ``DS_STRATEGY_PROGRESS=0``
silences them, and so does ``TQDM_DISABLE=1``, the switch a job already uses to turn off its
progress bars. For example, ``building the ZeRO-3 model: 17/40 units (42%), 20 s``.

Used by the ZeRO-3 unit-by-unit build and its NVMe swap-out, streamed checkpoint saves and
loads, ``ds_strategy.consolidate`` and the inference engine's loading of weights.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Protocol

__all__ = ["Progress", "progress_enabled"]

log = logging.getLogger(__name__)

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def progress_enabled() -> bool:
    """False when ``DS_STRATEGY_PROGRESS`` is ``0`` (or ``false``, ``no``, ``off``) or
    ``TQDM_DISABLE`` is ``1`` (or ``true``, ``yes``, ``on``); read at each operation's start,
    so a job may switch it between operations."""
    ours = os.environ.get("DS_STRATEGY_PROGRESS", "1").strip().lower()
    tqdm_off = os.environ.get("TQDM_DISABLE", "").strip().lower()
    return ours not in _OFF and tqdm_off not in _ON


def _every() -> float:
    try:
        return float(os.environ.get("DS_STRATEGY_PROGRESS_EVERY", "10"))
    except ValueError:
        return 10.0


class _Bar(Protocol):
    """What :class:`Progress` asks of a tqdm bar."""

    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


class Progress:
    """``what: done/total unit (pct%), elapsed`` lines for one operation (see the module)."""

    def __init__(
        self, what: str, total: int, rank: int, unit: str = "", every: float | None = None
    ) -> None:
        self.what, self.total, self.unit = what, max(0, int(total)), unit
        self.every = _every() if every is None else every
        self.on = rank == 0 and progress_enabled()
        self.count = 0
        self.start = self._last = time.monotonic()
        self.logged = False
        self.bar = self._bar() if self.on else None

    def _bar(self) -> _Bar | None:
        """A tqdm bar when rank 0 writes to a terminal, else None (log lines)."""
        if not sys.stderr.isatty():
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=self.total or None,
            desc=self.what,
            unit=f" {self.unit}" if self.unit else "it",
            delay=self.every,
            dynamic_ncols=True,
        )

    def advance(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
            return
        if not self.on:
            return
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._log(now)

    def done(self) -> None:
        if self.bar is not None:
            self.bar.close()
            return
        if self.on and (self.logged or time.monotonic() - self.start >= self.every):
            self._log(time.monotonic(), end=True)

    def _log(self, now: float, end: bool = False) -> None:
        self.logged = True
        pct = f" ({100 * self.count / self.total:.0f}%)" if self.total else ""
        unit = f" {self.unit}" if self.unit else ""
        state = "done" if end else f"{self.count:,}/{self.total:,}{unit}{pct}"
        log.info("%s: %s, %.0f s", self.what, state, now - self.start)
