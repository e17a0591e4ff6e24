"""MiCS (DeepSpeed's ``mics_shard_size``; HSDP in FSDP's terms): shard over a group of ``S``
ranks, replicate across the ``R = N / S`` groups.

[Note: MiCS's two groups]
The ``N`` data-parallel ranks are cut into shard groups of ``S`` consecutive ranks (one
machine when ``S`` is the ranks per machine: torchrun and SLURM number ranks machine by
machine) and replica groups of the ``R`` ranks with the same place in their shard group
(the rank layout's ``blocks`` and ``strided``; the engine's ``Ranks.replica`` is the latter). ZeRO
runs over the shard group as if it were the whole world: layouts, the optimizer's slices,
stage 3's gathers, the gradient reduce-scatters and the post-step all-gathers never leave
it. At the accumulation boundary, once the reductions into the gradient shards are done
(every micro-batch's at stages 2-3, the one reduction of stage 1), the reduce path sums each
shard over the replica group (``ShardingPlan.finish_reduction``, as DeepSpeed's MiCS does), so every
rank holds its slice summed over all ``N`` ranks, as flat ZeRO's reduce-scatter gives it
(the sum in another order: equal to float rounding). What crosses the replica groups is
``2 (R-1)/R`` of ``1/S`` of the gradients per rank, once per optimizer step; parameters
never cross.

Sums over shards (the gradient norm, LAMB's parameter norms) run over the shard group: each
shard group holds the whole model once. Which parameters got a gradient must be known on
every rank, so those flags are combined over the replica group too
(``ShardedOptimizer.sync_grad_flags_and_norm``). A broadcast (the initial weights, buffers)
and every agreement on a failure (``faults.agree``) span all ``N`` ranks: a failure in one
shard group must raise in the others too, and every replica must start from rank 0's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .collectives import Comm

if TYPE_CHECKING:
    from .layout import RankLayout

__all__ = ["MiCSComm"]


@dataclass
class MiCSComm(Comm):
    """The shard group's ``Comm`` (see the note): its ``world_size`` and ``rank`` are the
    shard group's, ``replica`` is the group the reduce path sums the gradient shards over, its
    broadcasts and agreements run over ``everyone`` (the data-parallel group, which is also
    its parent: every byte counts there)."""

    replica: Comm = field(default_factory=Comm)
    everyone: Comm = field(default_factory=Comm)

    @staticmethod
    def build(comm: Comm, size: int, layout: RankLayout) -> MiCSComm:
        """Shard groups of ``size`` consecutive ranks of ``comm``'s group, and replica groups.

        The layout creates both (``blocks``, ``strided``); collective.

        Args:
            comm: the data-parallel group; ``size`` divides its ranks.
            size: ranks per shard group (``mics_shard_size``).
            layout: the rank layout, which creates the groups.
        """
        assert comm.world_size % size == 0, (comm.world_size, size)  # checked by the engine
        shard = layout.blocks(comm, size)
        mics = MiCSComm(shard.group, link=shard.link, parent=comm, everyone=comm)
        mics.replica = layout.strided(comm, size, parent=mics)
        return mics

    @property
    def agreement(self) -> Comm:
        return self.everyone

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """From group rank ``src`` of the first shard group to every rank: every replica
        starts from the same values."""
        self.everyone.broadcast(tensor, src)
