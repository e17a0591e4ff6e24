"""Where a rank sits among the pipeline, data and tensor dimensions: a view of a
:class:`~ds_strategy.core.layout.RankLayout`, which builds the groups and the device mesh.

The order is the layout's (see [Note: rank order] in ``core/parallel_dims.py``):
tensor-parallel ranks consecutive, then data-parallel ranks, then pipeline stages; global
rank ``s*(D*T) + d*T + t``.

>>> ParallelMesh.flat(rank=1, world=4).coordinates
{'pp': 0, 'dp': 1, 'tp': 0}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .layout import RankLayout

__all__ = ["ParallelMesh"]


@dataclass(frozen=True)
class ParallelMesh:
    """Sizes of the pipeline, data- and tensor-parallel dimensions and this rank's place in
    them; ``device_mesh`` (dimensions ``"dp"``, ``"tp"``, with ``"pp"`` first under a
    pipeline) when tensor parallelism is on, and the ``layout`` it was read from."""

    pp: int
    dp: int
    tp: int
    coordinates: dict[str, int]
    device_mesh: DeviceMesh | None = field(default=None, repr=False)
    layout: RankLayout | None = field(default=None, repr=False)

    @staticmethod
    def flat(rank: int, world: int) -> ParallelMesh:
        """Data parallelism only: every rank a data-parallel rank."""
        return ParallelMesh.place(rank, world)

    @staticmethod
    def place(rank: int, world: int, tp: int = 1, pp: int = 1) -> ParallelMesh:
        """Where ``rank`` sits among ``world`` ranks, without building a mesh.

        The ranks are ``pp`` stages of ``tp``-way tensor parallel ranks (the order above).
        This is what a data sampler needs.

        Args:
            rank: the rank to place.
            world: how many ranks there are.
            tp: tensor-parallel ranks per group.
            pp: pipeline stages.

        >>> ParallelMesh.place(rank=5, world=8, tp=2, pp=2).coordinates
        {'pp': 1, 'dp': 0, 'tp': 1}
        """
        dims = ParallelDims(world, pp=pp, tp=tp)
        where = dims.coordinates(rank)
        return ParallelMesh(pp, dims.dp, tp, {k: where[k] for k in ("pp", "dp", "tp")})

    @staticmethod
    def data_parallel_size(world: int, tp: int, pp: int = 1) -> int:
        """The data-parallel ranks of ``world`` ranks, or an error naming the keys.

        Args:
            world: how many ranks there are.
            tp: tensor-parallel ranks per group.
            pp: pipeline stages.
        """
        return ParallelDims(world, pp=pp, tp=tp).dp

    @staticmethod
    def of(layout: RankLayout, device: torch.device | None = None) -> ParallelMesh:
        """The view of ``layout``; with ``device``, its device mesh too (made once).

        Args:
            layout: the rank layout to read.
            device: where DTensor's layers run; None: no device mesh.
        """
        dims, where = layout.dims, layout.coordinates
        mesh = layout.device_mesh(device.type) if device is not None else None
        place = {k: where[k] for k in ("pp", "dp", "tp")}
        return ParallelMesh(dims.pp, dims.dp, dims.tp, place, mesh, layout)

    def group(self, dim: str) -> torch.distributed.ProcessGroup | None:
        """The process group of this rank's ``dim`` ("pp", "dp" or "tp") dimension.

        Args:
            dim: the dimension's name.
        """
        assert self.layout is not None, "a mesh read without a layout has no groups"
        return self.layout.group(dim)
