"""Run a test's function on N gloo ranks on 127.0.0.1, with a timeout so a hang fails fast.

During a test run the ranks come from the session's pool (``tests/pool.py``: started once,
reused by every test, isolated between tests); ``fresh=True``, or a call outside pytest, spawns
new processes for this call alone. Each call gets its own free port; a worker's exception comes
back to the test with its rank and traceback.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.pool import WorkerError, active, free_port

__all__ = ["WorkerError", "free_port", "run_command", "run_ranks", "run_ranks_each"]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    pg_timeout: float,
    args: tuple,
    queue: Any,
) -> None:
    import faulthandler
    import signal

    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on timeout, see run_ranks

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        result = fn(rank, world, *args)
        # Plain bytes: a tensor put on a queue travels as a shared-memory handle that dies
        # with this process, which may exit before the parent has read it.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, pg_timeout, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(results) + len(errors) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                for p in procs:  # print every stuck rank's Python stacks before killing it
                    if p.is_alive() and p.pid is not None:
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1)
                codes = {r: p.exitcode for r, p in enumerate(procs)}
                raise TimeoutError(
                    f"ranks did not finish within {timeout}s (done: {sorted(results)}, exit codes: {codes})"
                )
            try:
                rank, status, payload = queue.get(timeout=min(left, 1.0))
            except queue_mod.Empty:  # check whether a rank died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    raise WorkerError(f"rank(s) {dead} died without a report") from None
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}: {payload}")
                break
        if errors:
            raise WorkerError(errors[0])
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


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
