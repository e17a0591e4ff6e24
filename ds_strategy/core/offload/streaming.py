"""What a checkpoint sees of an engine's swap files (NVMe offload): where a swapped-out
tensor's bytes are, and reading or writing a piece of them in place. The checkpoint's
planners use it to save and load a piece at a time (``core/checkpoint/streamed.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .swap import SwappedTensor, _buffer, count_io

__all__ = ["SwapFiles"]


class SwapFiles:
    """The swap files of one engine during one checkpoint save or load (``Offload.streamed``):
    :meth:`find` says where elements of a tensor that is out in its file are, :meth:`read` and
    :meth:`write` move them; ``new_state(index, key, like, dtype)`` makes optimizer state for
    piece ``index`` out in a new file of zeros (a load into an engine that never stepped)."""

    def __init__(
        self,
        swaps: list[SwappedTensor],
        new_state: Callable[[int, str, torch.Tensor, torch.dtype], torch.Tensor],
    ) -> None:
        self._by_storage: dict[int, SwappedTensor] = {}
        for s in swaps:
            self.add(s)
        self._new_state = new_state

    def add(self, swap: SwappedTensor) -> None:
        self._by_storage[swap.tensor.untyped_storage()._cdata] = swap

    def new_state(
        self, index: int, key: str, like: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return self._new_state(index, key, like, dtype)

    def find(
        self, base: torch.Tensor, start: int, numel: int
    ) -> tuple[SwappedTensor, int, int] | None:
        """``(swap, byte offset, numel)`` of elements ``[start, start + numel)`` of the
        contiguous tensor ``base`` when ``base`` is out in its file; None when its bytes are
        in memory."""
        if numel == 0 or base.untyped_storage().nbytes() > 0:
            return None
        swap = self._by_storage.get(base.untyped_storage()._cdata)
        if swap is None or not base.is_contiguous():
            raise RuntimeError(
                "a checkpoint entry has no bytes in memory and is not part of a swapped "
                "tensor; this is a bug in ds_strategy's offload tier"
            )
        first = base.storage_offset() - swap.tensor.storage_offset() + start
        return swap, first * base.element_size(), numel

    @staticmethod
    def read(where: tuple[SwappedTensor, int, int]) -> torch.Tensor:
        """The elements :meth:`find` located, in a new tensor of exactly their size."""
        swap, offset, numel = where
        out = torch.empty(numel, dtype=swap.tensor.dtype)
        want = numel * out.element_size()
        fd = os.open(swap.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [_buffer(out)], offset)
        finally:
            os.close(fd)
        if got != want:
            raise OSError(f"{swap.path}: read {got} of {want} bytes at {offset} (truncated?)")
        count_io(read=got)
        return out

    @staticmethod
    def write(where: tuple[SwappedTensor, int, int], values: torch.Tensor) -> None:
        """Write ``values`` over the elements :meth:`find` located, in the file."""
        swap, offset, numel = where
        values = values.reshape(-1).contiguous()
        assert values.numel() == numel and values.dtype == swap.tensor.dtype
        fd = os.open(swap.path, os.O_WRONLY)
        try:
            done = os.pwritev(fd, [_buffer(values)], offset)
        finally:
            os.close(fd)
        if done != numel * values.element_size():
            raise OSError(f"{swap.path}: wrote {done} of {numel * values.element_size()} bytes")
        count_io(written=done)
