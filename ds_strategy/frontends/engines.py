"""Loop helpers the front ends share around an engine, written against its public surface only
(a clip request waiting for the step is the core's, ``core/loop.py``, which plain loops use too)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from ..core.checkpoint.validate import META_FILE
from ..core.optimizers import track_optimizer_step

__all__ = [
    "has_optimizer_state",
    "move_real_tensors",
    "move_schedulers",
    "no_optimizer",
    "timing_sink",
]


def no_optimizer(front: str) -> NoReturn:
    """Training needs an optimizer: an error saying what to return."""
    raise ValueError(
        f"{front} got no optimizer: the engine shards the optimizer's state across the ranks. "
        "Return one from configure_optimizers (or one per model, e.g. a GAN's generator and "
        "discriminator, with manual optimization)"
    )


def timing_sink(
    log: Callable[[dict[str, float], int], None],
) -> Callable[[dict[str, float], int], None]:
    """A ``wall_clock_breakdown`` sink that logs the report as ``wall_clock/<phase>`` metrics."""
    return lambda report, step: log({f"wall_clock/{k}": float(v) for k, v in report.items()}, step)


def move_schedulers(engine: Any, schedulers: list[Any]) -> None:
    """Point the loop's lr schedulers at the engine's optimizer (its groups keep ``initial_lr``)."""
    if schedulers and engine.config.scheduler is not None:
        raise ValueError(
            f"the ZeRO config's scheduler section ({engine.config.scheduler.type}) already "
            "schedules the learning rate (the engine steps it); remove the section or do not "
            "pass another lr scheduler"
        )
    for scheduler in schedulers:
        scheduler.optimizer = engine.optimizer
    if schedulers:
        track_optimizer_step(engine.optimizer)


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Move the non-meta tensors to ``device``, where the engine materialises the meta ones."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def has_optimizer_state(path: Path) -> bool:
    """False for a weights-only checkpoint directory (``include_optimizer=False``)."""
    try:
        return bool(json.loads((path / META_FILE).read_text()).get("optimizer", True))
    except (OSError, ValueError):
        return True  # unreadable metadata: let the engine's load name the problem
