"""The plain-data records a checkpoint keeps beside its tensors, as types.

``ds_strategy.json`` is :class:`CheckpointMeta`; the packed ``engine`` entry is
:class:`EngineRecord`; each rank's ``rng/<rank>`` entry is :class:`RngState`. Records read
from disk hold what an older version wrote too, so keys added since are optional.
"""

from __future__ import annotations

from typing import TypedDict

import torch

__all__ = ["CheckpointMeta", "EngineRecord", "Layout", "RngState", "ScalerState"]


class Layout(TypedDict):
    """The layout a checkpoint was saved from."""

    format: str
    stage: int  # the ZeRO stage
    world_size: int
    tensor_parallel: int  # the tensor-parallel degree


class CheckpointMeta(Layout, total=False):
    """``ds_strategy.json``: read before any tensor, to check the checkpoint."""

    global_steps: int
    shapes: dict[str, list[int]]  # every parameter's full shape
    optimizer: bool  # False: a weights-only save
    optimizer_class: str  # module and name of the optimizer's class
    partial_window: int  # micro-batches accumulated but not stepped
    files: dict[str, dict[str, int]]  # each file's "size" and "crc32"


class _Scale(TypedDict):
    scale: float
    dynamic: bool


class ScalerState(_Scale, total=False):
    """The fp16 loss scaler's ``state_dict()``; a static scale has only the two keys."""

    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float
    iteration: int
    last_overflow: int
    hysteresis_left: int


class EngineRecord(Layout, total=False):
    """The ``engine`` entry: the layout, the engine's ``checkpoint_state()`` and the config."""

    global_steps: int
    micro_steps: int
    skipped_steps: int
    lr_scheduler: dict[str, object] | None  # the scheduler's ``state_dict()``
    loss_scaler: ScalerState | None
    config: dict[str, object]  # the resolved config, as ``ZeroConfig.to_dict()``


class _Generators(TypedDict):
    torch: torch.Tensor  # torch.get_rng_state()
    python: tuple[object, ...]  # random.getstate()


class RngState(_Generators, total=False):
    """One rank's random state; ``cuda`` where a GPU was there."""

    cuda: torch.Tensor
