"""Where inference reads weights from, a slice at a time: a ``.safetensors`` file, a directory
of them (Hugging Face's sharded layout with its ``model.safetensors.index.json``, or any set of
files), or a ds_strategy checkpoint of any world size, ZeRO stage or tensor-parallel layout.

[Note: reading only a part]
A loader asks for rows ``[r0, r1)`` (and, for a tensor-parallel row-wise split, columns
``[c0, c1)``) of one tensor, or for elements ``[lo, hi)`` of it flattened (a ZeRO shard).
safetensors files are memory-mapped and sliced (``safe_open(...).get_slice``), so only those
bytes are read. A ds_strategy checkpoint stores every tensor flattened, in 1-D chunks from
whichever ranks saved them (``checkpoint/flat_piece.py``); a read is one ``FlatPiece`` run per
requested row segment, and DCP reads just the saved chunks that overlap it. No source ever
materialises a whole model.
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..checkpoint import swap
from ..checkpoint.flat_piece import FlatPiece
from ..checkpoint.manager import resolve_load_dir, resolve_sources, stage_dirs
from ..checkpoint.pinned import pin_agreed
from ..checkpoint.sharded import single_process_ok
from ..checkpoint.trust import SafeReader
from ..checkpoint.validate import META_FILE, validate
from ..checkpoint.weights_source import SAFETENSORS_DTYPES
from ..collectives import Comm
from .building import ModelFileError, inside

if TYPE_CHECKING:
    from safetensors import safe_open

__all__ = [
    "CheckpointSource",
    "ModuleSource",
    "SafetensorsSource",
    "UnionSource",
    "WeightSource",
    "open_source",
    "source_kind",
]


class WeightSource(abc.ABC):
    """A read-only set of named tensors (see the note above). ``metadata``: the file's
    string metadata (a quantized export's format lives there)."""

    metadata: dict[str, str]

    @abc.abstractmethod
    def names(self) -> list[str]: ...

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def dtype(self, name: str) -> torch.dtype: ...

    @abc.abstractmethod
    def read(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        """Rows ``rows`` (of dimension 0) and, when given, columns ``cols`` (dimension 1)."""

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor, through the rows that hold them."""
        shape = self.shape(name)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        r0, r1 = lo // row, -(-hi // row)
        if len(shape) == 0:
            return self.read(name, slice(None)).reshape(-1)[lo:hi]
        part = self.read(name, slice(r0, r1)).reshape(-1)
        return part[lo - r0 * row : hi - r0 * row]

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def close(self) -> None:
        """Let go of what the source holds open (its metadata here; files in subclasses)."""
        self.metadata = {}


@dataclass(frozen=True)
class HFIndex:
    """A sharded model's ``model.safetensors.index.json``: each tensor's file, resolved and
    confined to the model directory."""

    path: Path
    weight_map: dict[str, Path]

    @classmethod
    def read(cls, path: Path) -> HFIndex:
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelFileError(f"{path}: not valid JSON ({err})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFileError(
                f"{path}: expected an object with a non-empty 'weight_map' of tensor name -> "
                "file name"
            )
        files = {}
        for name, file in weight_map.items():
            files[name] = inside(path.parent, file, f"{path} weight_map[{name!r}]")
        for file in set(files.values()):
            try:
                missing = not file.is_file()
            except OSError as err:  # a name too long for the file system
                raise ModelFileError(
                    f"{path}: weight_map names {file.name!r}: {err.strerror}"
                ) from None
            if missing:
                raise ModelFileError(f"{path}: weight_map names {file.name}, which is missing")
        return cls(path, files)


class _Slice(Protocol):
    """What ``safe_open(...).get_slice`` returns (safetensors' stub leaves it untyped)."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...

    def __getitem__(self, index: slice | tuple[slice, slice]) -> torch.Tensor: ...


class SafetensorsSource(WeightSource):
    """One or more ``.safetensors`` files, memory-mapped and read by slices."""

    def __init__(self, files: Iterable[Path], where: Path, index: HFIndex | None = None) -> None:
        """``index``: a sharded model's index; each tensor it names is read from the file it
        names (and only those tensors exist)."""
        from safetensors import safe_open

        self.where = where
        self._files: dict[str, safe_open] = {}
        self._handles = []
        self.metadata = {}
        by_path: dict[Path, safe_open] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ModelFileError(f"{path}: not a readable .safetensors file ({e})") from e
            self._handles.append(handle)
            by_path[path] = handle
            self.metadata.update(handle.metadata() or {})
            if index is None:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._files[key] = handle
        for name, path in (index.weight_map if index is not None else {}).items():
            assert index is not None  # the loop runs over its weight_map only
            handle = by_path[path]
            if name not in handle.keys():  # noqa: SIM118
                raise ModelFileError(
                    f"{index.path}: weight_map names {path.name} for {name!r}, which that file "
                    "does not hold"
                )
            self._files[name] = handle
        if not self._files:
            raise ModelFileError(f"{where}: holds no tensors")
        for name, handle in self._files.items():
            kind = handle.get_slice(name).get_dtype()
            if kind not in SAFETENSORS_DTYPES:
                raise ModelFileError(
                    f"{where}: tensor {name!r} is stored as {kind}, which torch cannot hold "
                    f"(readable: {', '.join(SAFETENSORS_DTYPES)})"
                )

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def close(self) -> None:
        self._files, self._handles = {}, []

    def _slice(self, name: str) -> _Slice:
        handle = self._files.get(name)
        if handle is None:
            raise KeyError(f"{self.where}: no tensor named {name!r}")
        return handle.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._slice(name).get_dtype()]

    def read(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        s = self._slice(name)
        if len(s.get_shape()) == 0:
            return self._files[name].get_tensor(name).clone()
        # a slice may be a view of the file's mapping: a copy owns its memory, so nothing the
        # engine keeps depends on the file after loading
        return (s[rows] if cols is None else s[rows, cols]).clone()


class CheckpointSource(WeightSource):
    """A checkpoint written by ``engine.save_checkpoint`` (parameters and persistent buffers;
    fp32 masters when it was trained in mixed precision). Checked first on every rank (sizes,
    checksums split over the ranks, allow-listed metadata)."""

    def __init__(self, path: Path, comm: Comm, require_checksums: bool = True) -> None:
        self.path = path
        self.metadata = {}
        # held open while the source lives: a save replacing the directory meanwhile changes
        # nothing read from it (checkpoint/pinned.py)
        (self.pinned,) = pin_agreed(comm, lambda: [swap.committed(path)], require_checksums)
        entries = validate(self.pinned, comm, None, require_checksums)
        saved_shapes: dict[str, list[int]] = self.pinned.meta.get("shapes") or {}
        self._entries: dict[str, tuple[str, torch.Size, torch.dtype]] = {}
        for key, m in entries.items():
            prefix, _, name = key.partition("/")
            if prefix in ("model", "buffer") and isinstance(m, TensorStorageMetadata):
                shape = torch.Size(saved_shapes.get(name, list(m.size)))
                self._entries[name] = (key, shape, m.properties.dtype)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> tuple[str, torch.Size, torch.dtype]:
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"{self.path}: the checkpoint holds no tensor named {name!r}")
        return entry

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[1])

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[2]

    def read(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        key, shape, dtype = self._entry(name)
        if len(shape) == 0:
            return self._load(key, dtype, shape.numel(), [(0, 0, 1)]).view(())
        r0, r1, _ = rows.indices(shape[0])
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        if cols is None:
            out = self._load(key, dtype, shape.numel(), [(0, r0 * row, (r1 - r0) * row)])
            return out.view(r1 - r0, *shape[1:])
        c0, c1, _ = cols.indices(shape[1])
        inner = math.prod(shape[2:]) if len(shape) > 2 else 1
        width = (c1 - c0) * inner
        runs = [(i * width, (r0 + i) * row + c0 * inner, width) for i in range(r1 - r0)]
        out = self._load(key, dtype, shape.numel(), runs)
        return out.view(r1 - r0, c1 - c0, *shape[2:])

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        key, shape, dtype = self._entry(name)
        return self._load(key, dtype, shape.numel(), [(0, lo, hi - lo)])

    def _load(
        self, key: str, dtype: torch.dtype, numel: int, runs: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        out = torch.empty(sum(n for _, _, n in runs), dtype=dtype)
        if out.numel() == 0:
            return out
        piece = FlatPiece(out, runs[0][1], numel, runs=runs)
        with single_process_ok(False):
            dcp.load(
                {key: piece}, storage_reader=SafeReader(self.path, pinned=self.pinned), no_dist=True
            )
        return out


class ModuleSource(WeightSource):
    """A model's own tensors (parameters and persistent buffers), taken from it by
    :meth:`take`, which leaves the model's parameters on the meta device, so a model given with
    its weights is placed like any other."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.metadata = {}

    @staticmethod
    def take(model: torch.nn.Module) -> ModuleSource:
        tensors = {k: t.detach() for k, t in model.state_dict(keep_vars=True).items()}
        on_meta: dict[int, torch.nn.Parameter] = {}
        for m in model.modules():
            for attr, p in m._parameters.items():
                if p is not None and id(p) not in on_meta:
                    on_meta[id(p)] = torch.nn.Parameter(p.detach().to("meta"), p.requires_grad)
                if p is not None:
                    m._parameters[attr] = on_meta[id(p)]
        return ModuleSource(tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        t = self.tensors[name]
        if t.dim() == 0:
            return t
        return t[rows] if cols is None else t[rows, cols]

    def close(self) -> None:
        self.tensors = {}  # the model's original storage goes once the engine holds its own


class UnionSource(WeightSource):
    """Several sources read as one (a pipeline checkpoint's stages: each holds its layers
    under their names in the whole ``nn.Sequential``; a weight tied across stages is in
    several, and read from the first)."""

    def __init__(self, parts: list[WeightSource], where: Path) -> None:
        self.parts, self.where = parts, where
        self.metadata = {}
        self._owner: dict[str, WeightSource] = {}
        for part in parts:
            for name in part.names():
                self._owner.setdefault(name, part)

    def names(self) -> list[str]:
        return list(self._owner)

    def __contains__(self, name: str) -> bool:
        return name in self._owner

    def _part(self, name: str) -> WeightSource:
        part = self._owner.get(name)
        if part is None:
            raise KeyError(f"{self.where}: no tensor named {name!r}")
        return part

    def shape(self, name: str) -> tuple[int, ...]:
        return self._part(name).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._part(name).dtype(name)

    def read(self, name: str, rows: slice, cols: slice | None = None) -> torch.Tensor:
        return self._part(name).read(name, rows, cols)

    def read_flat(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self._part(name).read_flat(name, lo, hi)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def source_kind(path: str | Path) -> tuple[str, Path]:
    """``("checkpoint", its directory)``, ``("pipeline", its root)`` or ``("safetensors",
    path)``: what :func:`open_source` will read, checked without reading it (local work,
    before any rank opens a checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory (expected weights to load)")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(
                f"{p}: weights are read from .safetensors files or ds_strategy checkpoints "
                "(a pickled .bin / .pt file can run code when loaded; convert it to "
                "safetensors first)"
            )
        return "safetensors", p
    if stage_dirs(p):  # (a pipeline's root has a ``latest`` of its own too)
        return "pipeline", p
    if (p / META_FILE).is_file() or (p / "latest").is_file():
        return "checkpoint", resolve_load_dir(p, None)
    return "safetensors", p


def open_source(path: str | Path, comm: Comm, require_checksums: bool = True) -> WeightSource:
    """The weights at ``path``: a ds_strategy checkpoint directory (or a root whose ``latest``
    names one), a pipeline checkpoint's root (its ``stage_<k>`` checkpoints; both collective:
    the ranks check them together), a ``.safetensors`` file, or a directory of
    ``.safetensors`` files (a Hugging Face model directory, sharded or not)."""
    kind, p = source_kind(path)
    if kind == "checkpoint":
        return CheckpointSource(p, comm, require_checksums)
    if kind == "pipeline":
        stages = [CheckpointSource(d, comm, require_checksums) for d in resolve_sources(p, None)]
        return UnionSource(list(stages), p)
    if p.is_file():
        return SafetensorsSource([p], p)
    index_file = p / "model.safetensors.index.json"
    if index_file.is_file():
        index = HFIndex.read(index_file)
        return SafetensorsSource(sorted(set(index.weight_map.values())), p, index)
    files = sorted(p.glob("*.safetensors"))
    if files:
        return SafetensorsSource(files, p)
    found = ", ".join(sorted(f.name for f in p.iterdir())[:8]) or "nothing"
    raise FileNotFoundError(
        f"{p}: no weights found (a ds_strategy checkpoint has {META_FILE}, a model directory "
        f".safetensors files; found {found})"
    )
