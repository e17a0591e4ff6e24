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

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["FlatPiece"]


class FlatPiece(torch.Tensor):
    _local: torch.Tensor
    _start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, numel: int) -> FlatPiece:
        if local.dim() != 1 or start < 0 or start + local.numel() > numel:
            raise ValueError(
                f"piece [{start}, {start + local.numel()}) does not fit in {numel} elements"
            )
        t = torch.Tensor._make_wrapper_subclass(
            cls, (numel,), dtype=local.dtype, device=local.device
        )
        t._local = local
        t._start = start
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"FlatPiece only carries checkpoint data; {func} is not supported on it")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FlatPiece([{self._start}, {self._start + self._local.numel()}) of {self.shape[0]})"

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(
            offsets=torch.Size([self._start]), sizes=torch.Size([self._local.numel()])
        )

    # -- the DCP protocol ---------------------------------------------------------------------

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([self._start])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    properties=TensorProperties.create_from_tensor(self._local),
                    size=self.shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._local
