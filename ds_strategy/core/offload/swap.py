"""Tensors whose bytes live in files between uses (the NVMe tier).

[Note: swapping by resizing the storage]
A swapped-out tensor keeps its Python object, shape and dtype; only its storage shrinks to
zero bytes (``untyped_storage().resize_(0)``) once the bytes are on disk, and grows back to
the same storage when they are read in. Every view of it (an optimizer piece is a view of a
group's fp32 master shard) and every reference to it (``optimizer.state``) stays valid with
no rebinding, and while it is out any stray use fails loudly instead of reading stale data.
Reads and writes run on a small thread pool with plain ``readinto``/``write`` calls, which
release the GIL; the bytes go through the page cache, not the process's resident memory
(an ``mmap`` would count them as resident again). Every write records block checksums that
the next read checks (``integrity.py``, [Note: checksums of swapped tensors]); every
directory is locked by its run, so one whose run was killed is reclaimed by the next
(``leftovers.py``, [Note: whose swap directory is this]).
"""

from __future__ import annotations

import ctypes
import enum
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ...config import ConfigError
from ..heap import release_freed_blocks
from ..memory import ModelStateMeter, human_bytes
from ..profiling.ranges import profile_range, ranged
from . import leftovers
from .integrity import block_crcs, check_blocks, write_error, write_file, zero_crcs

__all__ = ["SwapDir", "SwapState", "SwappedTensor", "check_nvme_path", "drive_of", "io_bytes"]

DIR_PREFIX = "ds_strategy_swap_"


class SwapState(enum.Enum):
    RESIDENT = "resident"  # the storage holds the bytes
    WRITING = "writing"  # a worker is writing the bytes, then frees the storage
    ON_DISK = "on_disk"  # storage empty; the file holds the bytes
    READING = "reading"  # storage allocated; a worker is filling it from the file


