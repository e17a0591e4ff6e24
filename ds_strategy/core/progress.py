"""Progress of long operations, on rank 0: building a large model unit by unit (and writing
it to NVMe), the first swap-out, a checkpoint save or load of swapped state.

Lines go to the ``ds_strategy`` logger at INFO, at most every ``DS_STRATEGY_PROGRESS_EVERY``
seconds (default 10) and once at the end of an operation that logged or lasted that long, so
a short operation says nothing. ``DS_STRATEGY_PROGRESS=0`` silences them. For example,
``building (offload to NVMe): 17/40 units (42%), 20 s``.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["Progress"]

log = logging.getLogger("ds_strategy")


def _every() -> float:
    try:
        return float(os.environ.get("DS_STRATEGY_PROGRESS_EVERY", "10"))
    except ValueError:
        return 10.0


class Progress:
    """``what: done/total unit (pct%), elapsed`` lines for one operation (see the module)."""

    def __init__(
        self, what: str, total: int, rank: int, unit: str = "", every: float | None = None
    ) -> None:
        self.what, self.total, self.unit = what, max(0, int(total)), unit
        self.every = _every() if every is None else every
        self.on = rank == 0 and os.environ.get("DS_STRATEGY_PROGRESS", "1") != "0"
        self.count = 0
        self.start = self._last = time.monotonic()
        self.logged = False

    def advance(self, n: int = 1) -> None:
        self.count += n
        if not self.on:
            return
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._log(now)

    def done(self) -> None:
        if self.on and (self.logged or time.monotonic() - self.start >= self.every):
            self._log(time.monotonic(), end=True)

    def _log(self, now: float, end: bool = False) -> None:
        self.logged = True
        pct = f" ({100 * self.count / self.total:.0f}%)" if self.total else ""
        unit = f" {self.unit}" if self.unit else ""
        state = "done" if end else f"{self.count:,}/{self.total:,}{unit}{pct}"
        log.info("%s: %s, %.0f s", self.what, state, now - self.start)
