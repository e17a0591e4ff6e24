"""The process-group layout of pipeline x data (x tensor) parallelism.

[Note: rank order]
As in DeepSpeed's ``PipeDataParallelTopology`` (axes ``pipe``, ``data``), the data-parallel
index varies faster than the stage; with tensor parallelism the tensor-parallel index varies
fastest of all: global rank ``r`` runs pipeline stage ``r // (D*T)`` as data-parallel rank
``r // T % D`` and tensor-parallel rank ``r % T`` (the ``"pp"``, ``"dp"``, ``"tp"`` dimensions
of :class:`~ds_strategy.core.mesh.ParallelMesh`). The ``D*T`` ranks of one stage (consecutive
ranks, usually one node) train it together: ZeRO over ``D``, the layers split over ``T``. The
``P`` ranks with the same place in their stage (its *lane*) form one pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...config import ConfigError
from ..mesh import ParallelMesh

__all__ = ["Mesh", "loader_micro_batch"]


def loader_micro_batch(batch: int, accumulation: int, micro: int | None = None) -> int:
    """The micro-batch size of a loader's ``batch`` per data-parallel rank, which one
    ``train_batch`` runs as ``accumulation`` micro-batches: ``batch`` must divide into them, or
    with ``micro`` (a built engine's ``train_micro_batch_size_per_gpu``) equal ``accumulation x
    micro``; errors give the batch size to use.

    >>> loader_micro_batch(8, 4), loader_micro_batch(8, 4, micro=2)
    (2, 2)
    """
    if micro is not None and batch != accumulation * micro:
        raise ValueError(
            f"this loader yields {batch} samples per data-parallel rank but train_batch "
            f"takes gradient_accumulation_steps={accumulation} x train_micro_batch_size_per_gpu="
            f"{micro} = {accumulation * micro}; use batch_size={accumulation * micro} (per "
            "data-parallel rank) or change those keys"
        )
    if batch % accumulation:
        raise ValueError(
            f"the loader's batch of {batch} samples per data-parallel rank does not divide "
            f"into gradient_accumulation_steps={accumulation} micro-batches; use a batch_size "
            f"that is a multiple of {accumulation}"
        )
    return batch // accumulation


@dataclass(frozen=True)
class Mesh:
    """Which pipeline stage, data- and tensor-parallel rank this process is, and its groups.

    Front ends and samplers shard data by ``dp_rank`` / ``dp_size`` (every stage of one
    pipeline, and every tensor-parallel rank of a stage, reads the same samples). Build it
    with :meth:`build` on every rank.
    """

    pp_size: int
    dp_size: int
    rank: int
    pp_group: dist.ProcessGroup | None  # the P ranks of this rank's pipeline
    dp_group: dist.ProcessGroup | None  # the D ranks sharing this rank's part of its stage
    tp_size: int = 1
    stage_group: dist.ProcessGroup | None = None  # the D*T ranks of this stage (T > 1)
    parallel: ParallelMesh | None = None  # the device mesh (T > 1)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp_size * self.tp_size

    @property
    def stage_size(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (its index in ``pp_group``)."""
        return self.rank // self.stage_size

    @property
    def lane(self) -> int:
        """This rank's place within its stage (equal along one pipeline)."""
        return self.rank % self.stage_size

    @property
    def dp_rank(self) -> int:
        return self.lane // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.lane % self.tp_size

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's place, as ``ParallelMesh.coordinates``: ``{"pp": .., "dp": .., "tp": ..}``."""
        return {"pp": self.stage, "dp": self.dp_rank, "tp": self.tp_rank}

    def global_rank(self, stage: int, dp_rank: int | None = None) -> int:
        """The global rank running ``stage`` as data-parallel rank ``dp_rank`` (default: ours)
        with our tensor-parallel rank."""
        dp = self.dp_rank if dp_rank is None else dp_rank
        return stage * self.stage_size + dp * self.tp_size + self.tp_rank

    def pp_ranks(self) -> list[int]:
        return [self.global_rank(s) for s in range(self.pp_size)]

    def dp_ranks(self) -> list[int]:
        return [self.global_rank(self.stage, d) for d in range(self.dp_size)]

    def new_cross_stage_groups(self, stages: list[int]) -> dist.ProcessGroup | None:
        """Collective on every rank: one group per lane joining ``stages``; returns the one
        this rank belongs to (None when it runs none of ``stages``)."""
        mine = None
        for lane in range(self.stage_size):
            group = dist.new_group([s * self.stage_size + lane for s in stages])
            if lane == self.lane and self.stage in stages:
                mine = group
        return mine

    @classmethod
    def build(cls, pp_size: int, tp_size: int = 1, device: torch.device | None = None) -> Mesh:
        """Split the default group into ``pp_size`` stages of ``tp_size``-way tensor parallel
        ranks; collective on every rank."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "pipeline parallelism needs torch.distributed: start the script with "
                "torchrun / accelerate launch (or call torch.distributed.init_process_group)"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if tp_size > 1:
            parallel = ParallelMesh.build(world, tp_size, device or torch.device("cpu"), pp_size)
            stage_group = None
            for s in range(pp_size):
                g = dist.new_group(list(range(s * world // pp_size, (s + 1) * world // pp_size)))
                if s == parallel.coordinates["pp"]:
                    stage_group = g
            return cls(
                pp_size,
                parallel.dp,
                rank,
                parallel.group("pp"),
                parallel.group("dp"),
                tp_size,
                stage_group,
                parallel,
            )
        if world % pp_size:
            raise ConfigError(
                f"pipeline.stages: the world size {world} is not divisible by {pp_size} "
                f"stages; use a number of stages dividing {world}, or launch a multiple of "
                f"{pp_size} ranks",
                key="pipeline.stages",
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
