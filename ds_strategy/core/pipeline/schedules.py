"""Choosing a ``torch.distributed.pipelining`` schedule from the config.

[Note: theoretical bubble]
With ``P`` stages, ``M`` micro-batches and backward costing a fixed multiple of forward, GPipe
and 1F1B both leave each stage idle for ``(P - 1)`` of ``(M + P - 1)`` micro-batch slots;
1F1B only bounds the activations in flight to ``P`` micro-batches instead of ``M``. The
interleaved schedule with ``v`` chunks per rank divides the bubble by ``v``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

__all__ = ["bubble_fraction", "make_schedule", "stage_indices", "stage_layers"]


def bubble_fraction(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle fraction of each stage in an ideal run of ``schedule``.

    >>> round(bubble_fraction("1f1b", 4, 8), 4)
    0.2727
    """
    p, m = stages, micro_batches
    if schedule == "interleaved_1f1b":
        return (p - 1) / chunks / (m + (p - 1) / chunks)
    return (p - 1) / (m + p - 1)


def stage_indices(stage: int, pp_size: int, chunks: int) -> list[int]:
    """Model chunks a pipeline rank holds: ``stage``, ``stage + P``, ... (looped placement,
    which the interleaved schedule expects)."""
    return [stage + i * pp_size for i in range(chunks)]


def stage_layers(bounds: list[int], stage: int, pp_size: int, chunks: int) -> list[int]:
    """The layers a pipeline rank holds: those of its chunks (see :func:`stage_indices`),
    ``bounds`` being the chunks' layer boundaries from ``partition_layers``.

    >>> stage_layers([0, 1, 3, 4, 6], stage=0, pp_size=2, chunks=2)
    [0, 3]
    """
    return [
        i for c in stage_indices(stage, pp_size, chunks) for i in range(bounds[c], bounds[c + 1])
    ]


def make_schedule(
    name: str,
    stages: Sequence[PipelineStage],
    micro_batches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    pp_size: int,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """A schedule object; gradients are not rescaled by it (``loss_fn`` averages already).
    The interleaved schedule's micro-batches divide among the stages: a rule of
    ``config/rules.py``."""
    if name == "interleaved_1f1b":
        # a new list of the same stages: torch's signature names a list of their base class
        return ScheduleInterleaved1F1B(
            list(stages), micro_batches, loss_fn=loss_fn, scale_grads=False
        )
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return cls(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)
