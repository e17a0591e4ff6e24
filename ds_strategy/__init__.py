"""ds_strategy: ZeRO-style sharded training for PyTorch on ``torch.distributed``.

>>> import torch, ds_strategy
>>> model = torch.nn.Linear(4, 2)
>>> engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
...                                 {"zero_optimization": {"stage": 1}})
>>> engine.stage
1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import ConfigError, ZeroConfig, load_config
from .core.checkpoint.consolidate import consolidate
from .core.engine import ZeroEngine

__all__ = ["ConfigError", "ZeroConfig", "ZeroEngine", "consolidate", "initialize", "load_config"]
__version__ = "0.1.0"


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    config: Any = None,
    *,
    lr_scheduler: Any = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
) -> ZeroEngine:
    """Wrap ``model`` and ``optimizer`` in a :class:`ZeroEngine` sharded as ``config`` says.

    Args:
        model: the model; may live on the meta device (then every module needs
            ``reset_parameters()`` or ``param_init_fn``), which ZeRO-3 materialises one unit
            at a time.
        optimizer: a ``torch.optim.Optimizer`` built on ``model.parameters()`` (rebuilt over
            this rank's shards with the same param groups and hyper-parameters), a callable
            ``params -> Optimizer``, or None to build one from the config's ``optimizer``
            section.
        config: a dict, a path to a ``.json``/``.yaml`` file, a :class:`ZeroConfig` or an
            omegaconf node; keys follow DeepSpeed's config names.
        lr_scheduler: an lr scheduler built on ``optimizer``, or a callable
            ``optimizer -> scheduler``; stepped at every optimizer step.
        process_group: the data-parallel group (default: the default group, initialised from
            ``torchrun`` / ``accelerate launch`` / SLURM variables when none exists).
        param_init_fn: ``fn(module)`` initialising a module's own parameters after
            materialisation from the meta device.
    """
    return ZeroEngine(
        model,
        optimizer,
        config,
        lr_scheduler=lr_scheduler,
        process_group=process_group,
        param_init_fn=param_init_fn,
    )


from ._lightning_hook import register_when_lightning_is_imported  # noqa: E402

# zero1..zero3_offload in Lightning's Trainer and Fabric registries, once Lightning is imported
register_when_lightning_is_imported()
