"""Reading a checkpoint that another job may be saving again at the same moment.

[Note: a load reads one committed checkpoint]
A tag saved again is replaced by renames (``swap.py``): the new directory goes in under the
name and the previous one is removed; ``latest`` moves on and old tags are pruned the same
way. A reader that opened files by path as it went could take ``ds_strategy.json`` and some
data files from one save and the rest from the next, and a checksum read first would then
call the other save's file corrupt. So a load *pins* each directory before reading anything:
it opens the directory, then every file the checkpoint consists of (``ds_strategy.json``,
DCP's ``.metadata`` and every data file its checksums list), each relative to that
directory's descriptor, and from then on reads only through those descriptors: the
checksums, the metadata and the data. A committed directory is never changed (a save writes
a new one and renames it into place), and an open file keeps its bytes after its name is
removed, so what is pinned is one save, whole, whatever the writer does meanwhile.

A file missing while the directory is no longer at its name means a save moved it away
during the pin: the pin starts again from the resolution (``latest``, the tag). The ranks of
a job then agree that they pinned the same save (the CRC-32 of each ``ds_strategy.json``)
and start again together when not. An error from resolving (``latest`` naming a tag that a
save had just pruned) is tried again too, and raised only when it is the same twice in a row;
after ``TRIES`` attempts the load refuses, saying the checkpoint is being re-saved faster
than it can be read.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..collectives import Comm
from ..faults import together
from .errors import CheckpointError, not_a_checkpoint
from .records import CheckpointMeta
from .trust import SafeReader

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "DCP_META",
    "FORMAT",
    "META_FILE",
    "PinnedCheckpoint",
    "confined",
    "crc32_of",
    "parse_meta",
    "pin_agreed",
    "pinned_sources",
]

FORMAT = "ds_strategy-sharded-1"
META_FILE = "ds_strategy.json"  # ours: the format, shapes, checksums; written last
DCP_META = ".metadata"  # torch.distributed.checkpoint's: where each entry's bytes are

TRIES = 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def parse_meta(raw: bytes, meta_path: Path) -> CheckpointMeta:
    """``ds_strategy.json``'s content ``raw`` (read from ``meta_path``), checked."""
    try:
        meta = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{meta_path}: not valid JSON ({e}); the file is truncated or corrupt"
        ) from e
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt != FORMAT:
        raise CheckpointError(
            f"{meta_path}: checkpoint format {fmt!r}, this ds_strategy reads {FORMAT!r}"
        )
    record: CheckpointMeta = meta  # our format: the record collect.py wrote
    return record


def crc32_of(fd: int, chunk: int = 1 << 22) -> int:
    """The CRC-32 of the whole file open as ``fd``, read with ``pread`` (the descriptor's
    offset is left alone)."""
    value, offset = 0, 0
    while block := os.pread(fd, chunk, offset):
        value = zlib.crc32(block, value)
        offset += len(block)
    return value


def confined(root: Path, name: str) -> Path:
    """``root/name``, a tag of the checkpoint root ``root`` (ours or DeepSpeed's save
    directory), refused where it is a symbolic link or resolves outside ``root``: a load never
    reads another directory's checkpoint under this one's name."""
    d = root / name
    if d.is_symlink() or (d.exists() and d.resolve().parent != root.resolve()):
        raise CheckpointError(
            f"{d}: a link to {d.resolve()}, outside {root}; a checkpoint tag is a directory "
            "of its root, so this one is not read: copy the checkpoint into place, or load "
            "its directory by its own path"
        )
    return d


class _Moved(Exception):
    """The directory was moved or removed by a concurrent save while being pinned."""


class _PreadFile(io.RawIOBase):
    """A read-only stream over a descriptor that several streams share: each keeps its own
    position and reads with ``pread`` (the descriptor's own offset is never used)."""

    def __init__(self, fd: int, size: int, name: str) -> None:
        self._fd, self._size, self._pos, self.name = fd, size, 0, name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        data = os.pread(self._fd, len(view), self._pos)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


