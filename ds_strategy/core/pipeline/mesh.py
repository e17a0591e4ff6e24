"""The process-group layout of pipeline x data parallelism.

[Note: rank order]
As in DeepSpeed's ``PipeDataParallelTopology`` (axes ``pipe``, ``data``), the data-parallel
index varies fastest: global rank ``r`` runs pipeline stage ``r // D`` as data-parallel rank
``r % D``. The ``D`` ranks of one stage (consecutive ranks, usually one node) form its ZeRO
group; the ``P`` ranks with the same data-parallel index form one pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Mesh"]


@dataclass(frozen=True)
class Mesh:
    """Which pipeline stage and data-parallel rank this process is, and its groups.

    Front ends and samplers shard data by ``dp_rank`` / ``dp_size`` (every stage of one
    pipeline reads the same samples). Build it with :meth:`build` on every rank.
    """

    pp_size: int
    dp_size: int
    rank: int
    pp_group: dist.ProcessGroup | None  # the P ranks of this rank's pipeline
    dp_group: dist.ProcessGroup | None  # the D ranks running this rank's stage

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (its index in ``pp_group``)."""
        return self.rank // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp_size

    def global_rank(self, stage: int, dp_rank: int | None = None) -> int:
        """The global rank running ``stage`` as data-parallel rank ``dp_rank`` (default: ours)."""
        return stage * self.dp_size + (self.dp_rank if dp_rank is None else dp_rank)

    def pp_ranks(self) -> list[int]:
        return [self.global_rank(s) for s in range(self.pp_size)]

    def dp_ranks(self) -> list[int]:
        return [self.global_rank(self.stage, d) for d in range(self.dp_size)]

    def new_cross_stage_groups(self, stages: list[int]) -> dist.ProcessGroup | None:
        """Collective on every rank: one group per data-parallel index joining ``stages``;
        returns the one this rank belongs to (None when it runs none of ``stages``)."""
        mine = None
        for d in range(self.dp_size):
            group = dist.new_group([self.global_rank(s, d) for s in stages])
            if d == self.dp_rank and self.stage in stages:
                mine = group
        return mine

    @classmethod
    def build(cls, pp_size: int) -> Mesh:
        """Split the default group into ``pp_size`` stages; collective on every rank."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "pipeline parallelism needs torch.distributed: start the script with "
                "torchrun / accelerate launch (or call torch.distributed.init_process_group)"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % pp_size:
            raise ValueError(
                f"pipeline.stages: the world size {world} is not divisible by {pp_size} "
                f"stages; use a number of stages dividing {world}, or launch a multiple of "
                f"{pp_size} ranks"
            )
        dp_size = world // pp_size
        pp_group = dp_group = None
        for s in range(pp_size):
            g = dist.new_group([s * dp_size + d for d in range(dp_size)])
            if s == rank // dp_size:
                dp_group = g
        for d in range(dp_size):
            g = dist.new_group([s * dp_size + d for s in range(pp_size)])
            if d == rank % dp_size:
                pp_group = g
        return cls(pp_size, dp_size, rank, pp_group, dp_group)
