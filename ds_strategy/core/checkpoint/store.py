"""Storing a rank's pieces and committing the checkpoint: every rank writes its own files
through ``torch.distributed.checkpoint`` into ``<final>.tmp``, then all record their files'
sizes and checksums and rank 0 puts the directory in place (``swap.put_in_place``). Whatever
fails on the way is classified into one :class:`CheckpointWriteError` saying what happened,
where and what to do (a full disk, a read-only mount, another rank's failure).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ..collectives import Comm
from ..faults import together
from ..memory import free_bytes, human_bytes
from ..offload.streaming import SwapFiles
from . import swap
from .errors import first_failure
from .records import CheckpointMeta
from .streamed import StreamingSavePlanner
from .validate import CheckpointError, merge_checksums, record_checksums

__all__ = [
    "CheckpointWriteError",
    "commit",
    "fresh_tmp",
    "single_process_ok",
    "total_bytes",
    "write",
    "write_error",
]


@contextlib.contextmanager
def single_process_ok(distributed: bool) -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists; for a world
    of one that is exactly the intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to", category=UserWarning
            )
        yield


def fresh_tmp(final: Path) -> Path:
    """Rank 0, before a save: an empty ``<final>.tmp`` for every rank to write into."""
    tmp = swap.tmp_dir(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def total_bytes(comm: Comm, mine: int) -> int:
    """What every rank's part takes together (``mine``: this rank's bytes): the size of the
    checkpoint to write."""
    total = torch.tensor([mine], dtype=torch.int64)
    comm.all_reduce(total, kind="control")
    return int(total.item())


def write(
    state: dict[str, torch.Tensor],
    tmp: Path,
    comm: Comm,
    final: Path,
    needed: int,
    swap_files: SwapFiles | None = None,
) -> None:
    """Every rank writes its pieces into ``tmp`` (DCP names them ``__<rank>_<n>.distcp``).
    DCP gathers every rank's outcome, so a failure raises on all of them, here translated to
    one line saying what happened and where (:class:`CheckpointWriteError`). With
    ``swap_files`` the pieces out in swap files are read from them one at a time."""
    failures = (Exception, CheckpointException)  # DCP's is a BaseException
    planner = StreamingSavePlanner(swap_files, comm.rank) if swap_files is not None else None
    # the serial writer: it asks for a piece only once the one before is written
    writer = FileSystemWriter(tmp, per_thread_copy_ahead=0 if planner else 10_000_000)
    with _as_write_error(tmp, final, needed, comm.rank, failures), single_process_ok(comm.active):
        try:
            dcp.save(
                state,
                storage_writer=writer,
                planner=planner,
                process_group=comm.group,
                no_dist=not comm.active,
            )
        finally:
            if planner is not None:
                planner.done()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the previous checkpoint and ``latest`` are
    unchanged); ``errno`` is the underlying error's, when there was one."""


CheckpointWriteError.__module__ = "ds_strategy"


def write_error(
    e: BaseException, tmp: Path, final: Path, needed: int, rank: int
) -> CheckpointWriteError:
    """One line saying what happened and where; DCP's gathered failures are unwrapped to the
    first failing rank's."""
    rank, cause = first_failure(e, rank)
    os_error = _os_error(cause)
    errno_ = os_error.errno if os_error is not None else None
    if errno_ is None and _does_not_fit(tmp, needed):
        # torch.save reports a failed write of its zip writer as "unexpected pos": a full
        # disk, when what is left to write no longer fits
        errno_ = errno.ENOSPC
    where = getattr(os_error, "filename", None) or tmp
    unchanged = f"the previous checkpoint at {final} (if any) and latest are unchanged"
    if errno_ == errno.ENOSPC:
        room = free_bytes(tmp.parent)
        free = "free space unknown" if room is None else f"{human_bytes(room)} free there"
        message = (
            f"no space left on device writing {where}: needed {needed} bytes "
            f"({human_bytes(needed)}) for this checkpoint, {free}; free some space or save "
            f"elsewhere ({unchanged})"
        )
    elif errno_ == errno.EFBIG:
        message = (
            f"file too large writing {where} (rank {rank}): the file-size limit (ulimit -f, "
            f"RLIMIT_FSIZE) refused it; this checkpoint needs {needed} bytes "
            f"({human_bytes(needed)}) over all ranks' files, each rank's in one file; raise the "
            f"job's limit ({unchanged})"
        )
    elif errno_:
        message = (
            f"{os.strerror(errno_).lower()} writing {where} (rank {rank}): {cause}; {unchanged}"
        )
    else:
        message = (
            f"checkpoint save to {final} failed on rank {rank}: {type(cause).__name__}: "
            f"{cause}; {unchanged}"
        )
    out = CheckpointWriteError(message)
    out.errno = errno_
    return out


def _os_error(e: BaseException | None) -> OSError | None:
    """``e`` or the first error it was raised from that carries an ``errno``."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _does_not_fit(tmp: Path, needed: int) -> bool:
    try:
        written = sum(f.stat().st_size for f in tmp.iterdir()) if tmp.is_dir() else 0
        return shutil.disk_usage(tmp.parent).free < needed - written
    except OSError:
        return False


def commit(
    comm: Comm,
    tmp: Path,
    final: Path,
    meta: CheckpointMeta,
    needed: int,
    after_rename: Callable[[], None] | None = None,
) -> None:
    """Every rank records its files' sizes and checksums; once all have, rank 0 writes
    ``ds_strategy.json``, puts ``tmp`` in place of ``final`` (``swap.put_in_place``) and runs
    ``after_rename`` (the ``latest`` pointer, pruning), and the ranks leave together."""
    # the agreement doubles as the barrier: a rank that failed (a full disk) makes every rank
    # raise instead of leaving the others waiting for it
    with together(comm, CheckpointError), _as_write_error(tmp, final, needed, comm.rank):
        record_checksums(tmp, comm.rank)
    with together(comm, CheckpointError), _as_write_error(tmp, final, needed, comm.rank):
        if comm.rank == 0:
            record: CheckpointMeta = {**meta, "files": merge_checksums(tmp)}
            swap.put_in_place(tmp, final, json.dumps(record, indent=2))
            if after_rename is not None:
                after_rename()


@contextlib.contextmanager
def _as_write_error(
    tmp: Path,
    final: Path,
    needed: int,
    rank: int,
    failures: tuple[type[BaseException], ...] = (OSError,),
) -> Iterator[None]:
    """``failures`` raised in the block become one :class:`CheckpointWriteError`."""
    try:
        yield
    except failures as e:
        raise write_error(e, tmp, final, needed, rank) from e
