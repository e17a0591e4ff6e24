"""Run a test's function on N gloo ranks on 127.0.0.1, with a timeout so a hang fails fast.

During a test run the ranks come from the session's pool (``tests/pool.py``: started once,
reused by every test, isolated between tests); ``fresh=True``, or a call outside pytest, spawns
new processes for this call alone. Each call gets its own free port; a worker's exception comes
back to the test with its rank and traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.pool import RankPool, WorkerError, active, free_port

__all__ = [
    "WorkerError",
    "free_port",
    "run_command",
    "run_commands",
    "run_rank_processes",
    "run_ranks",
    "run_ranks_each",
]


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, name: str) -> str:
    """Run a launcher (``python script.py`` under Lightning, ``accelerate launch``) in its own
    process session; on timeout kill the whole group, since a rank the launcher started as a
    child would otherwise wait forever in a collective. Returns the combined output, or
    raises ``AssertionError`` with its tail."""
    (output,) = run_commands([cmd], cwd, env, timeout, name)
    return output


def run_commands(
    cmds: list[list[str]], cwd: Path, env: dict[str, str], timeout: float, name: str
) -> list[str]:
    """:func:`run_command` for independent commands, all started at once (one-process jobs
    side by side use both cores); their outputs in order. A command that fails or runs past
    ``timeout`` fails the call, after the others have finished or been killed with it."""
    labels = [" ".join(cmd)[:200] for cmd in cmds]
    return _run_all([(cmd, env) for cmd in cmds], cwd, timeout, name, labels)


def run_rank_processes(
    cmd: list[str], world: int, cwd: Path, env: dict[str, str], timeout: float, name: str
) -> str:
    """Start ``world`` copies of ``cmd`` at once, as torchrun or SLURM starts a job's ranks:
    each with ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
    a free ``MASTER_PORT`` on 127.0.0.1 (Lightning then sees processes created externally and
    starts none; its own launcher would start rank 1 only once rank 0 had imported everything
    and reached ``fit``). Returns rank 0's output then the others'; if one rank fails or the
    time runs out, every rank is killed and ``AssertionError`` carries each rank's tail."""
    port = str(free_port())
    runs = []
    for rank in range(world):
        rank_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK="0")
        rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        rank_env.update(LOCAL_WORLD_SIZE=str(world))
        runs.append((cmd, rank_env))
    labels = [f"rank {rank}" for rank in range(world)]
    return "".join(_run_all(runs, cwd, timeout, name, labels))


def _run_all(
    runs: list[tuple[list[str], dict[str, str]]],
    cwd: Path,
    timeout: float,
    name: str,
    labels: list[str],
) -> list[str]:
    """Start every ``(cmd, env)`` at once, each in its own session; their outputs in order,
    or ``AssertionError`` with each one's tail (``labels`` name them) once one has failed or
    the time has run out and the rest are killed."""
    with contextlib.ExitStack() as files:
        # files, not pipes: a pipe nobody reads while waiting could fill up
        logs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in runs]
        procs = [
            subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )  # fmt: skip
            for (cmd, env), log in zip(runs, logs, strict=True)
        ]
        failed = _wait_all(procs, timeout, labels)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    if failed:
        tails = (
            f"--- {label} ---\n{out[-4000:]}" for label, out in zip(labels, outputs, strict=True)
        )
        raise AssertionError(f"{name}: {failed}:\n" + "\n".join(tails))
    return outputs


def _wait_all(procs: list[subprocess.Popen[str]], timeout: float, labels: list[str]) -> str:
    """Wait for every process (named by ``labels``); at the first failure or at the deadline
    kill the rest (a rank whose peer died waits in a collective) with the processes they
    started. Returns what went wrong, or ``""``."""
    deadline = time.monotonic() + timeout
    failed = ""
    while any(p.poll() is None for p in procs) and not failed:
        failed = _first_failure(procs, labels)
        if not failed and time.monotonic() > deadline:
            failed = f"timed out after {timeout}s"
        if not failed:
            time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return failed or _first_failure(procs, labels)


def _first_failure(procs: list[subprocess.Popen[str]], labels: list[str]) -> str:
    for label, p in zip(labels, procs, strict=True):
        if p.returncode not in (None, 0):
            return f"{label} exited with {p.returncode}"
    return ""


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
    pool = RankPool(world, fresh=True)
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
