"""Consolidated weights to one file: ``.safetensors`` (safetensors) or anything else
(``torch.save``). What ``engine.save_weights`` writes, for either engine; and
:func:`stream_safetensors`, which writes one tensor at a time.

[Note: streaming a .safetensors file]
The format is an 8-byte little-endian header length, a JSON header of dtypes, shapes and byte
offsets (plus optional string ``__metadata__``), then the raw tensors back to back. Once the
names, dtypes and shapes are known the header can be written first and each tensor appended
as it is produced, so peak memory is one tensor, never the whole model (``safetensors``'
``save_file`` takes the whole dict at once).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["ST_DTYPES", "stream_safetensors", "write_weights"]

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


def stream_safetensors(
    path: Path,
    entries: list[tuple[str, torch.dtype, list[int]]],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``tensors`` (produced one at a time, in the order of ``entries``: name, dtype,
    shape) to ``path``, atomically (a temporary file renamed into place)."""
    header: dict[str, dict] = {}
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
        header = {"__metadata__": dict(metadata), **header}  # type: ignore[dict-item]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        produced = iter(tensors)
        for name, dtype, shape in entries:
            t = next(produced, None)
            if t is None or t.dtype != dtype or list(t.shape) != list(shape):
                got = "nothing" if t is None else f"{t.dtype}{list(t.shape)}"
                raise ValueError(f"{name}: got {got}, declared {dtype}{shape}")
            f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
            del t  # before the next tensor is produced: one in memory at a time
        if next(produced, None) is not None:
            raise ValueError(f"{path}: more tensors than the {len(entries)} declared")
    tmp.rename(path)


def _detach_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Tied weights appear under every name as one tensor; safetensors refuses shared storage.
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    return out


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` to one file: safetensors for a ``.safetensors`` path, else ``torch.save``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(_detach_shared({k: v.cpu() for k, v in state.items()}), str(path))
    else:
        torch.save({k: v.cpu() for k, v in state.items()}, path)
