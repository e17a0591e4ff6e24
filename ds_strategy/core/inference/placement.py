"""Filling a meta-device model from a weight source: which source tensor (and which part of
it) each parameter comes from, and the two placements, whole parameters on every rank (plain
or tensor-parallel inference) or ZeRO-3 shards (ZeRO-Inference).

[Note: every rank reads only what it keeps]
A parameter is filled by rows: a whole parameter reads all of its (local) rows, a ZeRO shard
only the rows that hold its elements ``[lo, hi)`` of each parameter it covers. A
tensor-parallel part maps its rows (column-wise: blocks of the source's rows) or its columns
(row-wise) onto the source tensor. A quantized layer's ``qweight``, ``scales`` and ``zeros``
rows come from the same rows of the full-precision weight, quantized as they are read (each
row's groups lie within it), so a rank quantizes exactly its part and never holds the whole
weight in full precision. ZeRO-Inference materialises one unit at a time, as training does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..materialize import materialize_modules
from ..progress import Progress
from ..quant.scheme import QuantScheme, quantize
from ..zero.flat_group import FlatParamGroup
from ..zero.forward import ForwardSharding
from ..zero.units import UnitPlan
from .sources import WeightSource
from .tp import Split

__all__ = ["Origin", "WeightReader", "place_sharded", "place_whole"]


@dataclass(frozen=True)
class Origin:
    """Where a (local) parameter's values come from: source tensor ``name``, this rank's
    ``split`` of it, and for a quantized layer which stored tensor (``kind``) of which
    ``scheme``; ``"plain"``: the values as stored."""

    name: str
    split: Split | None = None
    kind: str = "plain"
    scheme: QuantScheme | None = None


class WeightReader:
    """Rows of parameters, read through their origins (see the note above)."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def _local_rows(self, origin: Origin, r0: int, r1: int) -> torch.Tensor:
        src, name, split = self.source, origin.name, origin.split
        if split is None or split.dim is None:
            t = src.read(name, slice(r0, r1))
            return torch.zeros_like(t) if split is not None and split.rank != 0 else t
        full = src.shape(name)
        if split.dim == 1:
            runs = split.runs(full[1])
            return torch.cat([src.read(name, slice(r0, r1), slice(a, b)) for a, b in runs], 1)
        parts, pos = [], 0  # pos: this rank's row where the run starts
        for a, b in split.runs(full[0]):
            lo, hi = max(r0, pos), min(r1, pos + b - a)
            if lo < hi:
                parts.append(src.read(name, slice(a + lo - pos, a + hi - pos)))
            pos += b - a
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def rows(self, origin: Origin, dtype: torch.dtype, r0: int, r1: int) -> torch.Tensor:
        t = self._local_rows(origin, r0, r1)
        if origin.kind != "plain":
            assert origin.scheme is not None
            t = quantize(t, origin.scheme).tensors()[origin.kind]
        return t.to(dtype) if t.is_floating_point() else t  # integers keep their dtype

    def flat(
        self, origin: Origin, shape: torch.Size, dtype: torch.dtype, lo: int, hi: int
    ) -> torch.Tensor:
        if len(shape) == 0:
            return self.rows(origin, dtype, 0, 1).reshape(-1)[lo:hi]
        row = math.prod(shape[1:])
        r0, r1 = lo // row, -(-hi // row)
        return self.rows(origin, dtype, r0, r1).reshape(-1)[lo - r0 * row : hi - r0 * row]

    def whole(self, origin: Origin, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if len(shape) == 0:
            return self.rows(origin, dtype, 0, 1).reshape(())
        return self.rows(origin, dtype, 0, shape[0]).reshape(shape)


def _slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) holding it (a tied weight has several)."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, attr))
    return out


def _dtype_for(p: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Floating-point parameters compute in ``dtype``; integer ones keep theirs."""
    return dtype if p.is_floating_point() else p.dtype


def place_whole(
    params: list[nn.Parameter],
    model: nn.Module,
    origins: dict[int, Origin],
    reader: WeightReader,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None = None,
) -> None:
    """Each of ``params`` read whole into a new frozen parameter on ``device``; each one
    read advances ``progress``."""
    slots = _slots(model)
    for p in params:
        t = reader.whole(origins[id(p)], p.shape, _dtype_for(p, dtype)).to(device)
        new = nn.Parameter(t.contiguous(), requires_grad=False)
        for m, attr in slots[id(p)]:
            m._parameters[attr] = new
        if progress is not None:
            progress.advance()


def place_sharded(
    model: nn.Module,
    plan: UnitPlan,
    origins: dict[int, Origin],
    reader: WeightReader,
    sharding: ForwardSharding,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None = None,
) -> None:
    """ZeRO-3 over ``plan``'s units (``zero/units.py``, as in training), added to
    ``sharding`` (``zero/forward.py``): each unit's parameters materialised empty, flat
    groups built over them, this rank's slice of each read from the source (nothing is
    broadcast: every rank reads its own), then released. The plan's persistent parameters
    stay whole on every rank. Each unit placed advances ``progress``."""
    place_whole(plan.persistent, model, origins, reader, device, dtype)  # before the units
    for module in plan.units:
        # real, uninitialised parameters in place of the meta ones (each group binds them to
        # its buffer at once); the origins follow them to the new objects
        replaced: dict[int, nn.Parameter] = {}
        materialize_modules(plan.owned_modules[id(module)], device, replaced, init=False)
        for old, new in replaced.items():
            origins[id(new)] = origins[old]
        params = [replaced.get(id(p), p) for p in plan.params[id(module)]]
        sharding.add_unit(module, params, lambda g: _fill(g, origins, reader))
        if progress is not None:
            progress.advance()


def _fill(g: FlatParamGroup, origins: dict[int, Origin], reader: WeightReader) -> None:
    def read(i: int, lo: int, hi: int) -> torch.Tensor:
        p = g.params[i]
        return reader.flat(origins[id(p)], g.shapes[i], g.dtype, lo, hi)

    g.load_shard(read)
