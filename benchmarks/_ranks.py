"""Run a benchmark function on N gloo ranks on 127.0.0.1 and collect each rank's result.

``run(fn, world, *args)`` spawns ``world`` processes, each calls ``fn(rank, world, *args)``
inside an initialised process group (one CPU thread per rank) and returns its result; the
parent gets ``{rank: result}`` or exits naming the ranks that failed.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),  # one machine, as torchrun says it
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        queue.put((rank, fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it instead of waiting
        queue.put((rank, RuntimeError(f"{type(e).__name__}: {e}")))
        raise
    finally:
        dist.destroy_process_group()


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 1800) -> dict[int, Any]:
    """``{rank: fn(rank, world, *args)}`` from ``world`` spawned ranks."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
    failed = {r: v for r, v in results.items() if isinstance(v, RuntimeError)}
    if failed:
        raise SystemExit(f"{getattr(fn, '__name__', fn)} failed: {failed}")
    return results