class PinnedCheckpoint:
    """One checkpoint directory's files, held open (see the note above). ``path`` names the
    directory in messages; ``meta`` is its parsed ``ds_strategy.json``."""

    def __init__(self, path: Path, require_checksums: bool = True) -> None:
        self.path = path
        self._fds: dict[str, int] = {}
        self._dir = -1
        try:
            self._pin(require_checksums)
        except BaseException:
            self.close()
            raise

    def _pin(self, require_checksums: bool) -> None:
        if not self.path.is_dir():
            raise FileNotFoundError(
                f"{self.path}: no checkpoint directory here (pass the directory given to "
                "save_checkpoint, or its root directory holding a 'latest' file)"
            )
        try:
            self._dir = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            raise _Moved from None
        raw = self._read_whole(META_FILE)
        self.meta_crc = zlib.crc32(raw)
        self.meta = parse_meta(raw, self.path / META_FILE)
        names = list(self.meta.get("files") or {})
        if not names:
            if require_checksums:
                return  # validation refuses it, naming the missing checksums
            names = [DCP_META, *self._referenced()]
        for name in names:
            self._open(name)

    def _referenced(self) -> list[str]:
        """The data files DCP's metadata references (a checkpoint without checksums)."""
        if not self._open(DCP_META):
            return []
        try:
            md = SafeReader(self.path, pinned=self).read_metadata()
        except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError):
            return []  # validation names the damaged file
        return sorted({info.relative_path for info in md.storage_data.values()})

    def _read_whole(self, name: str) -> bytes:
        if not self._open(name):
            raise not_a_checkpoint(self.path, META_FILE)
        with self.open(name) as f:
            return f.read()

    def _open(self, name: str) -> bool:
        """Hold ``name`` open; False when the directory has no such file."""
        if name in self._fds:
            return True
        if os.path.isabs(name) or ".." in Path(name).parts:
            return False  # validation refuses a reference outside the directory
        try:
            self._fds[name] = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=self._dir)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(
                    f"{self.path / name}: a symbolic link; a checkpoint's files are read only "
                    "from its own directory, so it is refused (copy the file in instead)"
                ) from None
            if e.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
            if not self._in_place():
                raise _Moved from None
            return False
        return True

    def _in_place(self) -> bool:
        """Whether ``path`` still names the directory pinned."""
        try:
            here, pinned = os.stat(self.path), os.fstat(self._dir)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (pinned.st_dev, pinned.st_ino) and pinned.st_nlink > 0

    def has(self, name: str) -> bool:
        return name in self._fds

    def size(self, name: str) -> int:
        return os.fstat(self._fds[name]).st_size

    def open(self, name: str) -> io.BufferedReader:
        """A stream of the pinned file ``name`` (a path relative to the directory)."""
        fd = self._fds.get(os.path.normpath(name))
        if fd is None:
            raise CheckpointError(
                f"{self.path / name}: not one of the checkpoint's files (its {META_FILE} does "
                "not list it)"
            )
        return io.BufferedReader(_PreadFile(fd, os.fstat(fd).st_size, str(self.path / name)))

    def crc32(self, name: str) -> int:
        return crc32_of(self._fds[name])

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir >= 0:
            os.close(self._dir)
            self._dir = -1


@contextlib.contextmanager
def pinned_sources(
    comm: Comm | None, resolve: Callable[[], list[Path]], require_checksums: bool = True
) -> Iterator[list[PinnedCheckpoint]]:
    """Pin the directories ``resolve()`` names (see the note above), closed on leaving. With
    ``comm`` every rank pins and the ranks agree they hold the same saves (collective);
    ``None``: this process alone (a tool such as consolidation)."""
    pins = pin_agreed(comm, resolve, require_checksums)
    try:
        yield pins
    finally:
        for p in pins:
            p.close()


def pin_agreed(
    comm: Comm | None, resolve: Callable[[], list[Path]], require_checksums: bool = True
) -> list[PinnedCheckpoint]:
    """What :func:`pinned_sources` yields, for a caller that closes the pins itself (or
    leaves them to be closed when collected)."""
    tried = _Attempts(resolve, require_checksums)
    for attempt in range(TRIES):
        last = attempt == TRIES - 1
        if comm is None:
            pins, retry = tried.once(last)
        else:
            pins = []
            try:
                with together(comm, CheckpointError):
                    pins, retry = tried.once(last)
            except BaseException:
                for p in pins:  # another rank's error: this rank's pins are closed too
                    p.close()
                raise
            # the ranks hold the same saves, or all try again
            mark = 0 if retry else _fingerprint(pins)
            agreed = torch.tensor([int(retry), mark, -mark], dtype=torch.int64)
            comm.all_reduce(agreed, op="max", kind="control")
            retry = int(agreed[0]) != 0 or int(agreed[1]) != -int(agreed[2])
        if not retry:
            return pins
        for p in pins:
            p.close()
        time.sleep(min(0.02 * (attempt + 1), 0.25))
    raise _busy(tried.dirs)


class _Attempts:
    """Resolving and pinning, once per attempt; an error is raised when it is the same as the
    attempt before's (or on the last attempt), otherwise tried again."""

    def __init__(self, resolve: Callable[[], list[Path]], require_checksums: bool) -> None:
        self.resolve, self.require_checksums = resolve, require_checksums
        self.dirs: list[Path] = []
        self.previous_error: str | None = None

    def once(self, last: bool) -> tuple[list[PinnedCheckpoint], bool]:
        """(the pins, whether to try again)."""
        pins: list[PinnedCheckpoint] = []
        try:
            self.dirs = self.resolve()
            for d in self.dirs:
                pins.append(PinnedCheckpoint(d, self.require_checksums))
        except BaseException as e:
            for p in pins:
                p.close()
            if isinstance(e, _Moved):
                return [], True
            retried = isinstance(e, (OSError, CheckpointError, ValueError)) and not last
            if not retried or str(e) == self.previous_error:
                raise
            self.previous_error = str(e)  # a save may have been in the way: once more
            return [], True
        self.previous_error = None
        return pins, False


def _fingerprint(pins: list[PinnedCheckpoint]) -> int:
    return zlib.crc32(json.dumps([p.meta_crc for p in pins]).encode())


def _busy(dirs: list[Path]) -> CheckpointError:
    where = ", ".join(str(d) for d in dirs) or "the checkpoint"
    return CheckpointError(
        f"{where}: being saved again by another job while it is read ({TRIES} attempts, each "
        "found a newer save than the one it had begun to read); retry the load, or load a tag "
        "that job does not overwrite"
    )
