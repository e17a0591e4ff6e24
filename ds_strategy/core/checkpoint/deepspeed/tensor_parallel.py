"""A tensor-parallel DeepSpeed checkpoint (AutoTP: ``mp_rank_00``, ``mp_rank_01``, ... each
with its own data-parallel partitions) read as the whole model.

[Note: joining DeepSpeed's tensor-parallel parts]
Each part is read as a checkpoint of its own (``layout.py``); a parameter's whole is its
parts joined as DeepSpeed's ``universal_checkpoint_info`` (saved with every AutoTP
checkpoint, version 0.4) says: a row-parallel weight along dimension 1, a replicated one
taken from the first part, a vocabulary one along dimension 0 and cut back to
``original_vocab_size``, any other along dimension 0 (column-parallel, as AutoTP splits a
``Linear``'s output features). The optimizer's per-element state joins the same way. A
checkpoint without that record, or with fused parameters (``parameter_with_sub_params``), is
refused with a message: nothing records how to join it.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any

import torch

from ..validate import CheckpointError
from .layout import DeepSpeedCheckpoint

__all__ = ["TensorParallelCheckpoint", "join_parts"]


def join_parts(parts: list[DeepSpeedCheckpoint]) -> TensorParallelCheckpoint:
    info = parts[0].model_state.get("universal_checkpoint_info") or {}
    where = parts[0].directory
    if not isinstance(info, dict):
        raise CheckpointError(f"{parts[0].model_paths[0]}: universal_checkpoint_info is not a dict")
    if not info:
        raise CheckpointError(
            f"{where}: a tensor-parallel DeepSpeed checkpoint ({len(parts)} parts) without "
            "universal_checkpoint_info, which says how its parameters were split; write it "
            "with a DeepSpeed that records it (0.16 or later) or join it with ds_to_universal.py"
        )
    if info.get("parameter_with_sub_params"):
        raise CheckpointError(
            f"{where}: fused tensor-parallel parameters (parameter_with_sub_params) are not "
            "joined here; convert the checkpoint with DeepSpeed's ds_to_universal.py"
        )
    first = parts[0]
    joined = TensorParallelCheckpoint(
        first.directory,
        first.stage,
        first.world_size,
        first.model_state,
        first.optim,
        first.model_files,
    )
    joined.parts, joined.info = parts, info
    joined.optim_paths, joined.model_paths = first.optim_paths, first.model_paths
    _check_info(joined)
    _check_parts(joined)
    joined.segments = {name: () for name in joined.shapes}
    return joined


_PATTERNS = (
    "tp_replicated_parameter_patterns",
    "parameter_with_row_parallelism_patterns",
    "vocabulary_parameter_patterns",
)


def _check_info(joined: TensorParallelCheckpoint) -> None:
    """``universal_checkpoint_info``'s patterns compile and its vocabulary size is a count."""
    where = joined.model_paths[0]
    for key in _PATTERNS:
        patterns = joined.info.get(key) or ()
        try:
            ok = isinstance(patterns, (list, tuple)) and all(re.compile(p) for p in patterns)
        except (TypeError, re.error):
            ok = False
        if not ok:
            raise CheckpointError(
                f"{where}: universal_checkpoint_info's {key} is not a list of patterns; the "
                "file is damaged or crafted: restore it from a good copy"
            )
    vocab = joined.info.get("original_vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or not 0 < vocab < 2**62):
        raise CheckpointError(f"{where}: original_vocab_size is not a count of tokens")


def _check_parts(joined: TensorParallelCheckpoint) -> None:
    """Every part holds the first part's parameters, their shapes equal but along the
    dimension they are split on, so joining them never fails half-way."""
    first = joined.parts[0]
    for k, part in enumerate(joined.parts[1:], start=1):
        for name, shape in first.shapes.items():
            other = part.shapes.get(name)
            if not _joins(shape, other, joined.split_dim(name)):
                raise CheckpointError(
                    f"{part.model_paths[0]}: tensor-parallel part {k} saves {name!r} as "
                    f"{list(other) if other is not None else 'nothing'}, part 0 as "
                    f"{list(shape)}; the parts do not join: the checkpoint is damaged"
                )
    for name, shape in joined.shapes.items():
        if joined.split_dim(name) == 0 and shape[0] > sum(p.shapes[name][0] for p in joined.parts):
            raise CheckpointError(
                f"{first.model_paths[0]}: original_vocab_size {shape[0]} is larger than the "
                f"joined {name!r}; the checkpoint is damaged"
            )


def _joins(shape: torch.Size, other: torch.Size | None, dim: int | None) -> bool:
    """``other`` is ``shape`` but along ``dim`` (None: the same)."""
    if other is None or len(other) != len(shape) or (dim is not None and dim >= len(shape)):
        return False
    return all(a == b or i == dim for i, (a, b) in enumerate(zip(shape, other, strict=True)))


class TensorParallelCheckpoint(DeepSpeedCheckpoint):
    """The parts of a tensor-parallel checkpoint as one model (see the module note); its
    counters, optimizer hyper-parameters and client state are the first part's."""

    parts: list[DeepSpeedCheckpoint]
    info: dict[str, Any]

    def _matches(self, key: str, name: str) -> bool:
        return any(re.match(p, name) for p in self.info.get(key) or ())

    def split_dim(self, name: str) -> int | None:
        """The dimension ``name`` is split along (None: replicated)."""
        if self._matches("tp_replicated_parameter_patterns", name):
            return None
        return 1 if self._matches("parameter_with_row_parallelism_patterns", name) else 0

    @cached_property
    def shapes(self) -> dict[str, torch.Size]:
        out = {}
        for name, shape in self.parts[0].shapes.items():
            dim = self.split_dim(name)
            if dim is None:
                out[name] = shape
                continue
            full = list(shape)
            full[dim] = sum(p.shapes[name][dim] for p in self.parts)
            if self._matches("vocabulary_parameter_patterns", name):
                full[0] = int(self.info.get("original_vocab_size") or full[0])
            out[name] = torch.Size(full)
        return out

    def full(self, name: str, key: str = "fp32") -> torch.Tensor:
        dim = self.split_dim(name)
        if dim is None:
            return self.parts[0].full(name, key)
        joined = torch.cat([p.full(name, key) for p in self.parts], dim=dim)
        return joined[: self.shapes[name][0]] if dim == 0 else joined

    def read(self, name: str, start: int, length: int, key: str = "fp32") -> torch.Tensor:
        cached = getattr(self, "_last", None)
        if cached is None or cached[0] != (name, key):
            cached = ((name, key), self.full(name, key).reshape(-1))
            self._last = cached  # a load reads one parameter's runs one after another
        return cached[1][start : start + length].clone()
