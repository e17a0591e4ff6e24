"""Where each parameter lives in a flat, padded buffer, and which piece each rank owns.

Pure arithmetic: no tensors move here, so every rule is testable in one process.

[Note: layout]
A group's parameters are laid end to end in one flat buffer, padded so its length is a
multiple of the world size N. Rank r owns the contiguous slice [r*S, (r+1)*S) with
S = padded_total / N. A parameter may straddle two (or more) ranks' slices; the piece of it
that falls in rank r's slice is a ``ShardPiece``. The optimizer sees one tensor per piece, so a
parameter that got no gradient can be skipped exactly as plain PyTorch skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FlatLayout", "ParamSlot", "ShardPiece"]


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat (unsharded) buffer."""

    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class ShardPiece:
    """The part of parameter ``index`` that one rank owns.

    ``param_start`` is the offset inside the flattened parameter, ``shard_start`` the offset
    inside the rank's shard; both span ``length`` elements.
    """

    index: int
    param_start: int
    shard_start: int
    length: int


class FlatLayout:
    """Offsets of ``numels`` in a flat buffer padded to a multiple of ``world_size``.

    With ``align`` > 1 every parameter starts at a multiple of ``align`` and so does every
    shard: a piece then starts ``align``-aligned inside its parameter, so blocks of ``align``
    elements counted from the parameter's start never straddle two ranks (the quantization
    blocks of low-bit optimizer state, ``core/optim/lowbit.py``). The gaps are zeros.

    >>> lay = FlatLayout([3, 4], world_size=2)
    >>> lay.padded_total, lay.shard_size
    (8, 4)
    >>> lay.pieces(1)
    [ShardPiece(index=1, param_start=1, shard_start=0, length=3)]
    >>> aligned = FlatLayout([3, 4], world_size=2, align=4)
    >>> [s.offset for s in aligned.slots], aligned.shard_size, aligned.gaps()
    ([0, 4], 4, [(3, 4)])
    """

    def __init__(self, numels: list[int], world_size: int, align: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.align = max(1, align)
        self.slots: list[ParamSlot] = []
        offset = 0
        for i, n in enumerate(numels):
            offset = _round_up(offset, self.align)
            self.slots.append(ParamSlot(i, offset, n))
            offset += n
        self.total = offset  # the end of the last parameter (gaps between them included)
        # Never zero: an empty group still needs a (tiny) shard so collectives line up.
        self.shard_size = _round_up(max(1, -(-offset // world_size)), self.align)
        self.padded_total = self.shard_size * world_size

    def gaps(self) -> list[tuple[int, int]]:
        """``[start, end)`` of the alignment gaps between parameters (none unaligned)."""
        out = []
        for a, b in zip(self.slots, self.slots[1:], strict=False):
            if a.offset + a.numel < b.offset:
                out.append((a.offset + a.numel, b.offset))
        return out

    @property
    def padding(self) -> int:
        return self.padded_total - self.total

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_size
        return start, start + self.shard_size

    def pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces of parameters inside rank ``rank``'s slice, in order."""
        lo, hi = self.shard_range(rank)
        out = []
        for s in self.slots:
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start < end:
                out.append(ShardPiece(s.index, start - s.offset, start - lo, end - start))
        return out

    def owners(self, index: int) -> list[int]:
        """Ranks holding some piece of parameter ``index``."""
        s = self.slots[index]
        if s.numel == 0:
            return []
        first = s.offset // self.shard_size
        last = (s.offset + s.numel - 1) // self.shard_size
        return list(range(first, last + 1))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def split_into_buckets(numels: list[int], bucket_numel: int) -> list[list[int]]:
    """Greedy, order-preserving split of indices into buckets of at most ``bucket_numel``
    elements; a parameter larger than a bucket gets a bucket of its own."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and size + n > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets
