"""Every use of Lightning's private API (the Trainer's and Fabric's), in one place, each named
for what it is for. Checked against lightning 2.6.6 (and the package's floor, 2.4: these names
are the same there; ``load_from_checkpoint`` reads its path through
``lightning.pytorch.core.saving.pl_load`` in both). A Lightning that renames them breaks here,
and only here. Fabric's strategy base classes for backward-sync control and sharded set-up
have no public alias.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.strategy import (
    _BackwardSyncControl,
    _Sharded,
    _validate_keys_for_strict_loading,
)
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.core import saving as _saving
from lightning.pytorch.core.optimizer import _MockOptimizer
from torch import nn

__all__ = [
    "BackwardSyncControl",
    "Sharded",
    "Stateful",
    "after_closure",
    "check_strict_keys",
    "convert_stateful",
    "is_stand_in_optimizer",
    "joint_setup_error",
    "replace_summary",
    "set_backward_sync_control",
    "summary_depth",
    "summary_layer_modules",
    "summary_model",
    "wrap_checkpoint_reader",
]

BackwardSyncControl = _BackwardSyncControl
Sharded = _Sharded
Stateful = _Stateful
check_strict_keys = _validate_keys_for_strict_loading


def is_stand_in_optimizer(optimizer: Any) -> bool:
    """The Trainer's placeholder when ``configure_optimizers`` returned nothing."""
    return isinstance(optimizer, _MockOptimizer)


def after_closure(precision: Any, model: Any, optimizer: Any) -> None:
    """The Trainer precision plugin's work after the closure: ``on_before_optimizer_step`` and
    the configured gradient clipping."""
    precision._after_closure(model, optimizer)


def set_backward_sync_control(strategy: Any, control: Any) -> None:
    """Fabric's ``no_backward_sync`` asks the strategy's control object."""
    strategy._backward_sync_control = control


def joint_setup_error(strategy: Any) -> str:
    """Fabric's message for a strategy that sets the model and optimizer up together."""
    return str(strategy._err_msg_joint_setup_required())


def convert_stateful(strategy: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Fabric's conversion of the stateful objects of a ``fabric.save`` state."""
    return strategy._convert_stateful_objects_in_state(state, {})


def summary_depth(callback: Any) -> int:
    """The ``max_depth`` a ``ModelSummary`` callback was made with."""
    return int(callback._max_depth)


def replace_summary(callback: Any, summary: Callable[..., Any]) -> None:
    """Make a ``ModelSummary`` callback build its summary with ``summary(callback, trainer,
    pl_module)``."""
    callback._summary = types.MethodType(summary, callback)


def summary_layer_modules(summary: Any) -> list[nn.Module]:
    """The modules of a ``ModelSummary``'s rows, in order."""
    return [layer._module for layer in summary._layer_summary.values()]


def summary_model(summary: Any) -> nn.Module:
    """The model a ``ModelSummary`` describes."""
    return summary._model


_WRAPPED = "_ds_strategy_wraps"  # on our reader: the one it wraps


def wrap_checkpoint_reader(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Make ``load_from_checkpoint`` (a LightningModule's or LightningDataModule's) read its
    path with ``wrap(reader)``, where ``reader`` is Lightning's own, called as ``reader(path,
    map_location=..., weights_only=...)`` (Lightning 2.4 passes no ``weights_only``). A
    second call keeps the first wrapper."""
    reader = _saving.pl_load
    if hasattr(reader, _WRAPPED):
        return
    wrapped = wrap(reader)
    setattr(wrapped, _WRAPPED, reader)
    _saving.pl_load = wrapped
