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

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

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
    # the whole model's parameters that other ranks hold and this one does not (their own
    # experts, under expert parallelism): a checkpoint holding them is this model's
    elsewhere: frozenset[str] = frozenset()


class CheckpointedEngine(Protocol):
    """An engine as a checkpoint sees it: its shards as records, its optimizer and counters,
    and the few facts of its place in a job that a checkpoint records or needs.

    Checkpoint code only reads these facts, so each is a read-only property here: an
    engine's plain attribute of the same type (or a narrower one) satisfies it.
    """

    @property
    def config(self) -> ZeroConfig: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the optimizer slots' tensors."""
        ...

    @property
    def global_steps(self) -> int: ...

    @property
    def trainable(self) -> bool: ...

    @property
    def checkpoint_comm(self) -> Comm:
        """Every rank holding a part of the state."""
        ...

    @property
    def checkpoint_io(self) -> SwapFiles | None:
        """Swap files read and written in place during a save or a load."""
        ...

    @property
    def checkpoint_partial(self) -> bool:
        """A pipeline stage: a checkpoint may hold more than its layers."""
        ...

    @property
    def checkpoint_stage(self) -> int | None:
        """Which ``stage_<k>`` of a pipeline checkpoint is its own."""
        ...

    @property
    def checkpoint_aliases(self) -> dict[str, str]:
        """A tied weight's name in the whole model."""
        ...

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

    def checkpoint_state(self) -> Mapping[str, object]:
        """Counters, lr scheduler and loss scaler state, as plain data (``records.py``)."""
        ...

    def restore_checkpoint_state(
        self, state: dict[str, object], *, lr_scheduler: bool = True
    ) -> None:
        """Put back what :meth:`checkpoint_state` returned, read from a checkpoint.

        Args:
            state: the saved record; plain data read from disk.
            lr_scheduler: restore the scheduler too (False: a weights-only load).
        """
        ...

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        tag: str | None = None,
        client_state: object = None,
        save_latest: bool = True,
        *,
        include_optimizer: bool = True,
        async_save: bool | None = None,
    ) -> Path:
        """Save into ``path`` (``path/tag`` with a tag); returns the directory.

        Args:
            path: the checkpoint directory, or the root of its tags.
            tag: the directory under ``path`` (None: ``path`` itself).
            client_state: any picklable object; the load returns it.
            save_latest: name the tag in ``path/latest``.
            include_optimizer: False writes the weights alone.
            async_save: write in the background (None: the config's choice).
        """
        ...

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        tag: str | None = None,
        *,
        load_optimizer: bool = True,
        require_checksums: bool = True,
        trust_checkpoint: bool = False,
    ) -> object:
        """Restore from ``path``; returns the saved ``client_state``.

        Args:
            path: a checkpoint directory, or the root of its tags.
            tag: the directory under ``path`` (None: the one ``latest`` names).
            load_optimizer: False restores the weights and counters alone.
            require_checksums: refuse a checkpoint that records no checksums.
            trust_checkpoint: unpickle objects other than tensors and plain data.
        """
        ...

    def step(self, grad_norm: float | None = None) -> None: ...

    def destroy(self) -> None: ...
