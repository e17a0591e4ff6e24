"""Pipeline parallelism combined with ZeRO data parallelism: the mesh of process groups,
partitioning a Sequential into stages, the schedules, and :class:`PipelineEngine`."""

from .engine import PipelineEngine, split_batch
from .mesh import Mesh
from .partition import partition_layers
from .schedules import bubble_fraction

__all__ = ["Mesh", "PipelineEngine", "bubble_fraction", "partition_layers", "split_batch"]
