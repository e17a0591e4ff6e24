"""Consolidated weights as Hugging Face writes them: one file, or, under a size limit, shards
``model-00001-of-0000N.safetensors`` ... beside an index ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), which
``transformers``' ``from_pretrained`` and ``safetensors`` read. Each tensor comes from a reader
one at a time (:func:`write_weight_files`), so a ``.safetensors`` export holds one tensor in
memory, a ``.pt`` / ``.bin`` one shard.

[Note: how shards are filled]
As ``huggingface_hub.split_torch_state_dict_into_shards``, which ``save_pretrained`` and
DeepSpeed's ``zero_to_fp32.py`` call, so the same state gives the same files: tensors are taken
in order and fill the current shard; one that would take it over the limit closes it and starts
the next; one larger than the limit alone gets a shard of its own, numbered where it is met
(the shard being filled goes on after it). Shards are numbered ``-00001-of-0000N`` from 1; a
single shard is the output name itself, with no index. A tied weight's other names share its
storage there: they join the shard of the name they are saved under and count once, in that
shard's size and in ``total_size``. safetensors refuses shared storage, so a ``.safetensors``
shard holds each such name as its own copy; a ``.pt`` shard shares the tensor, as ``torch.save``
of a state dict does.

Every file goes through a ``.tmp`` renamed into place (``weights_file.py``, [Note: a weights
file is whole or absent]); the room for all of them is checked before the first is written.
When a write fails, the shards this export already wrote are removed too: without their
index they are no export, and the room they take is what the user must find.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .weights_file import Output, WeightsWriteError, check_room, stream_safetensors

__all__ = [
    "WeightEntry",
    "index_path",
    "parse_size",
    "plan_shards",
    "shard_paths",
    "write_weight_files",
]

# the units huggingface_hub's parse_size_to_int knows (decimal), and the binary ones
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "B": 1})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_SHARD = re.compile(r"^-\d{5}-of-\d{5}$")


@dataclass(frozen=True)
class WeightEntry:
    """One tensor of the output: its name, dtype and shape as written, and for a tied weight's
    other name the name it is saved (and read) under."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    tied_to: str | None = None

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize

    @property
    def source(self) -> str:
        """The name the tensor is read under."""
        return self.tied_to or self.name


def parse_size(size: int | str) -> int:
    """Bytes of a shard-size limit: an int, or ``"5GB"``, ``"500MB"``, ``"10KB"`` (powers of
    1000, as Hugging Face reads them), ``"2GiB"`` (powers of 1024), ``"1000"`` (bytes)."""
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise ValueError(f"max_shard_size {size!r}: give bytes as an int or a size like '5GB'")
    if isinstance(size, str):
        m = _SIZE.match(size)
        unit = m.group(2).upper() if m else ""
        if m is None or (unit and unit not in _UNITS):
            raise ValueError(
                f"max_shard_size {size!r}: not a size; write digits and a unit, like '5GB', "
                "'500MB', '10KB' or '2GiB', or a number of bytes"
            )
        size = int(float(m.group(1)) * _UNITS.get(unit, 1))
    if size <= 0:
        raise ValueError(f"max_shard_size {size!r}: a shard's limit must be at least 1 byte")
    return size


def plan_shards(entries: list[WeightEntry], max_bytes: int | None) -> list[list[WeightEntry]]:
    """``entries`` cut into shards of at most ``max_bytes`` each (see [Note: how shards are
    filled]); ``None``: one shard."""
    primary = [e for e in entries if e.tied_to is None]
    if max_bytes is None:
        shards = [primary]
    else:
        shards, used = [], 0
        current: list[WeightEntry] = []
        for e in primary:
            if e.nbytes > max_bytes:
                shards.append([e])
                continue
            if current and used + e.nbytes > max_bytes:
                shards.append(current)
                current, used = [], 0
            current.append(e)
            used += e.nbytes
        if current or not shards:
            shards.append(current)
    where = {e.name: shard for shard in shards for e in shard}
    for e in entries:
        if e.tied_to is not None and e.tied_to in where:
            where[e.tied_to].append(e)
    return shards


