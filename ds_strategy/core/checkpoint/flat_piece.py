"""A tensor that tells ``torch.distributed.checkpoint`` "I am elements [start, start+n) of a
flattened tensor of ``numel`` elements".

[Note: why a flat 1-D view is the checkpoint's unit]
Each rank owns contiguous ranges of *flattened* parameters (see ``zero/layout.py``); those
ranges depend on the world size and the stage, but the flattened parameter does not. Saving
every piece as a 1-D chunk of its parameter's flat view gives a checkpoint whose layout is
independent of both: loading into another world size or stage asks DCP for the new ranges,
and DCP's own resharding reads whichever saved chunks overlap them. ``FlatPiece`` implements
the three hooks DCP uses for sharded tensors (the same ones ``DTensor`` implements); it
carries data and is never used in computation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NoReturn

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = ["FlatPiece"]


class FlatPiece(torch.Tensor):
    _local: torch.Tensor
    _start: int
    _runs: list[tuple[int, int, int]]

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        start: int,
        numel: int,
        runs: list[tuple[int, int, int]] | None = None,
    ) -> FlatPiece:
        """``local`` is elements ``[start, start + local.numel())``; or, with ``runs`` (a
        tensor-parallel part, see ``core/tp``), ``(offset in local, start, length)`` triples:
        its pieces sit at several places of the flattened tensor."""
        runs = runs if runs is not None else [(0, start, local.numel())]
        for offset, at, length in runs:
            if local.dim() != 1 or at < 0 or at + length > numel or offset + length > local.numel():
                raise ValueError(f"piece [{at}, {at + length}) does not fit in {numel} elements")
        t = torch.Tensor._make_wrapper_subclass(
            cls, (numel,), dtype=local.dtype, device=local.device
        )
        t._local = local
        t._start = start
        t._runs = runs
        return t

    # torch's stubs declare both hooks as plain functions, while subclasses define them as
    # below, as torch documents and its own subclasses (DTensor) do
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: OpOverload,
        types: Iterable[type],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> NoReturn:
        raise RuntimeError(f"FlatPiece only carries checkpoint data; {func} is not supported on it")

    # (mypy reads torch's unannotated Tensor.__repr__ as incompatible with any override)
    def __repr__(self) -> str:  # type: ignore[override]
        spans = ", ".join(f"[{at}, {at + n})" for _, at, n in self._runs)
        return f"FlatPiece({spans} of {self.shape[0]})"

    @property
    def piece_nbytes(self) -> int:
        """Bytes of the elements this piece carries (``local`` may be larger)."""
        return sum(n for _, _, n in self._runs) * self._local.element_size()

    def snapshot(self) -> FlatPiece:
        """A copy of just this piece's elements, which training cannot change."""
        parts, runs, pos = [], [], 0
        for offset, at, length in self._runs:
            parts.append(self._local.detach()[offset : offset + length])
            runs.append((pos, at, length))
            pos += length
        local = torch.cat(parts) if parts else self._local.detach()[:0].clone()
        return FlatPiece(local, self._start, self.shape[0], runs=runs)

    @staticmethod
    def _chunk(at: int, length: int) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([at]), sizes=torch.Size([length]))

    # -- the DCP protocol ---------------------------------------------------------------------

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([at])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(at, length),
                    properties=TensorProperties.create_from_tensor(self._local),
                    size=self.shape,
                ),
            )
            for _, at, length in self._runs
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(at, length) for _, at, length in self._runs]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offset, length = self.run_at(index)
        return self._local[offset : offset + length]

    def run_at(self, index: MetadataIndex) -> tuple[int, int]:
        """(offset in the local tensor, length) of the piece DCP names by ``index``."""
        at = index.offset[0] if index.offset is not None else self._start
        for offset, start, length in self._runs:
            if start == at:
                return offset, length
        raise KeyError(f"no piece of {index.fqn} starts at {at}")