def _buffer(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable buffer. (``Tensor.numpy()`` would do, but it marks the
    storage as not resizable, which swapping needs.)"""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


_io: dict[str, float] = {"read": 0, "written": 0, "waited": 0.0}
_io_lock = threading.Lock()


def count_io(read: int = 0, written: int = 0, waited: float = 0.0) -> None:
    with _io_lock:
        _io["read"] += read
        _io["written"] += written
        _io["waited"] += waited


def io_bytes() -> dict[str, float]:
    """Bytes this process has ``read`` from and ``written`` to swap files so far (every
    engine), and the seconds its training thread ``waited`` for them."""
    with _io_lock:
        return dict(_io)


class SwappedTensor:
    """One tensor that is either resident or in its file; ``acquire``/``release`` count users.

    >>> import tempfile, torch
    >>> d = SwapDir(tempfile.mkdtemp(), rank=0, needed_bytes=0, checkpoint_marker="x.json")
    >>> t = SwappedTensor(torch.arange(4.0), d.file("t"), d.pool)
    >>> t.release(dirty=True); t.wait(); t.tensor.untyped_storage().nbytes()
    0
    >>> t.acquire().tolist(); d.close()
    [0.0, 1.0, 2.0, 3.0]
    """

    def __init__(self, tensor: torch.Tensor, path: Path, pool: ThreadPoolExecutor) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only contiguous host tensors can be swapped to a file")
        self.tensor = tensor
        self.path = path
        self.nbytes = tensor.numel() * tensor.element_size()
        self._pool = pool
        self.state = SwapState.RESIDENT
        self.holds = 1  # the creator is using it
        self.dirty = True  # the file (if any) is older than the tensor
        # block checksums of what the file holds (None: nothing written yet); see integrity.py
        self.crcs: array[int] | None = None
        self._future: Future[None] | None = None
        # where the bytes are counted while they are back in memory (the engine's meter:
        # its peak then includes what a step or a gather read in); see ``_metered``
        self.meter: ModelStateMeter | None = None
        self._counted = False

    @classmethod
    def zeros_in_file(
        cls, tensor: torch.Tensor, path: Path, pool: ThreadPoolExecutor
    ) -> SwappedTensor:
        """A tensor of zeros in a new sparse file at ``path``: nothing in memory, nothing
        written but the file's length (``tensor``'s storage is freed)."""
        swap = cls(tensor, path, pool)
        try:
            with open(path, "wb") as f:
                f.truncate(swap.nbytes)
        except OSError as e:
            raise write_error(e, path, swap.nbytes) from e
        tensor.untyped_storage().resize_(0)
        swap.state, swap.holds, swap.dirty = SwapState.ON_DISK, 0, False
        swap.crcs = zero_crcs(swap.nbytes)
        return swap

    # -- worker side --------------------------------------------------------------------------

    def _write_and_free(self) -> None:
        buf = _buffer(self.tensor)
        crcs = block_crcs(buf)
        self.crcs = None  # the file is being rewritten: it matches nothing until done
        write_file(self.path, buf)
        self.crcs = crcs
        self.tensor.untyped_storage().resize_(0)
        count_io(written=self.nbytes)

    def _read(self) -> None:
        buf = _buffer(self.tensor)
        with open(self.path, "rb") as f:
            got = f.readinto(buf)
        if got != self.nbytes:
            raise OSError(f"{self.path}: read {got} of {self.nbytes} bytes (file truncated?)")
        check_blocks([buf], self.crcs, 0, self.path)
        count_io(read=got)

    # -- caller side ----------------------------------------------------------------------------

    def wait(self) -> None:
        """Finish a pending read or write (re-raising its error)."""
        if self._future is None:
            return
        # the range is the caller's wait: the pool's thread is not recorded (profiling/ranges.py)
        future, self._future = self._future, None
        with profile_range("offload_read" if self.state is SwapState.READING else "offload_write"):
            self._finish(future)

    def _finish(self, future: Future[None]) -> None:
        if future.done():
            future.result()
        else:
            start = time.perf_counter()
            future.result()
            count_io(waited=time.perf_counter() - start)
        if self.state is SwapState.WRITING:
            self.state = SwapState.ON_DISK
            self.dirty = False
            self._metered(False)
        elif self.state is SwapState.READING:
            self.state = SwapState.RESIDENT

    @ranged("offload_read")
    def prefetch(self, read: bool = True) -> None:
        """Start bringing the bytes back (no-op when resident or already coming).
        ``read=False`` only reallocates: the caller overwrites every element."""
        if self.state is SwapState.WRITING:
            self.wait()
        if self.state is not SwapState.ON_DISK:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        self._metered(True)
        if read:
            self.state = SwapState.READING
            self._future = self._pool.submit(self._read)
        else:
            self.state = SwapState.RESIDENT

    def acquire(self, read: bool = True) -> torch.Tensor:
        """Make the tensor resident (waiting for a prefetch) and count one more user."""
        self.prefetch(read)
        self.wait()
        self.holds += 1
        return self.tensor

    def release(self, dirty: bool) -> None:
        """One user less; the last one writes the bytes behind (if they changed) and frees."""
        if self.holds <= 0:
            raise RuntimeError(f"{self.path.name}: released more often than acquired")
        self.dirty |= dirty
        self.holds -= 1
        if self.holds > 0:
            return
        self._free_or_write()

    @ranged("offload_write")
    def _free_or_write(self) -> None:
        if self.dirty or not self.path.exists():
            self.state = SwapState.WRITING
            self._future = self._pool.submit(self._write_and_free)
        else:  # the file already holds these bytes
            self._free_storage()

    def _free_storage(self) -> None:
        """Give the storage up; the bytes are (or, for ``drop``, are taken as) in the file."""
        self.tensor.untyped_storage().resize_(0)
        self.state = SwapState.ON_DISK
        self._metered(False)

    def unread(self) -> None:
        """A read ahead that nobody acquired: free the storage again (the file holds these
        bytes); a tensor in use or changed since it was read is left alone."""
        if self.holds > 0 or self.state not in (SwapState.READING, SwapState.RESIDENT):
            return
        self.wait()
        if self.state is SwapState.RESIDENT and not self.dirty and self.path.exists():
            self._free_storage()

    def drop(self) -> None:
        """Forget the bytes: wait for any read or write, free the storage without writing it,
        and take every user's hold; the file is stale from now on, so the next user brings
        the tensor in with ``acquire(read=False)`` and overwrites it."""
        self.wait()
        if self.state is SwapState.RESIDENT:
            self._free_storage()
        self.holds = 0
        self.dirty = True

    def _metered(self, held: bool) -> None:
        """Count the bytes in (``held``) or out of the meter, once each way; a tensor that
        came in resident was never counted here (it was model state when it was made)."""
        if self.meter is None or held == self._counted:
            return
        if held:
            self.meter.alloc(self.nbytes)
        else:
            self.meter.free(self.nbytes)
        self._counted = held

    @property
    def resident(self) -> bool:
        return self.state is SwapState.RESIDENT


def check_nvme_path(
    path: str | os.PathLike[str],
    needed_bytes: int,
    checkpoint_marker: str,
    key: str,
    sharing: tuple[int, int] | None = None,
    mine: Path | None = None,
) -> Path:
    """Errors before training starts: the directory must exist, be writable, have room for
    ``needed_bytes``, and not be (or lie inside) a checkpoint directory. ``sharing``: (bytes,
    ranks) that every rank of this machine whose swap files go to the same drive needs
    together (see :func:`drive_of`); the room is checked for all of them. Swap directories
    of runs that have ended are removed first (``leftovers.py``); ``mine``: this run's own,
    when it is open already."""
    p = Path(path).expanduser().resolve()
    need = f"{needed_bytes:,} bytes ({human_bytes(needed_bytes)}) of swap space"
    if not p.is_dir():
        raise FileNotFoundError(
            f"{key}: nvme_path {str(p)!r} is not an existing directory; create it (on a fast "
            f"local drive) or point nvme_path at one. This run needs {need} there."
        )
    if not os.access(p, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{key}: nvme_path {str(p)!r} is not writable by this process; this run needs "
            f"{need} there. Fix its permissions or choose another directory."
        )
    for d in (p, *p.parents):
        if (d / checkpoint_marker).is_file():
            raise ConfigError(
                f"{key}: nvme_path {str(p)!r} is inside the ds_strategy checkpoint {str(d)!r} "
                f"({checkpoint_marker} found); swap files must not mix with checkpoints, choose "
                "another directory",
                key=key,
            )
    leftovers.reclaim(p, DIR_PREFIX)
    free = shutil.disk_usage(p).free
    total, ranks = sharing if sharing is not None and sharing[1] > 1 else (needed_bytes, 1)
    if free < total:
        together = (
            f" and {total:,} bytes ({human_bytes(total)}) for the {ranks} ranks of this machine "
            "that swap to this drive"
            if ranks > 1
            else ""
        )
        raise OSError(
            f"{key}: nvme_path {str(p)!r} has {free:,} bytes free but "
            f"this run needs {need} on this rank{together}{_others(p, mine)}; free space "
            "there, choose a larger drive, or give each rank's nvme_path its own drive"
        )
    return p


def _others(base: Path, mine: Path | None) -> str:
    """Where the room went, when other swap directories are there."""
    others = leftovers.unowned(base, DIR_PREFIX, mine)
    if not others:
        return ""
    held = sum(n for _, n in others)
    names = ", ".join(d.name for d, _ in others[:3]) + (", ..." if len(others) > 3 else "")
    return (
        f"; {len(others)} other swap directories there hold {held:,} bytes "
        f"({human_bytes(held)}): {names} (runs still using them, or, without an "
        f"{leftovers.LOCK_NAME}, runs of an older ds_strategy: remove those no run uses)"
    )


def drive_of(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """(this machine's name, the device number of ``path``'s file system): ranks whose swap
    files share a drive have the same; None where ``path`` is not there (its check says so)."""
    try:
        return socket.gethostname(), os.stat(Path(path).expanduser()).st_dev
    except OSError:
        return None


# [Note: swapped storages and the C allocator]
# Swapping frees and reallocates storages of every size all the time. glibc's malloc serves a
# block above its mmap threshold with its own mapping, returned to the system when freed, and
# anything smaller from its heap, which it returns only from the top. The threshold is
# dynamic: each freed mapping raises it to that block's size (up to 32 MiB), after which
# swapped tensors of a few MiB land in the heap, their freed bytes stay in the process, and
# its resident memory grows by gigabytes the engine no longer holds (measured: 1.65 GiB a rank
# at 1B parameters, on one rank and not the other). A fixed threshold, what glibc documents
# for ``M_MMAP_THRESHOLD``, keeps every block above 1 MiB in its own mapping. Set once per
# process when a swap directory opens (``heap.release_freed_blocks``), unless
# ``MALLOC_MMAP_THRESHOLD_`` chose a value; it overrides stage 3's setting (see [Note: the C
# heap under stage-3 gathers] in ``core/heap.py``).


class SwapDir:
    """This rank's private directory of swap files under ``nvme_path`` and the I/O threads.

    The directory's name is unique per run and rank; it is removed by :meth:`close`, when the
    owner is garbage-collected, or at interpreter exit, whichever comes first. Until then its
    ``owner.lock`` is locked, so that another run reclaims it only once this process is
    gone (see [Note: whose swap directory is this] in ``leftovers.py``).
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        rank: int,
        needed_bytes: int,
        checkpoint_marker: str,
        key: str = "zero_optimization.offload_optimizer",
        io_threads: int = 2,
        sharing: tuple[int, int] | None = None,
    ) -> None:
        base = check_nvme_path(nvme_path, needed_bytes, checkpoint_marker, key, sharing)
        release_freed_blocks()
        self.path = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}rank{rank}_", dir=base))
        try:
            lock = leftovers.claim(self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="ds_swap")
        self._finalizer = weakref.finalize(self, _remove, self.path, self.pool, lock, os.getpid())

    def file(self, name: str) -> Path:
        return self.path / f"{name}.bin"

    def contains(self, other: str | os.PathLike[str]) -> bool:
        """Whether ``other`` is this swap directory or lies inside it."""
        o = Path(other).expanduser().resolve()
        return o == self.path or self.path in o.parents

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def _remove(path: Path, pool: ThreadPoolExecutor, lock: int, owner: int) -> None:
    try:
        pool.shutdown(wait=True)
        if os.getpid() == owner:  # a child forked from the run, exiting, leaves it alone
            shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(lock)  # only now: the directory is gone (or this process is ending)