def shard_paths(out: Path, count: int) -> list[Path]:
    """The files of ``count`` shards of ``out``: ``out`` itself for one, else
    ``<stem>-00001-of-0000N<suffix>`` beside it."""
    if count == 1:
        return [out]
    return [
        out.with_name(f"{out.stem}-{i:05d}-of-{count:05d}{out.suffix}") for i in range(1, count + 1)
    ]


def index_path(out: Path) -> Path:
    """The index of ``out``'s shards: ``model.safetensors.index.json`` for ``model.safetensors``."""
    return out.with_name(out.name + ".index.json")


def write_weight_files(
    out: Path,
    entries: list[WeightEntry],
    read: Callable[[str], torch.Tensor],
    max_shard_size: int | str | None = None,
) -> list[Path]:
    """Write ``entries`` to ``out`` (``.safetensors``, else ``torch.save``), or to shards of at
    most ``max_shard_size`` with their index; ``read(name)`` gives one entry's tensor, as
    declared, and is called once per written tensor. Returns the files written, the index
    last. Shards of an earlier export of ``out`` that this one does not replace, and its
    index when this one has none, are removed, as ``save_pretrained`` does."""
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    shards = plan_shards(entries, limit)
    paths = shard_paths(out, len(shards))
    streamed = out.suffix == ".safetensors"
    sizes = [_shard_bytes(shard, streamed) for shard in shards]
    check_room(list(zip(paths, sizes, strict=True)))
    _remove_stale(out, paths)
    written: list[Path] = []
    try:
        for path, shard in zip(paths, shards, strict=True):
            if streamed:
                _stream_shard(path, shard, read, sum(sizes))
            else:
                _save_shard(path, shard, read, sum(sizes))
            written.append(path)
        if len(paths) > 1:
            _write_index(out, entries, paths, shards)
    except WeightsWriteError:
        for p in written:  # see the note
            p.unlink(missing_ok=True)
        raise
    return paths if len(paths) == 1 else [*paths, index_path(out)]


def _shard_bytes(shard: list[WeightEntry], streamed: bool) -> int:
    """What the shard's file takes but its header or framing (so a check never refuses a
    drive it fits on): a ``.safetensors`` file copies a tied weight under each of its names,
    a ``.pt`` one stores it once."""
    return sum(e.nbytes for e in shard if streamed or e.tied_to is None)


def _write_index(
    out: Path, entries: list[WeightEntry], paths: list[Path], shards: list[list[WeightEntry]]
) -> None:
    weight_map = {e.name: p.name for p, shard in zip(paths, shards, strict=True) for e in shard}
    total = sum(e.nbytes for e in entries if e.tied_to is None and e.name in weight_map)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    text = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    with Output(index_path(out), len(text)) as f:
        f.write(text)
        f.commit()


def _stream_shard(
    path: Path, shard: list[WeightEntry], read: Callable[[str], torch.Tensor], total: int
) -> None:
    declared = [(e.name, e.dtype, list(e.shape)) for e in shard]
    tensors = (read(e.source) for e in shard)
    stream_safetensors(path, declared, tensors, metadata={"format": "pt"}, total=total)


def _save_shard(
    path: Path, shard: list[WeightEntry], read: Callable[[str], torch.Tensor], total: int
) -> None:
    state: dict[str, torch.Tensor] = {}
    for e in shard:
        state[e.name] = state[e.source] if e.source in state else read(e.source)
    with Output(path, _shard_bytes(shard, streamed=False), total) as f:
        with f.failing(RuntimeError):  # torch.save's own error for a failed write
            torch.save(state, f.tmp)
        f.commit()


def _remove_stale(out: Path, keep: list[Path]) -> None:
    """An earlier export's files that would be read with or instead of this one's: its
    shards, its index when this export is one file, the one file when this export is shards
    (``from_pretrained`` prefers it to an index)."""
    if not out.parent.is_dir():
        return
    sharded = len(keep) > 1
    for p in out.parent.iterdir():
        if p in keep or not p.is_file():
            continue
        rest = p.name[len(out.stem) :].removesuffix(out.suffix)
        shard = p.name.startswith(out.stem) and p.name.endswith(out.suffix) and _SHARD.match(rest)
        if shard or p == (out if sharded else index_path(out)):
            p.unlink()
