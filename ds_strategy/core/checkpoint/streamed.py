"""DCP planners that save and load an engine's swapped state a piece at a time.

[Note: checkpoints that stream through the swap files]
A model trained with NVMe offload may hold many times the machine's memory in its swap
files, so a save or a load must never bring the whole state in. ``torch.distributed.checkpoint``
asks its planner for each piece's data only when it writes that piece (``resolve_data``),
and for each destination only when it has read a piece (``resolve_tensor``, then
``commit_tensor``). For a piece of a tensor that is out in its swap file (a ``FlatPiece``
whose local tensor has no storage), these planners answer from the file
(``core/offload/streaming.py``):

- save: the piece's bytes are read from the file into a tensor of exactly their size, which
  the writer saves as it is; its storage is freed when the next piece is asked for, the
  serial writer being done with it then (``per_thread_copy_ahead=0``). A rank holds one
  piece at a time.
- load: the destination is a buffer of the piece's size, written to the file at the piece's
  offset once filled, then freed. Optimizer state the optimizer has not created yet (a new
  engine's) is made out in a new file of zeros (``SwapFiles.new_state``), so the load writes
  it in place like the rest.

``Offload.streamed`` finishes every pending read and write first, so each file holds its
tensor's bytes; after a load, each group whose fp32 master was rewritten brings master and
shard in, a group at a time, for ``FlatParamGroup.sync_from_master``.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)

from ..offload.streaming import SwapFiles
from ..progress import Progress
from .flat_piece import FlatPiece

if TYPE_CHECKING:
    from ..offload.swap import SwappedTensor

__all__ = ["StreamingLoadPlanner", "StreamingSavePlanner"]


class StreamingSavePlanner(DefaultSavePlanner):
    """Pieces out in swap files are read from them as the writer asks (see the note)."""

    def __init__(self, files: SwapFiles, rank: int) -> None:
        super().__init__()
        self.files = files
        self.rank = rank
        self._lent: torch.Tensor | None = None
        self.progress: Progress | None = None

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.progress = Progress("saving the checkpoint", len(plan.items), self.rank, "pieces")
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        self.free()  # the serial writer saved the previous piece before asking for this one
        if self.progress is not None:
            self.progress.advance()
        if write_item.type is not WriteItemType.BYTE_IO:
            obj = self.state_dict.get(write_item.index.fqn)
            if isinstance(obj, FlatPiece):
                offset, length = obj.run_at(write_item.index)
                where = self.files.find(obj._local, offset, length)
                if where is not None:
                    self._lent = self.files.read(where)
                    return self._lent
        return super().resolve_data(write_item)

    def free(self) -> None:
        if self._lent is not None:
            self._lent.untyped_storage().resize_(0)
            self._lent = None

    def done(self) -> None:
        self.free()
        if self.progress is not None:
            self.progress.done()


class StreamingLoadPlanner(DefaultLoadPlanner):
    """Destinations out in swap files get a buffer, written to the file once filled."""

    def __init__(self, files: SwapFiles, rank: int) -> None:
        super().__init__()
        self.files = files
        self.rank = rank
        # a buffer's data_ptr -> where in its swap file the buffer goes (SwapFiles.find)
        self._pending: dict[int, tuple[SwappedTensor, int, int]] = {}
        self.progress: Progress | None = None

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(new_plan)
        self.progress = Progress("loading the checkpoint", len(plan.items), self.rank, "pieces")
        return plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        obj = self.state_dict.get(read_item.dest_index.fqn)
        if isinstance(obj, FlatPiece):
            offset, _ = obj.run_at(read_item.dest_index)
            start = offset + read_item.dest_offsets[0]
            where = self.files.find(obj._local, start, read_item.lengths[0])
            if where is not None:
                buf = torch.empty(read_item.lengths[0], dtype=obj._local.dtype)
                self._pending[buf.data_ptr()] = where  # (DCP passes back a detached alias)
                return buf
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        where = self._pending.pop(tensor.data_ptr(), None) if tensor.numel() else None
        if where is not None:
            self.files.write(where, tensor)
            tensor.untyped_storage().resize_(0)
        if self.progress is not None:
            self.progress.advance()
        super().commit_tensor(read_item, tensor)

    def done(self) -> None:
        if self.progress is not None:
            self.progress.done()
