"""Run a test's function on N gloo ranks on 127.0.0.1, with a timeout so a hang fails fast.

During a test run the ranks come from the session's pool (``tests/pool.py``: started once,
reused by every test, isolated between tests); ``fresh=True``, or a call outside pytest, spawns
new processes for this call alone. Each call gets its own free port; a worker's exception comes
back to the test with its rank and traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.pool import RankPool, WorkerError, active, free_port

__all__ = ["WorkerError", "free_port", "run_command", "run_ranks", "run_ranks_each"]


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, name: str) -> str:
    """Run a launcher (``python script.py`` under Lightning, ``accelerate launch``) in its own
    process session; on timeout kill the whole group, since a rank the launcher started as a
    child would otherwise wait forever in a collective. Returns the combined output, or
    raises ``AssertionError`` with its tail."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{name} timed out after {timeout}s:\n{output[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{name} exited with {proc.returncode}:\n{output[-6000:]}")
    return output


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 240,
    pg_timeout: float = 60,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return results by rank.

    Raises ``WorkerError`` with the first failing rank's traceback, or ``TimeoutError`` if the
    ranks are not all done within ``timeout`` seconds (their processes are killed then).
    ``fresh``: new processes for this call, for a test of what only a new process has (an
    environment variable read at start-up).
    """
    pools = active()
    if pools is not None and not fresh:
        return pools.pool(world).run(fn, args, timeout, pg_timeout)
    return _spawn(fn, world, args, timeout, pg_timeout)


def _spawn(
    fn: Callable[..., Any], world: int, args: tuple, timeout: float, pg_timeout: float
) -> list[Any]:
    """New ranks for this call alone: a pool of its own, closed afterwards (its processes
    start now, with the caller's environment as it is)."""
    pool = RankPool(world)
    try:
        return pool.run(fn, args, timeout, pg_timeout)
    finally:
        pool.close()


def _each(rank: int, world: int, calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    return [fn(rank, world, *args) for fn, args in calls]


def run_ranks_each(
    calls: list[tuple[Callable[..., Any], tuple]], world: int, timeout: float = 600
) -> list[list[Any]]:
    """Run every ``fn(rank, world, *args)`` of ``calls``, one after the other, in one spawn
    of ``world`` ranks (starting 4 processes that import torch costs several seconds on two
    cores; parametrized cases share one start-up this way). Returns ``results[i][rank]`` for
    call ``i``."""
    per_rank = run_ranks(_each, world, calls, timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(calls))]
