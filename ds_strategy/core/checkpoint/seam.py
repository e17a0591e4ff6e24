"""What checkpoint code reads of an engine, in one place: :class:`CheckpointedEngine`.

Checkpoint code names this protocol, never the engine's class, so ``checkpoint/`` does not
import ``engine.py`` (which builds a ``CheckpointManager``): no import circle, and the list
below is the whole of what a save or a load may touch. A :class:`~ds_strategy.ZeroEngine`
(one pipeline stage's too) satisfies it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import nn

from ...config import ZeroConfig
from ..collectives import Comm
from ..mesh import ParallelMesh
from ..offload.streaming import SwapFiles
from ..tp import TensorParallel
from ..zero.builders import ShardingPlan
from ..zero.optimizer import OptimizerPiece

__all__ = ["CheckpointedEngine"]


class CheckpointedEngine(Protocol):
    """An engine as a checkpoint sees it: its model and shards, optimizer and counters, and
    the few facts of its place in a job that a checkpoint records or needs."""

    config: ZeroConfig
    module: nn.Module
    plan: ShardingPlan  # flat groups: their layouts, masters and gathers
    optimizer: Any  # a torch optimizer over this rank's pieces
    compression: Any  # gradient compression's residuals, or None
    tensor_parallel: TensorParallel | None
    mesh: ParallelMesh
    stage: int  # the ZeRO stage
    global_steps: int
    trainable: bool
    checkpoint_comm: Comm  # every rank holding a part of the state
    checkpoint_io: SwapFiles | None  # swap files read and written in place, during a save
    checkpoint_partial: bool  # a pipeline stage: a checkpoint may hold more than its layers
    checkpoint_stage: int | None  # which stage_<k> of a pipeline checkpoint is its own
    checkpoint_aliases: dict[str, str]  # a tied weight's name in the whole model

    @property
    def optimizer_pieces(self) -> tuple[OptimizerPiece, ...]: ...

    @property
    def world_size(self) -> int: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def restore_checkpoint_state(
        self, state: dict[str, Any], *, lr_scheduler: bool = True
    ) -> None: ...

    def save_checkpoint(self, path: str | Path, *args: Any, **kwargs: Any) -> Path: ...

    def load_checkpoint(self, path: str | Path, *args: Any, **kwargs: Any) -> Any: ...

    def step(self, grad_norm: float | None = None) -> None: ...

    def destroy(self) -> None: ...
