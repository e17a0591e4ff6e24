"""Reading pretrained weights a range at a time: a ``.safetensors`` file, a ``torch.save``'d
state dict (``.bin`` / ``.pt``), or a Hugging Face model directory (one file, or shards beside
a ``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``).

[Note: reading only a rank's bytes]
A rank of a sharded engine holds ranges of flattened parameters (``seam.py``'s runs), so the
reader answers one question: elements ``[start, start + length)`` of the flattened tensor
``name``, into a destination of any dtype. A safetensors file is an 8-byte header size, a JSON
header (each tensor's dtype, shape and byte range) and the raw little-endian bytes, so a range
is one ``pread`` at a computed offset: nothing else of the file is read, and nothing of it is
mapped into the process. When the destination has the file's dtype the bytes land in it
directly; otherwise they pass through a bounded buffer (:data:`CHUNK` elements) and are cast.
A ``torch.save`` file has no such layout: it is opened with ``mmap=True``, so a range reads
the pages it covers (file-backed, not the process's own memory).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..offload.swap import _buffer
from .errors import CheckpointError

__all__ = ["CHUNK", "SAFETENSORS_DTYPES", "PretrainedFiles", "open_weights"]

CHUNK = 1 << 22  # elements cast at a time: 16 MiB of fp32

# a safetensors header's dtype names (also read by core/inference/sources.py)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# what a directory may hold, in the order from_pretrained prefers them
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file: where its bytes start in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte, from the start of the file


class _SafetensorsFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, _Entry] = {}
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                (n,) = struct.unpack("<Q", f.read(8))
                if not 2 <= n <= min(_MAX_HEADER, size - 8):
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
            start = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
                if end - begin != torch.Size(shape).numel() * dtype.itemsize or start + end > size:
                    raise ValueError(f"tensor '{name}': its byte range does not fit its shape")
                self.entries[name] = _Entry(dtype, shape, start + begin)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise CheckpointError(
                f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                "write it again with save_pretrained or safetensors.torch.save_file"
            ) from e
        self._fd: int | None = None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        e = self.entries[name]
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        at = e.offset + start * e.dtype.itemsize
        if out.dtype == e.dtype and out.is_contiguous():
            self._pread(_buffer(out), at)
            return
        buf = torch.empty(min(CHUNK, out.numel()), dtype=e.dtype)
        for i in range(0, out.numel(), CHUNK):
            part = buf[: min(CHUNK, out.numel() - i)]
            self._pread(_buffer(part), at + i * e.dtype.itemsize)
            out[i : i + part.numel()].copy_(part)

    def _pread(self, view: memoryview, at: int) -> None:
        assert self._fd is not None
        done = 0
        while done < len(view):  # one call reads at most about 2 GiB
            got = os.preadv(self._fd, [view[done : done + (1 << 30)]], at + done)
            if got <= 0:
                raise CheckpointError(f"{self.path}: ended at byte {at + done} (truncated?)")
            done += got

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _TorchFile:
    """A ``torch.save``'d state dict, memory-mapped; tensors only (``weights_only``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same message
            raise CheckpointError(
                f"{path}: not a readable torch state dict ({type(e).__name__}: {e})"
            ) from e
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]  # a Lightning-style file
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict")
        self.entries = {k: v for k, v in state.items() if torch.is_tensor(v)}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        flat = self.entries[name].reshape(-1)
        for i in range(0, out.numel(), CHUNK):
            n = min(CHUNK, out.numel() - i)
            out[i : i + n].copy_(flat[start + i : start + i + n])

    def close(self) -> None:
        self.entries.clear()


class PretrainedFiles:
    """The tensors of one pretrained checkpoint, whatever files hold them (see the note)."""

    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        self.path = path
        self._files: dict[Path, _SafetensorsFile | _TorchFile] = {}
        self._where: dict[str, _SafetensorsFile | _TorchFile] = {}
        for name, file in files.items():
            if file not in self._files:
                self._files[file] = _open_file(file)
            if name not in self._files[file].entries:
                raise CheckpointError(
                    f"{path}: the index puts '{name}' in {file.name}, which does not hold it"
                )
            self._where[name] = self._files[file]
        # a tensor the model names that the files hold as several (transformers' fused
        # experts, from one tensor per expert): its parts in order, and its shape
        self._views: dict[str, tuple[list[str], tuple[int, ...]]] = {}

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._views

    def add_view(self, name: str, parts: list[str], shape: tuple[int, ...]) -> None:
        """Read ``name`` as ``parts`` flattened one after another, viewed as ``shape``.

        Args:
            name: the name the model gives the whole.
            parts: the files' tensors, in the whole's flattened order.
            shape: the whole's shape; its elements are the parts' together.
        """
        total = sum(math.prod(self.shape(p)) for p in parts)
        if total != math.prod(shape):
            raise CheckpointError(
                f"{self.path}: {parts[:2]}... hold {total} elements together, and "
                f"'{name}' of shape {list(shape)} needs {math.prod(shape)}"
            )
        self._views[name] = (parts, shape)

    def parts_of(self, name: str) -> list[str]:
        """The files' tensors ``name`` is read from: itself, or a view's parts.

        Args:
            name: a name the source holds.
        """
        return self._views[name][0] if name in self._views else [name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._views:
            return self._views[name][1]
        return self._where[name].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._where[self.parts_of(name)[0]].dtype(self.parts_of(name)[0])

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of ``name`` flattened, cast into ``out``
        (1-D)."""
        if name not in self._views:
            self._where[name].read(name, start, out)
            return
        base, end = 0, start + out.numel()
        for part in self._views[name][0]:  # the parts' elements that fall in the range
            n = math.prod(self.shape(part))
            lo, hi = max(start, base), min(end, base + n)
            if lo < hi:
                self._where[part].read(part, lo - base, out[lo - start : hi - start])
            base += n

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> PretrainedFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_file(path: Path) -> _SafetensorsFile | _TorchFile:
    return _SafetensorsFile(path) if path.suffix == ".safetensors" else _TorchFile(path)


def open_weights(path: str | os.PathLike) -> PretrainedFiles:
    """The pretrained weights at ``path``: a weights file, or a model directory as
    ``save_pretrained`` writes it (an index and its shards, or one file; safetensors first).

    >>> open_weights("no/such/dir")
    Traceback (most recent call last):
    ...
    ds_strategy.core.checkpoint.errors.CheckpointError: no/such/dir: no such file or directory
    """
    p = Path(path)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return PretrainedFiles(p.parent, _indexed(p))
        source = _open_file(p)
        return PretrainedFiles(p, dict.fromkeys(source.entries, p))
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such file or directory")
    for name in _INDEXES:
        if (p / name).is_file():
            return PretrainedFiles(p, _indexed(p / name))
    for name in _SINGLES:
        if (p / name).is_file():
            return open_weights(p / name)
    found = sorted(q.name for q in p.iterdir() if q.suffix in (".safetensors", ".bin", ".pt"))
    raise CheckpointError(
        f"{p}: holds no model weights as save_pretrained writes them ({', '.join(_SINGLES)} "
        f"or an index); weight files here: {found or 'none'}; pass the file itself"
    )


def _indexed(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {str(k): index.parent / str(v) for k, v in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a weights index ({type(e).__name__}: {e})") from e
    for name, file in files.items():
        if file.parent != index.parent or not file.is_file():
            raise CheckpointError(
                f"{index}: '{name}' is in {file.name}, which is not a file beside the index"
            )
    return files
