"""What loading a checkpoint trusts: nothing in it may run code unless the caller says so.

[Note: pickles in a checkpoint]
Two kinds of content in a checkpoint are pickles: DCP's ``.metadata`` (written by
``torch.distributed.checkpoint``), and the small Python objects saved beside the shards
(``client_state``, optimizer hyper-parameters, counters, lr-scheduler and loss-scaler state,
RNG state). Unpickling calls whatever global a file names, so a planted ``__reduce__`` runs
``os.system`` as soon as the file is loaded, and fixing a checksum is all it takes to plant
one. So:

- ``.metadata`` is read by ``SafeReader``, whose unpickler resolves exactly the classes DCP's
  metadata is made of (its dataclasses and enum, ``torch.Size``, dtypes and layouts, paths)
  and refuses any other global, naming it.
- The small objects are written with ``torch.save`` and read with ``torch.load(...,
  weights_only=True)``: tensors and plain data (numbers, strings, lists, tuples, dicts) load;
  any other type is refused, naming it, unless the caller passed ``trust_checkpoint=True``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CheckpointError, first_failure

__all__ = ["SafeReader", "UntrustedContentError", "pack", "read_errors", "unpack"]

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_ALLOWED = _METADATA_CLASSES | {
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UntrustedContentError(ValueError):
    """A checkpoint or model directory holds content that needs trust to load.

    Such content is a pickled object, or a model card's factory from outside ds_strategy.
    Loading will not unpickle or run it without trust.
    """


UntrustedContentError.__module__ = "ds_strategy"


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.IOBase, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> object:  # a class, function or dtype
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedContentError(
            f"{self.source}: names {module}.{name}, which is not part of a checkpoint's "
            "metadata; refusing to load it (the file may have been crafted to run code)"
        )


class OpenFiles(Protocol):
    """A checkpoint's files held open (``pinned.PinnedCheckpoint``): read by their names
    relative to ``path``."""

    path: Path

    def open(self, name: str) -> io.BufferedReader: ...


class _PinnedFiles(FileSystem):
    """DCP's file system reading a pinned checkpoint's open files (``pinned.py``)."""

    def __init__(self, pinned: OpenFiles) -> None:
        super().__init__()
        self.pinned = pinned

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise ValueError(f"{path}: a pinned checkpoint is read only")
        with self.pinned.open(os.path.relpath(path, self.pinned.path)) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by an allow-listed unpickler; given a pinned
    checkpoint, every file is read from the descriptors it holds."""

    def __init__(self, path: str | os.PathLike, pinned: OpenFiles | None = None) -> None:
        super().__init__(path)
        if pinned is not None:
            self.fs = _PinnedFiles(pinned)

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        path = Path(str(self.path)) / ".metadata"
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UntrustedContentError(f"{path}: holds a {type(metadata).__name__}, not metadata")
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


@contextlib.contextmanager
def read_errors(path: Path) -> Iterator[None]:
    """DCP's failure while reading ``path`` (a ``CheckpointException``, a ``BaseException``
    that ``except Exception`` misses) as a :class:`CheckpointError` naming the checkpoint and
    the first failing rank's error."""
    try:
        yield
    except CheckpointException as e:
        rank, cause = first_failure(e, -1)
        where = f" on rank {rank}" if rank >= 0 else ""
        raise CheckpointError(
            f"{path}: reading the checkpoint failed{where}: {type(cause).__name__}: {cause}; "
            "the checkpoint does not match this model, or a file is damaged"
        ) from None


def pack(obj: object) -> torch.Tensor:
    """A Python object as a uint8 tensor (DCP would otherwise flatten nested dicts and lists
    into keys named after their contents), in ``torch.save``'s format."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: torch.Tensor, where: str, trusted: bool) -> object:
    """The object ``pack`` wrote; without ``trusted`` only tensors and plain data load."""
    return loads(t.numpy().tobytes(), where, trusted)


def loads(data: bytes, where: str, trusted: bool) -> object:
    """An object ``torch.save`` wrote (``where`` names it in errors); without ``trusted``
    only tensors and plain data load. An empty or cut-short file (a save killed while
    writing it) is a ``CheckpointError`` saying so, never a question of trust."""
    zip_start = b"PK\x03\x04"  # torch.save's format is a zip archive
    if not data:
        raise CheckpointError(f"{where}: empty (a save was interrupted while writing it)")
    cut_short = CheckpointError(
        f"{where}: truncated ({len(data)} bytes: a save was interrupted while writing it, or "
        "the file was cut short since); load another checkpoint"
    )
    if zip_start.startswith(data):
        raise cut_short
    if not data.startswith(b"PK"):  # a bare pickle (not torch.save's zip): never untrusted
        if not trusted:
            raise UntrustedContentError(
                f"{where}: stored as a bare pickle, which loading does not unpickle unless the "
                "checkpoint is trusted; pass trust_checkpoint=True if you trust who wrote it"
            )
        try:
            return pickle.loads(data)
        except (EOFError, pickle.UnpicklingError) as e:
            if isinstance(e, EOFError) or "truncated" in str(e):
                raise cut_short from None
            raise
    try:
        return torch.load(io.BytesIO(data), weights_only=not trusted)
    except RuntimeError as e:  # the zip reader: its central directory, at the end, is gone
        if "zip archive" in str(e) or "central directory" in str(e):
            raise cut_short from None
        raise
    except pickle.UnpicklingError as e:
        refused = refused_global(str(e))
        raise UntrustedContentError(
            f"{where}: holds {refused}, which loading does not unpickle unless the checkpoint "
            "is trusted (only tensors and plain data load by default); pass "
            "trust_checkpoint=True if you trust who wrote it"
        ) from None


def refused_global(message: str) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", message)
    return found.group(1) if found else "an object of a type that is not plain data"
