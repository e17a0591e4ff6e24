"""Turn a sharded checkpoint into one file the plain model loads with ``load_state_dict``.

[Note: bounded memory]
The output is written tensor by tensor: each parameter is read from the shards through
DCP (only the chunks of that one tensor), converted, written and dropped, so peak memory is
about two copies of the largest single tensor (the chunks DCP reads, then the tensor they
fill; one more for a dtype conversion), never the whole model. A ``.safetensors`` file is
written by hand in its documented layout (an 8-byte little-endian header length, a JSON
header of dtypes, shapes and byte offsets, then the raw tensors back to back), which is what
allows streaming. A ``.pt`` file is one pickle that ``torch.save`` writes from a dict of
tensors, so it is built in memory: its peak is the whole model's weights. Prefer
``.safetensors`` for large models (``benchmarks/bench_consolidate.py`` measures both).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .keys import MODEL_KINDS, EntryKey
from .manager import resolve_sources
from .store import single_process_ok
from .trust import SafeReader
from .validate import META_FILE, check_files
from .weights_file import stream_safetensors

__all__ = ["consolidate"]


def _entries(reader: SafeReader) -> dict[EntryKey, TensorStorageMetadata]:
    """The weights and buffers a checkpoint holds."""
    md = reader.read_metadata().state_dict_metadata
    out = {}
    for key, m in md.items():
        entry = EntryKey.parse(key)
        if entry is not None and entry.kind in MODEL_KINDS and isinstance(m, TensorStorageMetadata):
            out[entry] = m
    return out


def _shapes(path: Path) -> dict[str, list[int]]:
    meta = json.loads((path / META_FILE).read_text())
    return meta.get("shapes", {})


def _by_name(entries: dict[EntryKey, TensorStorageMetadata]) -> list[EntryKey]:
    return sorted(entries, key=lambda entry: entry.text)


def _stream(
    path: Path, dtype: torch.dtype | None, keys: set[EntryKey]
) -> Iterator[tuple[str, torch.Tensor]]:
    reader = SafeReader(path)
    shapes = _shapes(path)
    entries = _entries(reader)
    for entry in _by_name(entries):
        if entry not in keys:
            continue
        m = entries[entry]
        t = torch.empty(m.size, dtype=m.properties.dtype)
        with single_process_ok(False):
            dcp.load({entry.text: t}, storage_reader=SafeReader(path), no_dist=True)
        name = entry.param
        if name in shapes:
            t = t.view(shapes[name])
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield name, t
        del t  # before the next tensor is allocated


def consolidate(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    dtype: torch.dtype | None = torch.float32,
    require_checksums: bool = True,
) -> Path:
    """Write the weights of a sharded checkpoint to one ``.safetensors`` or ``.pt`` file.

    >>> ds_strategy.consolidate("ckpt/step100", "model.safetensors")  # doctest: +SKIP

    Runs in one process, with no process group, whatever world size wrote the checkpoint.
    ``checkpoint_dir`` may be a checkpoint root: its ``latest`` checkpoint is exported; or a
    pipeline checkpoint's root: its stages' layers together, as one model. Every
    file is checked against the sizes and checksums recorded at save time first.
    ``dtype`` converts floating-point tensors (``None`` keeps the saved dtype);
    ``require_checksums=False`` accepts a checkpoint that records no checksums. Tied weights
    appear once, under their first name; ``load_state_dict(strict=False)`` or re-tying after
    loading restores the other name.
    """
    out = Path(output_path)
    if out.suffix not in (".safetensors", ".pt", ".pth", ".bin") or out.is_dir():
        raise ValueError(
            f"output {str(output_path)!r}: choose a .safetensors, .pt, .pth or .bin file name"
        )
    if not str(checkpoint_dir) or not Path(checkpoint_dir).is_dir():
        raise FileNotFoundError(
            f"checkpoint {str(checkpoint_dir)!r}: no such directory (give one written by "
            "save_checkpoint, its root, or a pipeline checkpoint's root)"
        )
    sources = resolve_sources(Path(checkpoint_dir).absolute(), None)
    for src in sources:
        if not (src / META_FILE).is_file():
            raise FileNotFoundError(
                f"{src}: not a ds_strategy checkpoint directory (no ds_strategy.json)"
            )
        # a damaged file is an error naming it, never a silently wrong export
        check_files(src, require_checksums)
    if out.suffix == ".safetensors":
        _write_safetensors(sources, out, dtype)
    else:
        torch.save(dict(_stream_all(sources, dtype)), out)
    return out


def _owned(sources: list[Path]) -> list[tuple[Path, dict[EntryKey, TensorStorageMetadata]]]:
    """Each checkpoint's entries that no earlier one has (a pipeline's stages hold disjoint
    layers; only a weight tied across stages is in two of them, under two names)."""
    seen: set[EntryKey] = set()
    out = []
    for src in sources:
        entries = {k: m for k, m in _entries(SafeReader(src)).items() if k not in seen}
        seen.update(entries)
        out.append((src, entries))
    return out


def _stream_all(
    sources: list[Path], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for src, entries in _owned(sources):
        yield from _stream(src, dtype, set(entries))


def _write_safetensors(sources: list[Path], out: Path, dtype: torch.dtype | None) -> None:
    entries = []
    for src, owned in _owned(sources):
        shapes = _shapes(src)
        for entry in _by_name(owned):
            m, name = owned[entry], entry.param
            t_dtype = m.properties.dtype
            if dtype is not None and t_dtype.is_floating_point:
                t_dtype = dtype
            entries.append((name, t_dtype, shapes.get(name, list(m.size))))
    stream_safetensors(out, entries, (t for _, t in _stream_all(sources, dtype)))
