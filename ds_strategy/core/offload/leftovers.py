"""Swap directories of runs that ended without removing them, and the lock that tells them
from a live run's.

[Note: whose swap directory is this]
A run removes its swap directory when it ends (``SwapDir.close``: ``destroy()``, garbage
collection, interpreter exit, an exception included). A run killed with ``kill -9``, by the
out-of-memory killer or by a launcher's SIGTERM cannot, and its files keep their gigabytes:
enough runs so ended fill the drive, and the next one fails mid-step with a full disk.

So each directory holds ``owner.lock``, locked with ``flock`` by its run for as long as the
directory lives. The kernel drops the lock when the run's process ends, however it ends.
Before a run checks the drive's room it reclaims the directories under ``nvme_path`` whose
lock it can take (:func:`reclaim`): their runs are gone. A live run's lock cannot be taken,
not even by another engine of the same process (``flock`` locks belong to each ``open``).

Two details make this safe against a run starting meanwhile. The lock file is locked under
a temporary name and renamed into place, so ``owner.lock`` is never seen unlocked while its
run lives; a directory without one (a run between ``mkdtemp`` and the rename, or a run of
an older ds_strategy) is left alone, and only counted in the error for a drive too small
(:func:`unowned`). A directory is reclaimed only by a run on the machine that made it (the
lock file records it): a lock on a network drive may not be seen from another machine.
A reclaimed directory is renamed before it is removed, so one half removed by a run killed
meanwhile is finished by the next (:data:`REMOVING`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from ..memory import human_bytes

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: nothing is ever reclaimed
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "claim", "reclaim", "unowned"]

log = logging.getLogger(__name__)

LOCK_NAME = "owner.lock"
REMOVING = "removing_"  # after the swap directories' prefix: one being removed


def claim(directory: Path) -> int:
    """Lock ``directory`` (new and empty) as this process's; the lock's file descriptor is
    returned, to be closed only once the directory is gone."""
    staged = directory / f".{LOCK_NAME}.new"
    fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if fcntl is not None:  # a new file: nobody else holds it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner = {"pid": os.getpid(), "host": socket.gethostname()}
        os.write(fd, json.dumps(owner).encode())
        os.rename(staged, directory / LOCK_NAME)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reclaim(base: Path, prefix: str) -> list[tuple[Path, int]]:
    """Remove the directories ``<base>/<prefix>*`` whose runs have ended (see the note), and
    say so; returns each one's path and the bytes it held."""
    out: list[tuple[Path, int]] = []
    if fcntl is None:
        return out
    for d in sorted(base.glob(f"{prefix}*")):
        if not d.is_dir():
            continue
        if d.name.startswith(prefix + REMOVING):  # a removal that was interrupted
            shutil.rmtree(d, ignore_errors=True)
            continue
        freed = _reclaim_one(d, prefix)
        if freed is not None:
            log.warning(
                "removed %s: swap files of a run that ended without removing them (%s)",
                d,
                human_bytes(freed),
            )
            out.append((d, freed))
    return out


def _reclaim_one(d: Path, prefix: str) -> int | None:
    """Bytes freed removing ``d``, or None when its run may be alive (or it has no lock)."""
    try:
        fd = os.open(d / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock: a run starting now, or an older ds_strategy's (see the note)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its run is alive
            return None
        if _owner_host(fd) != socket.gethostname():
            return None
        size = _size(d)
        doomed = d.with_name(prefix + REMOVING + d.name[len(prefix) :])
        try:
            os.rename(d, doomed)
        except OSError:  # another run is reclaiming it too
            return None
        shutil.rmtree(doomed, ignore_errors=True)
        return size
    finally:
        os.close(fd)


def _owner_host(fd: int) -> str | None:
    try:
        host = json.loads(os.pread(fd, 4096, 0)).get("host")
    except (OSError, ValueError, AttributeError):
        return None
    return host if isinstance(host, str) else None


def _size(d: Path) -> int:
    """Bytes the files of ``d`` take on the drive (a sparse file: its written blocks); what
    is removed meanwhile (another run reclaiming ``d``) counts as nothing."""
    total = 0
    with contextlib.suppress(OSError):
        for p in d.iterdir():
            with contextlib.suppress(OSError):
                total += p.stat().st_blocks * 512
    return total


def unowned(base: Path, prefix: str, mine: Path | None = None) -> list[tuple[Path, int]]:
    """Directories ``<base>/<prefix>*`` other than ``mine`` that :func:`reclaim` left: live
    runs' and lockless ones, with the bytes each holds (for an error saying where the room
    went)."""
    out = []
    for d in sorted(base.glob(f"{prefix}*")):
        if d.is_dir() and d != mine:
            out.append((d, _size(d)))
    return out
