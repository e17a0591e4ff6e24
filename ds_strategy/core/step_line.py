"""DeepSpeed's progress line: with ``steps_per_print`` in the config, every that many optimizer
steps global rank 0 prints the step, the steps skipped so far (fp16 overflows, non-finite
norms), each param group's learning rate and momentum, as DeepSpeed's engine does::

    step=10, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]

The line is a report of the ``ds_strategy.core.engine`` logger (stdout when the application
configures no logging; see ``ds_strategy/_logging.py``). Without ``steps_per_print`` (its
default, None, as DeepSpeed's) there is no line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .._logging import report
from .collectives import world_rank

__all__ = ["progress_line", "report_progress"]

log = logging.getLogger("ds_strategy.core.engine")


def _momentum(group: Mapping[str, Any]) -> Any:
    """Adam's betas, SGD's momentum, or None for an optimizer with neither."""
    if "betas" in group:
        return tuple(group["betas"])
    return group.get("momentum")


def progress_line(step: int, skipped: int, param_groups: Iterable[Mapping[str, Any]]) -> str:
    """The line DeepSpeed prints every ``steps_per_print`` steps.

    >>> progress_line(20, 1, [{"lr": 0.001, "betas": (0.9, 0.95)}, {"lr": 0.01, "momentum": 0.9}])
    'step=20, skipped=1, lr=[0.001, 0.01], mom=[(0.9, 0.95), 0.9]'
    """
    groups = list(param_groups)
    lr = [g["lr"] for g in groups]
    mom = [_momentum(g) for g in groups]
    return f"step={step}, skipped={skipped}, lr={lr}, mom={mom}"


def report_progress(
    steps_per_print: int | None, step: int, skipped: int, param_groups: Iterable[Mapping[str, Any]]
) -> None:
    """The progress line on global rank 0 at every ``steps_per_print``-th step; else nothing."""
    if steps_per_print is None or step % steps_per_print:
        return
    if world_rank() != 0:
        return
    report(log, progress_line(step, skipped, param_groups))
