"""What a checkpoint sees of an engine's swap files (NVMe offload): where a swapped-out
tensor's bytes are, and reading or writing a piece of them in place. The checkpoint's
planners use it to save and load a piece at a time (``core/checkpoint/streamed.py``).

A piece's bytes are checked against the block checksums of its file (``integrity.py``): a
read takes the blocks around the piece too (at most two more, into small buffers beside
the piece's own, so memory stays one piece), and a write checks the blocks it shares with
its neighbours before it changes them, then records their new checksums.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .integrity import BLOCK, block_crcs, check_blocks, span, write_error
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
        first = int(base.storage_offset() - swap.tensor.storage_offset()) + start
        return swap, first * base.element_size(), numel

    @staticmethod
    def read(where: tuple[SwappedTensor, int, int]) -> torch.Tensor:
        """The elements :meth:`find` located, in a new tensor of exactly their size, checked
        against their file's checksums."""
        swap, offset, numel = where
        out = torch.empty(numel, dtype=swap.tensor.dtype)
        want = numel * out.element_size()
        lo, hi = span(offset, want, swap.nbytes)
        parts = [memoryview(bytearray(offset - lo)), _buffer(out)]
        parts.append(memoryview(bytearray(hi - offset - want)))
        _pread(swap, parts, lo)
        check_blocks(parts, swap.crcs, lo // BLOCK, swap.path)
        count_io(read=hi - lo)
        return out

    @staticmethod
    def write(where: tuple[SwappedTensor, int, int], values: torch.Tensor) -> None:
        """Write ``values`` over the elements :meth:`find` located, in the file; the blocks
        it shares with its neighbours are checked first, and their checksums updated."""
        swap, offset, numel = where
        values = values.reshape(-1).contiguous()
        assert values.numel() == numel and values.dtype == swap.tensor.dtype
        want = numel * values.element_size()
        lo, hi = span(offset, want, swap.nbytes)
        head, tail = _edges(swap, lo, offset, want, hi)
        fd = os.open(swap.path, os.O_WRONLY)
        try:
            done = os.pwritev(fd, [_buffer(values)], offset)
        except OSError as e:
            raise write_error(e, swap.path, want) from e
        finally:
            os.close(fd)
        if done != want:
            raise OSError(f"{swap.path}: wrote {done} of {want} bytes")
        assert swap.crcs is not None  # (_edges checked it)
        first = lo // BLOCK
        new = block_crcs(head, _buffer(values), tail)
        swap.crcs[first : first + len(new)] = new
        count_io(written=done)


def _pread(swap: SwappedTensor, parts: list[memoryview], at: int) -> None:
    want = sum(len(p) for p in parts)
    fd = os.open(swap.path, os.O_RDONLY)
    try:
        got = os.preadv(fd, parts, at)
    finally:
        os.close(fd)
    if got != want:
        raise OSError(f"{swap.path}: read {got} of {want} bytes at {at} (truncated?)")


def _edges(
    swap: SwappedTensor, lo: int, offset: int, nbytes: int, hi: int
) -> tuple[memoryview, memoryview]:
    """The bytes of the blocks ``[lo, hi)`` before and after ``[offset, offset + nbytes)``,
    once their first and last blocks are checked (the only ones the piece may share)."""
    end = offset + nbytes
    first = memoryview(bytearray(min(BLOCK, hi - lo)))
    _pread(swap, [first], lo)
    check_blocks([first], swap.crcs, lo // BLOCK, swap.path)
    last = first
    if hi - lo > BLOCK:
        last = memoryview(bytearray(hi - (hi - 1) // BLOCK * BLOCK))
        _pread(swap, [last], hi - len(last))
        check_blocks([last], swap.crcs, (hi - 1) // BLOCK, swap.path)
    head = first[: offset - lo]
    tail = last[len(last) - (hi - end) :] if hi > end else memoryview(b"")
    return head, tail
