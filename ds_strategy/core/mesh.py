"""Where a rank sits among the parallel dimensions: world = pipeline x data x tensor, built
with torch's ``DeviceMesh``. Tensor-parallel ranks are consecutive (they exchange activations
every layer, so they get the fastest links, inside one machine), then data-parallel ranks
(ZeRO shards over them), then pipeline stages: global rank ``s*(D*T) + d*T + t``.

>>> ParallelMesh.flat(rank=1, world=4).coordinates
{'pp': 0, 'dp': 1, 'tp': 0}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelMesh"]


@dataclass(frozen=True)
class ParallelMesh:
    """Sizes of the pipeline, data- and tensor-parallel dimensions and this rank's place in
    them; ``device_mesh`` (dimensions ``"dp"``, ``"tp"``, with ``"pp"`` first under a
    pipeline) when tensor parallelism is on."""

    pp: int
    dp: int
    tp: int
    coordinates: dict[str, int]
    device_mesh: DeviceMesh | None = field(default=None, repr=False)

    @staticmethod
    def flat(rank: int, world: int) -> ParallelMesh:
        """Data parallelism only: every rank a data-parallel rank."""
        return ParallelMesh.place(rank, world)

    @staticmethod
    def place(rank: int, world: int, tp: int = 1, pp: int = 1) -> ParallelMesh:
        """Where ``rank`` sits among ``world`` ranks in ``pp`` stages of ``tp``-way tensor
        parallel ranks (the order above), without building a mesh: what a data sampler needs.

        >>> ParallelMesh.place(rank=5, world=8, tp=2, pp=2).coordinates
        {'pp': 1, 'dp': 0, 'tp': 1}
        """
        dp = world // (pp * tp)
        where = {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}
        return ParallelMesh(pp, dp, tp, where)

    @staticmethod
    def data_parallel_size(world: int, tp: int, pp: int = 1) -> int:
        """The data-parallel ranks of ``world`` ranks split into ``pp`` pipeline stages of
        ``tp`` tensor-parallel ranks, or an error."""
        if world % (pp * tp) and pp == 1:
            raise ValueError(
                f"tensor_parallel.autotp_size={tp} does not divide the world size {world}: "
                "the world is data-parallel x tensor-parallel ranks; choose a size that divides "
                "it or launch a multiple of it"
            )
        if world % (pp * tp):
            raise ValueError(
                f"pipeline.stages={pp} x tensor_parallel.autotp_size={tp} = {pp * tp} does not "
                f"divide the world size {world}: the world is pipeline x data-parallel x "
                "tensor-parallel ranks; choose sizes whose product divides it or launch a "
                f"multiple of {pp * tp} ranks"
            )
        return world // (pp * tp)

    @staticmethod
    def build(world: int, tp: int, device: torch.device, pp: int = 1) -> ParallelMesh:
        """The mesh of ``world`` ranks (the default process group): ``pp`` pipeline stages,
        each ``tp``-way tensor parallel, data parallel over the rest; collective."""
        dp = ParallelMesh.data_parallel_size(world, tp, pp)
        if pp == 1:
            mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
            dp_rank, tp_rank = mesh.get_coordinate() or (0, 0)
            return ParallelMesh(1, dp, tp, {"pp": 0, "dp": dp_rank, "tp": tp_rank}, mesh)
        mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank, dp_rank, tp_rank = mesh.get_coordinate() or (0, 0, 0)
        return ParallelMesh(pp, dp, tp, {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}, mesh)

    def group(self, dim: str) -> torch.distributed.ProcessGroup:
        """The process group of this rank's ``dim`` ("pp", "dp" or "tp") dimension."""
        assert self.device_mesh is not None, "a flat mesh has only the default group"
        return self.device_mesh.get_group(dim)
