"""Reduce-scatter and all-gather through shared memory, for CPU ranks on one machine.

[Note: collectives through shared memory]
On one machine gloo still moves every byte through loopback TCP: a rank's chunk is copied
into the kernel by the sender and out again by the receiver, on gloo's worker threads, and
those threads take cores from the ranks' compute. With two CPU ranks of a 29.5M-parameter
GPT, the reduce-scatter and all-gather of one step cost each rank about 70 ms of CPU, 5% of
the step. Here each rank instead owns a file in ``/dev/shm`` that every rank of the group
maps:

- **reduce-scatter**: a rank copies the chunks meant for the others into its own file and
  says so; to complete, it waits until every rank has, then sums chunk ``rank`` of every
  rank's input, in rank order, straight from their files into ``out``;
- **all-gather**: a rank copies its shard into its file; to complete, it copies every other
  rank's shard from its file into ``full``.

One memory copy replaces four, and no thread but the caller's works. A call uses one of
``SLOTS`` areas of each file, in turn; before a rank writes an area again it waits until
every rank has read what it wrote there last (each reader acknowledges, in its own file's
header), and it first completes its own older calls, so two ranks each waiting for the other
to read cannot happen. Calls go in the same order on every rank, as gloo's do. The areas
grow, together on every rank, to the largest message seen: ``SLOTS`` times it is this
rank's memory for the exchange (the others' chunks of a reduce-scatter's input, or an
all-gather's shard), in place of the receive buffer as large as the whole input that gloo's
composed reduce-scatter allocates per call. ``memory_report()["shared_memory"]`` gives it;
like the bytes in NVMe files, it is not model state, so not in ``total`` or ``peak``. A flag
is written after the data it announces, and read before it, with a lock taken between (a
full memory barrier on every architecture).

The files are made by one collective step (``Exchange.open``): every rank creates its own,
claiming its pages at once, then opens the others'. If any rank cannot make its file (no
room left in ``/dev/shm``, as in a container's default 64 MiB) or see another's (ranks on
several machines, containers with separate ``/dev/shm``) every rank knows it and the group
keeps gloo. Each file is unlinked as soon as all have it mapped, so nothing is left behind
whatever happens after. A rank that waits on another checks now and then that the other's
process is alive and raises, naming it, if it is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Exchange"]

SLOTS = 2  # areas per rank: a call can be in flight while the next one starts
_HEADER = 4096
_ALIGN = 64
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_FENCE = threading.Lock()
_ROOT = "/dev/shm"


def _fence() -> None:
    """A full memory barrier: taking a lock is one on every architecture."""
    with _FENCE:
        pass


def _reserve(fd: int, size: int) -> None:
    """Claim the file's pages now: a full ``/dev/shm`` raises here (then the group keeps
    gloo) instead of killing the process with SIGBUS at the first write past its room."""
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is not None:
        allocate(fd, 0, size)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: kill's word


class Comm(Protocol):
    """What the files' set-up needs of the group (a ``collectives.Comm``)."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_gather_object(self, obj: object) -> list[object]: ...

    def all_reduce(
        self, tensor: torch.Tensor, op: str = ..., async_op: bool = ..., kind: str = ...
    ) -> object: ...

    def barrier(self) -> None: ...


@dataclass
class _Call:
    """One call in flight: its sequence number and what completes it (dropped once run: it
    holds the caller's buffers)."""

    seq: int
    complete: Callable[[], None] | None

    def wait(self) -> None:
        complete, self.complete = self.complete, None
        if complete is not None:
            complete()

    @property
    def done(self) -> bool:
        return self.complete is None


