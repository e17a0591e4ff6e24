"""Two-level collectives for a group that spans machines: inside each machine first, then
across machines among the peers with the same place on theirs.

[Note: the two levels of a reduce-scatter]
A group of ``N = M x L`` ranks, ``L`` on each of ``M`` machines, numbered machine by machine
(group rank ``m * L + l``). Flat ZeRO gives group rank ``r`` chunk ``r`` of every flat
buffer. Viewing the buffer as ``(M, L, c)``, rank ``(m, l)`` owns block ``[m, l]``. The
reduce-scatter first reorders it to ``(L, M, c)`` and reduce-scatters that over the machine's
``L`` ranks: local rank ``l`` receives the machine's sum of the blocks ``[:, l]``. Those ``M``
blocks are then reduce-scattered over the ``M`` ranks with local rank ``l`` (one per
machine): machine ``m``'s receives block ``[m, l]`` summed over every rank, exactly its flat
shard (the sum in another order: equal to float rounding). What crosses machines is
``(M-1)/M`` of ``1/L`` of the buffer per rank, against ``(N-1)/N`` of all of it flat.
The all-gather is the same two steps in reverse (across machines, then inside). An
all-reduce is a reduce-scatter inside the machine, an all-reduce of the ``1/L`` piece across
machines and an all-gather inside (small ones, flags and norms: an all-reduce at each level).

Each level is its own ``Comm`` whose parent is this one (the rank layout creates them,
``RankLayout.machine_levels``), so ``comm_report()`` files the machine-internal bytes as
``intra_machine`` and the rest as ``inter_machine``. The two levels run one after the
other: an asynchronous call here completes before it returns (the overlap of reductions
with backward is traded for the smaller crossing traffic). The reordered copy and the
levels' buffers live only inside the call; their bytes at its fullest go to the engine's
meter (``Comm.holding``), so ``memory_report()["peak"]`` includes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .collectives import Comm, Work

if TYPE_CHECKING:
    from .layout import RankLayout

__all__ = ["HierarchicalComm"]

# an all-reduce of at least this many elements (and divisible by the ranks per machine) sends
# only 1/L of itself across machines (see the note); smaller ones go whole at both levels
_SPLIT_AT = 1024


@dataclass
class HierarchicalComm(Comm):
    """A ``Comm`` over ``group`` whose reduce-scatter, all-gather and all-reduce go in two
    levels (see the note); everything else runs flat over the whole group."""

    intra: Comm = field(default_factory=Comm)
    inter: Comm = field(default_factory=Comm)
    machines: int = 1

    @staticmethod
    def build(
        group: dist.ProcessGroup | None,
        layout: RankLayout,
        *,
        parent: Comm | None = None,
        on_scratch: Callable[[int], None] | None = None,
    ) -> Comm:
        """The two-level ``Comm`` over ``group``, or a plain one when the group lies within
        one machine or on one rank per machine (one level would be all there is).

        Collective over the group's members: the layout creates the levels
        (``RankLayout.machine_levels``, machines from its topology).

        Args:
            group: the group to split (None: the default group).
            layout: the rank layout, which creates the levels.
            parent: a group whose counts these are too (see ``Comm``).
            on_scratch: where the scratch of the levels is told (see ``Comm.holding``).
        """
        comm = HierarchicalComm(group, link="inter", parent=parent, on_scratch=on_scratch)
        levels = layout.machine_levels(comm)
        if levels is None:
            flat = Comm(group, parent=parent, on_scratch=on_scratch)
            flat.link = layout.topology.link(flat.global_ranks())
            return flat
        comm.intra, comm.inter = levels
        comm.machines = comm.inter.world_size
        return comm

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Work:
        m, per = self.machines, self.intra.world_size
        blocks = full.view(m, per, -1).transpose(0, 1).contiguous()  # (L, M, c)
        mid = full.new_empty(m * out.numel())
        with self.holding(blocks, mid, *self.intra.receive_buffer(blocks)):
            self.intra.reduce_scatter(mid, blocks.view(-1))
            self.inter.reduce_scatter(out, mid)  # its receive buffer is mid's size: covered
        return Work(None)

    def all_gather(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        async_op: bool = False,
        kind: str = "all_gather",
    ) -> Work:
        m, per = self.machines, self.intra.world_size
        mid = shard.new_empty(m * shard.numel())
        self.inter.all_gather(mid, shard, kind=kind)
        blocks = shard.new_empty(per * mid.numel())
        with self.holding(mid, blocks):
            self.intra.all_gather(blocks, mid, kind=kind)
            full.view(m, per, -1).copy_(blocks.view(per, m, -1).transpose(0, 1))
        return Work(None)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str = "sum",
        async_op: bool = False,
        kind: str = "all_reduce",
    ) -> Work:
        per = self.intra.world_size
        flat = tensor.view(-1) if tensor.is_contiguous() else None
        if op != "sum" or flat is None or flat.numel() % per or flat.numel() < _SPLIT_AT:
            # small (a flag, a norm) or not divisible: all of it at both levels
            self.intra.all_reduce(tensor, op=op, kind=kind)
            self.inter.all_reduce(tensor, op=op, kind=kind)
            return Work(None)
        # reduce-scatter inside the machine, all-reduce the 1/L piece across, all-gather inside
        piece = flat.new_empty(flat.numel() // per)
        with self.holding(piece, *self.intra.receive_buffer(flat)):
            self.intra.reduce_scatter(piece, flat)
            self.inter.all_reduce(piece, kind=kind)
            self.intra.all_gather(flat, piece, kind=kind)
        return Work(None)
