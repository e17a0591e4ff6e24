"""The package's logger tree: every module logs through ``logging.getLogger(__name__)``
(``ds_strategy.core.engine``, ``ds_strategy.core.timers``, ...), children of ``ds_strategy``.

[Note: what shows when the application configures no logging]
The ``ds_strategy`` logger has one handler of its own, :class:`OwnHandler`, which prints only
while the application has no handler on the record's way up (none on ``ds_strategy`` or its
children, none on the root logger): warnings on stderr, as Python's last-resort handler would
(an fp16 step skipped on a gradient overflow, an optimizer parameter ignored, a monitor
without a batch size for its x axis), and the reports the config asked for on stdout
(``wall_clock_breakdown``, the ``steps_per_print`` progress line, the flops profiler's
profile, the comms logger's lines), as DeepSpeed prints them. Other INFO lines (the summary
an engine gives once built, the progress of long operations) stay silent. This is what
transformers and DeepSpeed do with a handler of their own, except that ours steps aside: once
the application configures logging, every record goes where it says, printed once::

    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # everything at INFO
    logging.getLogger("ds_strategy.core.progress").setLevel(logging.WARNING)  # no progress
    logging.getLogger("ds_strategy").setLevel(logging.ERROR)  # not even warnings or reports

[Note: a report is logged at INFO whatever the root logger's level]
A report is an INFO record marked ``ds_report``, made by :func:`report` even when the root
logger's level (WARNING by default, and after a plain ``logging.basicConfig()``) would drop
INFO: the config asked for it. A level set on a ``ds_strategy`` logger, or
``logging.disable``, still decides, so an application can silence reports by name.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["OwnHandler", "package_logger", "report"]

package_logger = logging.getLogger("ds_strategy")  # the parent of every module's logger


class OwnHandler(logging.Handler):
    """The package's handler: prints warnings (stderr) and reports (stdout) while the
    application has no handler of its own on the record's way up; see the module's note."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            stream = sys.stderr  # looked up now: a test's capture, tqdm's redirection
        elif getattr(record, "ds_report", False):
            stream = sys.stdout
        else:
            return
        if application_handles(record.name):
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never break training
            self.handleError(record)


def application_handles(name: str) -> bool:
    """Whether a record of logger ``name`` reaches a handler that is not the package's own."""
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(not isinstance(h, OwnHandler) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def _level_set(logger: logging.Logger) -> bool:
    """Whether the application set a level on ``logger`` or one of its ``ds_strategy``
    ancestors (the package sets none)."""
    current: logging.Logger | None = logger
    while current is not None and current.name.startswith("ds_strategy"):
        if current.level != logging.NOTSET:
            return True
        current = current.parent
    return False


def report(logger: logging.Logger, text: str) -> None:
    """Show ``text``, a report the config asked for, as an INFO record of ``logger`` marked
    ``ds_report`` (see the module's notes: printed by the package's handler when the
    application configured no logging, by the application's handlers otherwise)."""
    if logging.root.manager.disable >= logging.INFO:
        return
    if _level_set(logger) and not logger.isEnabledFor(logging.INFO):
        return
    fn, lno, func, sinfo = logger.findCaller(stacklevel=2)
    record = logger.makeRecord(
        logger.name, logging.INFO, fn, lno, "%s", (text,), None, func, {"ds_report": True}, sinfo
    )
    logger.handle(record)


if not any(isinstance(h, OwnHandler) for h in package_logger.handlers):  # once per process
    package_logger.addHandler(OwnHandler())