class Exchange:
    """This rank's file and every other rank's, mapped; see the module note.

    Built by :meth:`open` (collective). Header of a rank's file, in int64 words: the process
    id; per area, the sequence number last written there; then, per other rank and area, the
    sequence number of that rank's area this rank last read.

    Args:
        comm: the group, for the few small collectives that set the files up.
        timeout: seconds to wait for another rank before raising.
    """

    def __init__(self, comm: Comm, timeout: float) -> None:
        self.comm = comm
        self.n, self.rank = comm.world_size, comm.rank
        self.timeout = timeout
        self.area = 0  # bytes of each area
        self.seq = 0
        self._maps: list[mmap.mmap] = []
        self._pids: list[int] = []
        self._calls: list[_Call] = []

    # -- the files ---------------------------------------------------------------------------

    @staticmethod
    def open(comm: Comm, nbytes: int, timeout: float) -> Exchange | None:
        """Every rank's file mapped, with areas of ``nbytes``; None on every rank when some
        rank cannot see the others' files. Collective.

        Args:
            comm: the group.
            nbytes: bytes each area holds.
            timeout: seconds to wait for another rank before raising.
        """
        ex = Exchange(comm, timeout)
        return ex if ex._remap(nbytes) else None

    def _remap(self, nbytes: int) -> bool:
        """(Re)make the files with areas of ``nbytes``, on every rank at once (collective)."""
        for call in self._calls:  # every rank is past every call: nothing reads the old files
            call.wait()
        self._calls.clear()
        self._close()
        token = self.comm.all_gather_object(os.urandom(8).hex())[0]  # rank 0's
        path = [f"{_ROOT}/ds_strategy-{token}-{r}" for r in range(self.n)]
        nbytes = -(-nbytes // _ALIGN) * _ALIGN  # every area starts aligned for any dtype
        size = _HEADER + SLOTS * nbytes
        made = False
        try:
            fd = os.open(path[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                _reserve(fd, size)
            finally:
                os.close(fd)
            made = True
        except OSError:  # no /dev/shm, or too little room in it (a container's 64 MiB)
            if os.path.exists(path[self.rank]):
                os.unlink(path[self.rank])
        ok = self._all(made)
        if ok:
            try:
                for p in path:
                    fd = os.open(p, os.O_RDWR)
                    try:
                        self._maps.append(mmap.mmap(fd, size))
                    finally:
                        os.close(fd)
            except OSError:
                self._close()
        ok = self._all(ok and len(self._maps) == self.n)  # every rank has every file mapped
        if made:
            os.unlink(path[self.rank])
        if not ok:
            self._close()
            return False
        self.area, self.seq = nbytes, 0
        self._word(self.rank, 0).value = os.getpid()
        self.comm.barrier()
        self._pids = [self._word(r, 0).value for r in range(self.n)]
        return True

    def _all(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (collective)."""
        t = torch.tensor([0 if flag else 1], dtype=torch.int32)
        self.comm.all_reduce(t, op="max", kind="control")
        return int(t.item()) == 0

    def _close(self) -> None:
        maps, self._maps = self._maps, []
        for m in maps:
            with contextlib.suppress(BufferError):  # a view still out: it goes with that view
                m.close()

    def _word(self, owner: int, index: int) -> ctypes.c_int64:
        return ctypes.c_int64.from_buffer(self._maps[owner], 8 * index)

    def _written(self, owner: int, slot: int) -> ctypes.c_int64:
        return self._word(owner, 1 + slot)

    def _read(self, reader: int, owner: int, slot: int) -> ctypes.c_int64:
        """Word in ``reader``'s header: the last call of ``owner``'s area ``slot`` it read."""
        return self._word(reader, 1 + SLOTS + owner * SLOTS + slot)

    def _view(self, owner: int, slot: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        offset = _HEADER + slot * self.area
        return torch.frombuffer(self._maps[owner], dtype=dtype, count=count, offset=offset)

    # -- waiting -----------------------------------------------------------------------------

    def _wait_for(self, ready: Callable[[int], bool], what: str) -> None:
        """Until ``ready(r)`` for every other rank ``r``; raises naming a rank that died or
        did not come within the timeout."""
        others = [r for r in range(self.n) if r != self.rank and not ready(r)]
        spins, start, checked = 0, time.monotonic(), time.monotonic()
        while others:
            spins += 1
            if spins < 64:
                _yield()
            else:
                time.sleep(2e-5)
                now = time.monotonic()
                if now - checked > 0.5:
                    checked = now
                    self._check(others[0], now - start, what)
            others = [r for r in others if not ready(r)]

    def _check(self, rank: int, waited: float, what: str) -> None:
        if not _alive(self._pids[rank]):
            raise RuntimeError(
                f"rank {rank} of the group (process {self._pids[rank]}) exited during a "
                f"{what} through shared memory; this rank cannot go on. See that rank's "
                "error for the cause."
            )
        if waited > self.timeout:
            raise RuntimeError(
                f"rank {rank} of the group did not reach a {what} through shared memory within "
                f"{self.timeout:.0f} s (the process group's timeout); it is alive but stuck or "
                "issuing collectives in another order"
            )

    # -- calls -------------------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.area

    @property
    def nbytes(self) -> int:
        """This rank's memory for the exchange: its file's areas."""
        return SLOTS * self.area

    def grow(self, nbytes: int) -> bool:
        """Areas of at least ``nbytes`` (every rank asks for the same, at the same call);
        False when the files could not be made again (the caller keeps gloo). Collective."""
        return self._remap(max(nbytes, 2 * self.area))

    def _begin(self) -> tuple[int, int]:
        """The next call's sequence number and area, once every rank has read the area."""
        self.seq += 1
        seq, slot = self.seq, self.seq % SLOTS
        while self._calls and (self._calls[0].done or self._calls[0].seq <= seq - SLOTS):
            self._calls.pop(0).wait()
        self._wait_for(lambda r: self._read(r, self.rank, slot).value >= seq - SLOTS, "collective")
        return seq, slot

    def _publish(self, seq: int, slot: int, finish: Callable[[], None], what: str) -> _Call:
        _fence()
        self._written(self.rank, slot).value = seq

        def complete() -> None:
            self._wait_for(lambda r: self._written(r, slot).value >= seq, what)
            _fence()
            finish()
            _fence()
            for r in range(self.n):
                if r != self.rank:
                    self._read(self.rank, r, slot).value = seq

        call = _Call(seq, complete)
        self._calls.append(call)
        return call

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> _Call:
        """Start summing ``full`` over the ranks into ``out`` (chunk ``rank``); both stay
        alive and untouched until the call completes (``wait()``).

        Args:
            out: this rank's chunk of the sum.
            full: this rank's input, ``n`` chunks of ``out``'s size.
        """
        n, count, me = self.n, out.numel(), self.rank
        seq, slot = self._begin()
        # the chunks for the other ranks, packed: rank r's at r, or r - 1 past this rank's
        mine = self._view(me, slot, full.dtype, (n - 1) * count).view(n - 1, count)
        chunks = full.view(n, count)
        mine[:me].copy_(chunks[:me])
        mine[me:].copy_(chunks[me + 1 :])

        def theirs(r: int) -> torch.Tensor:
            at = me if me < r else me - 1
            return self._view(r, slot, full.dtype, (n - 1) * count)[at * count : (at + 1) * count]

        def finish() -> None:
            _sum_in_order([chunks[me] if r == me else theirs(r) for r in range(n)], out)

        return self._publish(seq, slot, finish, "reduce-scatter")

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> _Call:
        """Start filling ``full`` with every rank's ``shard``, in rank order.

        Args:
            full: ``n`` chunks of ``shard``'s size.
            shard: this rank's chunk, unchanged until the call completes.
        """
        n, count = self.n, shard.numel()
        seq, slot = self._begin()
        self._view(self.rank, slot, shard.dtype, count).copy_(shard.reshape(-1))
        chunks = full.view(n, count)

        def finish() -> None:
            for r in range(n):
                if r == self.rank:
                    if chunks[r].data_ptr() != shard.data_ptr():
                        chunks[r].copy_(shard.reshape(-1))
                else:
                    chunks[r].copy_(self._view(r, slot, shard.dtype, count))

        return self._publish(seq, slot, finish, "all-gather")


def _sum_in_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = the parts summed in rank order, as ``torch.sum`` over the stacked parts
    gives it (in fp32 for a lower precision, rounded once). ``out`` may be one of the parts
    (a reduce-scatter into its own input, ``Comm.reduces_into_input``)."""
    if len(parts) == 2:  # elementwise: out may be either part
        torch.add(parts[0], parts[1], out=out)
        return
    low = out.dtype in (torch.float16, torch.bfloat16)
    acc = parts[0].float() if low else torch.add(parts[0], parts[1])
    for p in parts[1:] if low else parts[2:]:
        acc.add_(p)
    out.copy_(acc)
