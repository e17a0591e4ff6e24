"""Loop helpers the front ends share around an engine, written against its public surface only
(what plain loops share too is the core's: ``core/loop.py``; ``move_schedulers``, from
``core/optimizers.py``, is re-exported here for the Accelerate and HF front ends)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..core.optimizers import move_schedulers

__all__ = ["move_real_tensors", "move_schedulers", "timing_sink"]


def timing_sink(
    log: Callable[[dict[str, float], int], None],
) -> Callable[[dict[str, float], int], None]:
    """A ``wall_clock_breakdown`` sink that logs the report as ``wall_clock/<phase>`` metrics."""
    return lambda report, step: log({f"wall_clock/{k}": float(v) for k, v in report.items()}, step)


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Move the non-meta tensors to ``device``, where the engine materialises the meta ones."""
    module._apply(lambda t: t if t.is_meta else t.to(device))
