"""``TrainingEngine``: the calls both engines answer (a :class:`~ds_strategy.ZeroEngine` and a
:class:`~ds_strategy.core.pipeline.PipelineEngine`), so a front end saves, loads, exports and
destroys whichever one the config chose without asking which. How the loop runs differs (a
ZeRO engine's ``backward``/``step``, a pipeline's ``train_batch``) and stays with each front
end's adapter for it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..config import ZeroConfig

__all__ = ["TrainingEngine"]


class TrainingEngine(Protocol):
    # read-only here: a pipeline's module is its stage (a subclass of nn.Module)
    @property
    def config(self) -> ZeroConfig: ...

    @property
    def module(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        tag: str | None = None,
        client_state: object = None,
        *,
        include_optimizer: bool = True,
    ) -> Path: ...

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        tag: str | None = None,
        *,
        load_optimizer: bool = True,
        trust_checkpoint: bool = False,
    ) -> Any: ...  # the caller's own client_state, as it saved it

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]: ...

    def save_weights(self, path: str | os.PathLike[str]) -> Path: ...

    def wait_for_checkpoint(self) -> None: ...

    def destroy(self) -> None: ...
