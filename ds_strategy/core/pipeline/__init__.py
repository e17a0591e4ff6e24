"""Pipeline parallelism combined with ZeRO data parallelism: the mesh of process groups,
partitioning a Sequential into stages, the schedules, :class:`PipelineEngine`, and what a
loop does around it (:class:`PipelineLoop`)."""

from .engine import PipelineEngine
from .loop import PipelineLoop, split_batch
from .mesh import Mesh
from .partition import partition_layers
from .schedules import bubble_fraction

__all__ = [
    "Mesh",
    "PipelineEngine",
    "PipelineLoop",
    "bubble_fraction",
    "partition_layers",
    "split_batch",
]
