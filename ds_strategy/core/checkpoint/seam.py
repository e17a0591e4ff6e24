"""What checkpoint code reads of an engine, in one place: :class:`CheckpointedEngine`, and the
records its state comes in (:class:`ShardedState`).

Checkpoint code names this protocol, never the engine's class, so ``checkpoint/`` does not
import ``engine.py`` (which builds a ``CheckpointManager``): no import circle, and the list
below is the whole of what a save or a load may touch. A :class:`~ds_strategy.ZeroEngine`
(one pipeline stage's too) satisfies it; ``core/engine_shards.py`` builds its records.

[Note: a piece's global position]
Each rank holds ranges of *flattened* parameters; those ranges depend on the world size, the
ZeRO stage and the tensor-parallel split, but the flattened full parameter does not. So a
record says where its elements sit in that full parameter (:class:`Placement`: the name, the
full shape, and runs of ``(offset in the local tensor, start in the full one, length)``), and
checkpoint code never needs to know how the engine laid its shards out. The local tensor is
the live storage (a load writes straight into it), and may be out in a swap file during a
save or a load (NVMe offload): nothing is cut from it until the checkpoint writer asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ...config import ZeroConfig
from ..collectives import Comm
from ..offload.streaming import SwapFiles

__all__ = [
    "CheckpointedEngine",
    "ExtraState",
    "OptimizerSlot",
    "Placement",
    "Run",
    "ShardedState",
    "WeightPiece",
]


@dataclass(frozen=True)
class Run:
    """``length`` elements at ``offset`` of a local flattened tensor, which are elements
    ``[start, start + length)`` of the full flattened parameter."""

    offset: int
    start: int
    length: int


@dataclass(frozen=True)
class Placement:
    """Where a rank's elements of one parameter sit (see [Note: a piece's global position])."""

    name: str  # the parameter's name in the checkpoint (a tensor-parallel part: the whole's)
    shape: tuple[int, ...]  # the full parameter's
    runs: tuple[Run, ...]  # one, or several for a tensor-parallel part

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


@dataclass(frozen=True)
class WeightPiece:
    """This rank's elements of one parameter's weights (fp32 masters when training mixed)."""

    placement: Placement
    tensor: torch.Tensor  # the 1-D live storage the runs' offsets index


@dataclass(frozen=True)
class OptimizerSlot:
    """One tensor the optimizer updates on this rank. Its state of one value per element
    (Adam's moments) is placed like the tensor itself: the runs index ``tensor.view(-1)``."""

    placement: Placement
    tensor: torch.Tensor  # the optimizer's key: ``optimizer.state[tensor]``


@dataclass(frozen=True)
class ExtraState:
    """A rank's own buffer for one parameter, neither weight nor optimizer state (gradient
    compression's residual): every rank saves its own, see [Note: compression residuals in a
    checkpoint] in ``collect.py``."""

    kind: str  # the entry kind on disk (``compression``)
    param: str  # the parameter's name in the checkpoint
    name: str  # the buffer's (``residual``, ``velocity``)
    tensor: torch.Tensor  # 1-D, the live buffer


@dataclass(frozen=True)
class ShardedState:
    """An engine's state on this rank, as a checkpoint saves and loads it."""

    weights: tuple[WeightPiece, ...]
    buffers: Mapping[str, torch.Tensor]  # persistent buffers, replicated
    optimizer: tuple[OptimizerSlot, ...]
    extra: tuple[ExtraState, ...]
    shapes: Mapping[str, tuple[int, ...]]  # every parameter's full shape, held here or not
    stage: int  # the ZeRO stage
    world_size: int
    tp_degree: int  # the tensor-parallel degree
    # weights and optimizer state written by rank 0 alone: the ranks' replicas drift apart
    # between synchronisations (0/1 Adam's local steps), so a mix of them would be no state
    replicas_from_rank0: bool = False


class CheckpointedEngine(Protocol):
    """An engine as a checkpoint sees it: its shards as records, its optimizer and counters,
    and the few facts of its place in a job that a checkpoint records or needs."""

    config: ZeroConfig
    optimizer: Any  # a torch optimizer over the optimizer slots' tensors
    global_steps: int
    trainable: bool
    checkpoint_comm: Comm  # every rank holding a part of the state
    checkpoint_io: SwapFiles | None  # swap files read and written in place, during a save
    checkpoint_partial: bool  # a pipeline stage: a checkpoint may hold more than its layers
    checkpoint_stage: int | None  # which stage_<k> of a pipeline checkpoint is its own
    checkpoint_aliases: dict[str, str]  # a tied weight's name in the whole model

    def checkpoint_shards(self) -> ShardedState:
        """This rank's state (views of the live storage), once in-flight gathers landed."""
        ...

    def checkpoint_loaded(self) -> None:
        """The shards were overwritten by a load: rebuild what is derived from them."""
        ...

    def checkpoint_partial_window(self) -> int:
        """Micro-batches accumulated since the last optimizer step (0 at a boundary): their
        gradients are not in a checkpoint."""
        ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    def restore_checkpoint_state(
        self, state: dict[str, Any], *, lr_scheduler: bool = True
    ) -> None: ...

    def save_checkpoint(self, path: str | Path, *args: Any, **kwargs: Any) -> Path: ...

    def load_checkpoint(self, path: str | Path, *args: Any, **kwargs: Any) -> Any: ...

    def step(self, grad_norm: float | None = None) -> None: ...

    def destroy(self) -> None: ...
