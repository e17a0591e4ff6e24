"""The training loops parity tests compare: plain single-process PyTorch on the global batch,
and a ZeroEngine on this rank's share of it (accumulation, global-norm clipping)."""

from __future__ import annotations

from typing import Any

import torch

import ds_strategy
from tests.models import lm_loss, make_optimizer


def parity_config(stage: int, accum: int, clip: float, **extra: Any) -> dict[str, Any]:
    """Small buckets and persistence threshold, so even a toy model spans several buckets
    and ZeRO-3 units; ``extra`` adds top-level sections."""
    return {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2000,
            "stage3_param_persistence_threshold": 30,
        },
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        **extra,
    }


def train_reference(
    model: torch.nn.Module,
    kind: str,
    data: list[torch.Tensor],
    steps: int,
    accum: int,
    clip: float,
    norms: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps of ``accum`` micro-batches each, clipped at ``clip`` (each
    step's norm before clipping appended to ``norms``, when given)."""
    opt = make_optimizer(kind, model)
    for step in range(steps):
        for micro in range(accum):
            (lm_loss(model, data[step * accum + micro]) / accum).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def train_engine(
    model: torch.nn.Module,
    kind: str,
    config: dict[str, Any],
    data: list[torch.Tensor],
    rank: int,
    world: int,
    steps: int,
) -> ds_strategy.ZeroEngine:
    """The same loop through a ZeroEngine built from ``config`` (whose
    ``gradient_accumulation_steps`` is the reference's ``accum``), on this rank's slice of
    every global batch; returns the engine."""
    engine = ds_strategy.initialize(model, make_optimizer(kind, model), config)
    accum = engine.gradient_accumulation_steps
    for step in range(steps):
        for micro in range(accum):
            batch = data[step * accum + micro]
            per = batch.shape[0] // world
            engine.backward(lm_loss(engine, batch[rank * per : (rank + 1) * per]))
            engine.step()
    return engine
