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

# Ports for rendezvous come from below the kernel's ephemeral range, never from ``bind(0)``: a
# port the kernel handed out and this process released is back in the pool that every
# outgoing connection draws from (gloo opens dozens a group), so another job's connection
# could take it before the store listens on it (EADDRINUSE). Each pytest-xdist worker walks
# its own block, so two workers never offer the same port; a separate run on the same machine
# starts at a random point of its block, and every port is tried before it is given.
_PORT_BLOCK = 1000
_PORT_BLOCKS = 16
_next_port: list[int] = []


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_block() -> int:
    """This process's block: the xdist worker's number (``gw3`` -> 3), else its pid's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else os.getpid()
    return index % _PORT_BLOCKS


def free_port() -> int:
    """A port on 127.0.0.1 nobody listens on, outside the ephemeral range (see above)."""
    base = max(1024, _ephemeral_low() - _PORT_BLOCK * _PORT_BLOCKS) + _PORT_BLOCK * _port_block()
    if not _next_port:
        _next_port.append(int.from_bytes(os.urandom(2), "little") % _PORT_BLOCK)
    for _ in range(_PORT_BLOCK):
        port = base + _next_port[0] % _PORT_BLOCK
        _next_port[0] += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the block is all taken
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
    port = free_port()
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
