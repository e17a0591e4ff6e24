"""True parameter counts in the Trainer's summary callbacks (``ModelSummary``,
``RichModelSummary``) under ZeRO-3, where a parameter outside its unit's forward is empty: they
use :class:`ShardedModelSummary`, counting full sizes (as Lightning does for DeepSpeed)."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn

from ..core.engine import ZeroEngine
from ..core.loop import full_sizes
from ..frontends.lightning_private import (
    replace_summary,
    summary_depth,
    summary_layer_modules,
    summary_model,
)

__all__ = ["ShardedModelSummary", "install_sharded_summary"]


class ShardedModelSummary(ModelSummary):
    """``ModelSummary`` counting ``numel(p)``, a parameter's full size even while sharded."""

    def __init__(
        self, model: pl.LightningModule, numel: Callable[[nn.Parameter], int], max_depth: int = 1
    ) -> None:
        self._numel = numel
        super().__init__(model, max_depth=max_depth)

    def _count(self, module: nn.Module, trainable_only: bool = False) -> int:
        return sum(
            self._numel(p) for p in module.parameters() if p.requires_grad or not trainable_only
        )

    @property
    def param_nums(self) -> list[int]:
        return [self._count(m) for m in summary_layer_modules(self)]

    @property
    def total_parameters(self) -> int:
        return self._count(summary_model(self))

    @property
    def trainable_parameters(self) -> int:
        return self._count(summary_model(self), trainable_only=True)


def install_sharded_summary(trainer: pl.Trainer, engines: list[ZeroEngine]) -> None:
    """Make the Trainer's summary callbacks report full parameter counts for ``engines``."""
    sizes = full_sizes(engines)

    def numel(p: nn.Parameter) -> int:
        return sizes.get(id(p), p.numel())

    def _summary(
        callback: ModelSummaryCallback, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> ModelSummary:
        return ShardedModelSummary(pl_module, numel, max_depth=summary_depth(callback))

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ModelSummaryCallback):
            replace_summary(callback, _summary)
