"""Consolidated weights to one file: ``.safetensors`` (safetensors) or anything else
(``torch.save``). What ``engine.save_weights`` writes, for either engine; and
:func:`stream_safetensors`, which writes one tensor at a time.

[Note: streaming a .safetensors file]
The format is an 8-byte little-endian header length, a JSON header of dtypes, shapes and byte
offsets (plus optional string ``__metadata__``), then the raw tensors back to back. Once the
names, dtypes and shapes are known the header can be written first and each tensor appended
as it is produced, so peak memory is one tensor, never the whole model (``safetensors``'
``save_file`` takes the whole dict at once).

[Note: a weights file is whole or absent]
Each file is written to ``<name>.tmp`` beside it and renamed into place once complete, so a
reader never sees half a file and an earlier file of that name stays as it was until then.
A failure removes the ``.tmp`` (:class:`Output`); one of the writing itself (a full drive,
the process's file-size limit) is a :class:`WeightsWriteError` naming the output, the bytes
it needs and, where known, the room left. The room and the size limit are checked first
(:func:`check_room`), so a drive too small fails before a large model is read. ``torch.save``
and safetensors' ``save_file`` report a failed write as their own error without an errno
(``torch.save``: "unexpected pos"); the room left and the limit tell which it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO

import torch

from ..memory import file_size_limit, free_bytes, human_bytes
from .store import CheckpointWriteError

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "ST_DTYPES",
    "Output",
    "WeightsWriteError",
    "check_room",
    "stream_safetensors",
    "write_weights",
]

ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float64: "F64",
}


class WeightsWriteError(CheckpointWriteError):
    """Weights could not be written to their file ``path`` (a full drive, a file-size
    limit); no ``.tmp`` is left and an earlier file of that name is unchanged. ``errno`` is
    the underlying error's, or the one its cause is taken for (see the note)."""

    path: Path


def write_error(
    e: BaseException, path: Path, nbytes: int, total: int | None = None
) -> WeightsWriteError | None:
    """The error for ``e``, raised writing ``path`` (a file of ``nbytes``; ``total``: what the
    whole output needs, ``nbytes`` when None), or None when ``e`` is not a failed write: it
    has no errno, and neither the room left nor the size limit explains it (see the note)."""
    total = nbytes if total is None else total
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        free, limit = free_bytes(path.parent), file_size_limit()
        if free is not None and free < total:
            code = errno.ENOSPC
        elif limit is not None and limit < nbytes:
            code = errno.EFBIG
        else:
            return None
    return _error(code, path, nbytes, total, e)


def _error(
    code: int, path: Path, nbytes: int, total: int, cause: BaseException | None = None
) -> WeightsWriteError:
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path.parent)
        room = "the room left is unknown" if free is None else f"{_bytes(free)} are free there"
        message = (
            f"no space left on device writing {path}: the weights need {_bytes(total)}, "
            f"{room}; free space there or write them elsewhere"
        )
    elif code == errno.EFBIG:
        limit = file_size_limit()
        most = "no more" if limit is None else f"at most {_bytes(limit)}"
        message = (
            f"file too large writing {path}: it needs {_bytes(nbytes)}, and this process may "
            f"write files of {most} (RLIMIT_FSIZE, ulimit -f; else the file system's limit); "
            "raise the limit, or write smaller shards (max_shard_size, --max-shard-size)"
        )
    else:
        message = f"{os.strerror(code).lower()} writing {path} ({_bytes(nbytes)}): {cause}"
    out = WeightsWriteError(message)
    out.errno, out.path = code, path  # (``filename`` would replace the message in str())
    return out


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({human_bytes(n)})"


def check_room(files: list[tuple[Path, int]]) -> None:
    """Before anything is written: ``files`` (path, bytes; in one directory) fit on their
    drive together, and each under this process's file-size limit; else the
    :class:`WeightsWriteError` a write would meet."""
    if not files:
        return
    total = sum(n for _, n in files)
    files[0][0].parent.mkdir(parents=True, exist_ok=True)
    free, limit = free_bytes(files[0][0].parent), file_size_limit()
    if free is not None and free < total:
        raise _error(errno.ENOSPC, files[0][0], files[0][1], total)
    for path, nbytes in files:
        if limit is not None and nbytes > limit:
            raise _error(errno.EFBIG, path, nbytes, total)


