"""The process groups of pipeline x data (x tensor) parallelism, from the rank layout.

[Note: pipeline rank order]
As in DeepSpeed's ``PipeDataParallelTopology`` (axes ``pipe``, ``data``), the data-parallel
index varies faster than the stage; with tensor parallelism the tensor-parallel index varies
fastest of all: global rank ``r`` runs pipeline stage ``r // (D*T)`` as data-parallel rank
``r // T % D`` and tensor-parallel rank ``r % T`` (the ``"pp"``, ``"dp"``, ``"tp"``
dimensions of :class:`~ds_strategy.core.layout.RankLayout`; see [Note: rank order] in
``core/parallel_dims.py``). The ``D*T`` ranks of one stage (consecutive ranks, usually one
node) train it together: ZeRO over ``D``, the layers split over ``T``. The ``P`` ranks with
the same place in their stage (its *lane*) form one pipeline. The layout creates every
group; a ``Mesh`` holds the ones the pipeline engine uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..collectives import Comm, is_distributed
from ..layout import RankLayout
from ..mesh import ParallelMesh
from ..parallel_dims import ParallelDims

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
    layout: RankLayout | None = None  # what made the groups (None: a mesh read without them)

    @property
    def dims(self) -> ParallelDims:
        """The sizes, as the rank layout holds them."""
        return ParallelDims(self.world_size, pp=self.pp_size, tp=self.tp_size)

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
        return self.dims.coordinates(self.rank)["dp"]

    @property
    def tp_rank(self) -> int:
        return self.dims.coordinates(self.rank)["tp"]

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's place, as ``ParallelMesh.coordinates``: ``{"pp", "dp", "tp"}``."""
        where = self.dims.coordinates(self.rank)
        return {k: where[k] for k in ("pp", "dp", "tp")}

    def global_rank(self, stage: int, dp_rank: int | None = None) -> int:
        """The global rank running ``stage`` as data-parallel rank ``dp_rank`` (default: ours)
        with our tensor-parallel rank."""
        dp = self.dp_rank if dp_rank is None else dp_rank
        return self.dims.rank_of({"pp": stage, "dp_shard": dp, "tp": self.tp_rank})

    def pp_ranks(self) -> list[int]:
        return self.dims.ranks("pp", self.rank)

    def dp_ranks(self) -> list[int]:
        return self.dims.ranks("dp", self.rank)

    def new_cross_stage_groups(self, stages: list[int]) -> Comm | None:
        """This rank's group of its lane on ``stages`` (``RankLayout.cross_stage``).

        None when it runs none of them. Collective over the ranks of ``stages``, in the
        same order on each.

        Args:
            stages: pipeline stages, ascending.
        """
        assert self.layout is not None, "build the mesh with Mesh.build"
        return self.layout.cross_stage(stages)

    @classmethod
    def build(cls, pp_size: int, tp_size: int = 1, device: torch.device | None = None) -> Mesh:
        """Split the default group into ``pp_size`` stages of ``tp_size``-way tensor parallel ranks.

        A :class:`RankLayout` makes the groups, and its device mesh when ``tp_size > 1``.
        Collective on every rank.

        Args:
            pp_size: pipeline stages.
            tp_size: tensor-parallel ranks per group.
            device: where DTensor's layers run (the device mesh's type; cpu by default).
        """
        if not is_distributed():
            raise RuntimeError(
                "pipeline parallelism needs torch.distributed: start the script with "
                "torchrun / accelerate launch (or call torch.distributed.init_process_group)"
            )
        layout = RankLayout.over(pp=pp_size, tp=tp_size)  # an error unless P x T divides it
        parallel = stage_group = None
        if tp_size > 1:
            parallel = ParallelMesh.of(layout, device or torch.device("cpu"))
            stage_group = layout.group("stage")
        return cls(
            pp_size,
            layout.dims.dp,
            layout.rank,
            layout.group("pp"),
            layout.group("dp"),
            tp_size,
            stage_group,
            parallel,
            layout,
        )
