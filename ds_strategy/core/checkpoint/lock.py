"""One job writes into a checkpoint directory at a time.

[Note: the lock]
Two jobs saving into one root would replace each other's ``latest``, prune each other's
checkpoints and collide mid-save on the same files. So rank 0 of a job holds an exclusive
``flock`` on ``<root>/.ds_strategy.lock`` from its first save into the root until
``engine.destroy()`` or the end of the process; the kernel drops the lock of a process that
dies, even by ``kill -9``, so a lock is never stale. The file names its holder (host, pid,
start time, command line) for the error any other writer gets at once. A checkpoint saved to
a bare directory (no root) is locked the same way, by ``<dir>.lock`` beside it, for that save
only. A held root covers everything under it: a save into any directory below it (a bare
save into one of its tags, another root nested in it) fails while another job holds it; and
a root is not taken while another job's bare save into a directory right inside it is in
flight (taking it would recover the root, removing that save's ``.tmp`` as a leftover).
Engines in one process share a lock: one process is one job. Releasing (also at the
exit of the process) removes the file while still holding the lock; a writer that opened the
file before it was removed finds, after locking, that the path now names another file (or
none) and tries again, so two writers never both believe they hold it.

Where ``fcntl`` does not exist (Windows) nothing is locked.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["CheckpointBusyError", "LOCK_FILE", "acquire", "release"]

LOCK_FILE = ".ds_strategy.lock"


class CheckpointBusyError(RuntimeError):
    """Another job is saving checkpoints into the same directory."""


CheckpointBusyError.__module__ = "ds_strategy"


@dataclass
class _Held:
    fd: int
    path: Path
    owners: set[int] = field(default_factory=set)


_held: dict[str, _Held] = {}
_mutex = threading.Lock()


def acquire(lock_path: Path, directory: Path, owner: object) -> None:
    """Hold ``lock_path`` for ``owner`` (shared with other owners in this process), or raise
    :class:`CheckpointBusyError` naming the job that holds it."""
    if fcntl is None:
        return
    _check_ancestors(directory)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(lock_path)
    with _mutex:
        held = _held.get(key)
        if held is None:
            fd = _lock(lock_path, directory)
            if lock_path.name == LOCK_FILE:  # a root: no bare save in flight inside it
                try:
                    _check_children(directory)
                except BaseException:
                    with contextlib.suppress(OSError):
                        lock_path.unlink()
                    os.close(fd)
                    raise
            held = _held[key] = _Held(fd, lock_path)
        held.owners.add(id(owner))


def release(owner: object | None, lock_path: Path | None = None) -> None:
    """Drop ``owner``'s hold on ``lock_path`` (on every lock when None; every owner's when
    ``owner`` is None); a lock nobody in this process holds any more is removed and
    released."""
    with _mutex:
        for key, held in list(_held.items()):
            if lock_path is not None and key != os.path.realpath(lock_path):
                continue
            if owner is None:
                held.owners.clear()
            held.owners.discard(id(owner))
            if not held.owners:
                del _held[key]
                with contextlib.suppress(OSError):
                    held.path.unlink()
                os.close(held.fd)


@atexit.register
def _release_at_exit() -> None:  # a process killed outright leaves the file, never the lock
    release(None)


def _lock(path: Path, directory: Path) -> int:
    assert fcntl is not None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise CheckpointBusyError(
                f"{directory}: another job is saving checkpoints here ({holder}; lock file "
                f"{path}); save into another directory, or stop that job (it releases the "
                "directory when it exits or calls engine.destroy())"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            break
        os.close(fd)  # removed by its last holder after we opened it: lock the new one
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def _check_ancestors(directory: Path) -> None:
    """Raise :class:`CheckpointBusyError` when a directory above ``directory`` is a root
    another job holds: its lock covers everything under it, a bare save into one of its
    tags (``save_checkpoint("root/tag")``) included."""
    assert fcntl is not None
    for parent in Path(os.path.realpath(directory)).parents:
        lock = parent / LOCK_FILE
        if not lock.is_file() or os.path.realpath(lock) in _held:
            continue
        holder = _holder(lock)
        if holder is not None:
            raise CheckpointBusyError(
                f"{directory}: inside {parent}, where another job is saving checkpoints "
                f"({holder}; lock file {lock}); its lock covers everything under it. Save "
                "elsewhere, or stop that job"
            )


def _check_children(root: Path) -> None:
    """Raise :class:`CheckpointBusyError` when another job is saving a bare checkpoint
    directly inside ``root`` (``save_checkpoint("root/x")`` holding ``root/x.lock``): taking
    ``root`` would recover it, removing that save's ``x.tmp`` as a leftover."""
    assert fcntl is not None
    for lock in sorted(root.glob("*.lock")):
        if lock.name == LOCK_FILE or os.path.realpath(lock) in _held or not lock.is_file():
            continue
        holder = _holder(lock)
        if holder is not None:
            raise CheckpointBusyError(
                f"{root}: another job is saving {root / lock.name[: -len('.lock')]} inside it "
                f"({holder}; lock file {lock}); saving into {root} as a root would take over "
                "that save's directory. Wait for it to finish, or save elsewhere"
            )


def _holder(lock: Path) -> str | None:
    """Who holds ``lock`` (another process: a shared lock is refused while it does), or None
    when nobody does or the file has gone."""
    assert fcntl is not None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None  # released (and removed) meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(os.pread(fd, 4096, 0))
    finally:
        os.close(fd)  # (and with it the shared lock just taken)
    return None


def _describe(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode())
        return (
            f"held by pid {h['pid']} on {h['host']} since {h['since']}, "
            f"command: {h['command'] or '?'}"
        )
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