class Output:
    """The ``.tmp`` file an output is written to (see [Note: a weights file is whole or
    absent]): :meth:`write` appends, :meth:`commit` renames it into place; leaving the block
    any other way removes it. ``total``: what the whole output needs (for the error)."""

    def __init__(self, path: Path, nbytes: int, total: int | None = None) -> None:
        self.path, self.nbytes, self.total = path, nbytes, total
        self.tmp = path.with_name(path.name + ".tmp")
        self._file: BinaryIO | None = None

    def __enter__(self) -> Output:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        e: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._discard()

    def _discard(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        with contextlib.suppress(OSError):
            self.tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def failing(self, *kinds: type[BaseException]) -> Iterator[None]:
        """Inside: an ``OSError`` (or one of ``kinds``, a writer's own) is raised as a
        :class:`WeightsWriteError` when it is a failed write (:func:`write_error`), once the
        ``.tmp`` is gone (the room it took is free again)."""
        caught: tuple[type[BaseException], ...] = (OSError, *kinds)
        try:
            yield
        except caught as e:
            self._discard()
            out = write_error(e, self.path, self.nbytes, self.total)
            if out is None:
                raise
            raise out from e

    def write(self, data: Buffer) -> None:
        """Append ``data`` (anything with the buffer protocol)."""
        view = memoryview(data).cast("B")
        with self.failing():
            if self._file is None:
                self._file = open(self.tmp, "wb", buffering=0)  # noqa: SIM115 (see _discard)
            while view:
                n = self._file.write(view)
                if not n:  # a regular file never accepts nothing; do not spin
                    raise OSError(errno.EIO, "the write accepted no bytes")
                view = view[n:]

    def commit(self) -> None:
        """The file is complete: put it in place."""
        with self.failing():
            if self._file is not None:
                self._file.close()
                self._file = None
            os.replace(self.tmp, self.path)


def stream_safetensors(
    path: Path,
    entries: list[tuple[str, torch.dtype, list[int]]],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
    total: int | None = None,
) -> None:
    """Write ``tensors`` (produced one at a time, in the order of ``entries``: name, dtype,
    shape) to ``path``, atomically (see [Note: a weights file is whole or absent]). ``total``:
    the bytes of the whole output this file is part of (shards), whose room the caller
    checked; None: this file alone, checked here."""
    header: dict[str, dict[str, object]] = {}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        header[name] = {
            "dtype": ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header = {"__metadata__": {**metadata}, **header}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    nbytes = 8 + len(blob) + offset
    if total is None:
        check_room([(path, nbytes)])
    with Output(path, nbytes, total) as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        produced = iter(tensors)
        for name, dtype, shape in entries:
            t = next(produced, None)
            if t is None or t.dtype != dtype or list(t.shape) != list(shape):
                got = "nothing" if t is None else f"{t.dtype}{list(t.shape)}"
                raise ValueError(f"{name}: got {got}, declared {dtype}{shape}")
            out.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t  # before the next tensor is produced: one in memory at a time
        if next(produced, None) is not None:
            raise ValueError(f"{path}: more tensors than the {len(entries)} declared")
        out.commit()


def _detach_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Tied weights appear under every name as one tensor; safetensors refuses shared storage.
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    return out


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes of ``state``'s tensors, a tied weight once: no more than either format
    writes (``torch.save`` writes a view's whole storage, safetensors a tied weight under each
    name), so a drive it does not fit on is refused without a false alarm."""
    seen = {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in state.values()}
    return sum(seen.values())


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` to one file: safetensors for a ``.safetensors`` path, else ``torch.save``;
    atomically (see [Note: a weights file is whole or absent])."""
    nbytes = state_bytes(state)
    check_room([(path, nbytes)])
    with Output(path, nbytes) as out:
        if path.suffix == ".safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import save_file

            tensors = _detach_shared({k: v.cpu() for k, v in state.items()})
            with out.failing(SafetensorError):
                save_file(tensors, str(out.tmp))
        else:
            with out.failing(RuntimeError):
                torch.save({k: v.cpu() for k, v in state.items()}, out.tmp)
        out.commit()
