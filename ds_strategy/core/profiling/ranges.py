"""Named ``torch.profiler`` ranges around the engine's phases: ``ds_strategy::forward``,
``::backward``, ``::optimizer_step``, ``::reduce_scatter``, ``::all_gather``,
``::offload_read`` / ``::offload_write`` (NVMe swap) and ``::checkpoint_save`` /
``::checkpoint_load``, so a trace of a training step reads by phase.

[Note: a range costs nothing while no profiler runs]
``record_function`` is not free with no profiler: entering and leaving one dispatches two
operators, about 7 us together on a CPU (torch 2.13), which is measurable against a small
model's step (hundreds of collectives and swap calls). :func:`profile_range` therefore asks
the profiler's own thread-local flag first (``torch._C._autograd._profiler_enabled``, about
40 ns) and returns a shared ``nullcontext`` when nothing is recording; only a running
profiler pays for the range. The flag is per thread, as the profiler's recording is: a
range entered on a worker thread (the NVMe swap pool) would not be recorded, so the swap's
ranges sit on the caller's side, around the submission of a read or write and the wait for
it (``benchmarks/bench_profile_ranges.py`` measures the step with and without).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch.autograd.profiler import record_function

__all__ = [
    "PREFIX",
    "RANGES",
    "profile_range",
    "profiling",
    "range_name",
    "record_function",
    "ranged",
]

PREFIX = "ds_strategy::"
RANGES = (
    "forward",
    "backward",
    "reduce_scatter",
    "all_gather",
    "optimizer_step",
    "offload_read",
    "offload_write",
    "checkpoint_save",
    "checkpoint_load",
)
"""Every phase the engine marks; a trace holds ``PREFIX + name`` for each one that ran."""

# the timers' phase names (core/timers.py) whose range is named differently
_RENAMED = {"step": "optimizer_step"}
_NULL = contextlib.nullcontext()
P = ParamSpec("P")
R = TypeVar("R")
profiling = torch._C._autograd._profiler_enabled
"""Whether a profiler records on this thread (cheap: see the note above)."""


def range_name(phase: str) -> str:
    """The range a timer phase runs in: ``"step"`` -> ``"ds_strategy::optimizer_step"``."""
    return PREFIX + _RENAMED.get(phase, phase)


def profile_range(name: str) -> contextlib.AbstractContextManager[record_function | None]:
    """``record_function("ds_strategy::<name>")`` while a profiler records on this thread,
    else a shared no-op (see [Note: a range costs nothing while no profiler runs]).

    >>> with profile_range("forward"):
    ...     pass
    """
    if not profiling():
        return _NULL
    return record_function(PREFIX + name)


def ranged(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function to run inside ``profile_range(name)`` (a flag test when no
    profiler records).

    >>> @ranged("all_gather")
    ... def gather() -> int:
    ...     return 1
    >>> gather()
    1
    """
    full = PREFIX + name

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            if not profiling():
                return fn(*args, **kwargs)
            with record_function(full):
                return fn(*args, **kwargs)

        return inner

    return wrap
