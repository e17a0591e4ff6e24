"""What a training loop does around its engines, whichever framework drives it (Lightning's
Trainer and Fabric, Accelerate, the Hugging Face Trainer, or a plain PyTorch loop): a clip
request waiting for the optimizer step, the engines of one job saved and loaded as one
checkpoint, and the full size of their sharded parameters for a loop's model summary."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from .checkpoint.engines import holds_engines, load_engines, save_engines
from .engine import ZeroEngine
from .training import TrainingEngine

__all__ = [
    "PendingClip",
    "clipped_engine",
    "full_sizes",
    "load_all",
    "norm_only",
    "save_all",
]


def norm_only(call: str, use: str) -> str:
    """The error of a clip ZeRO cannot do (by value, or by a norm other than L2)."""
    return (
        f"{call} is not supported under ZeRO, which clips by the global L2 norm only (of all "
        f"of a model's gradients at once, inside the step that reduces the shards); use {use}"
    )


def clipped_engine(
    engines: Sequence[ZeroEngine], parameters: Iterable[Tensor], max_norm: float, norm_type: float
) -> int:
    """The index in ``engines`` of the engine a ``clip_grad_norm_(parameters, max_norm,
    norm_type)`` request clips. ZeRO clips the global L2 norm of all of one model's gradients
    at once, so ``parameters`` must be that model's, its trainable ones all included."""
    if float(norm_type) != 2.0:
        raise ValueError(norm_only(f"clip_grad_norm_(norm_type={norm_type})", "norm_type=2"))
    if not float(max_norm) > 0:
        raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): must be > 0")
    given = {id(p) for p in parameters}
    for i, engine in enumerate(engines):
        params = list(engine.module.parameters())
        if given <= {id(p) for p in params}:
            if all(id(p) in given for p in params if p.requires_grad):
                return i
            break
    raise ValueError(
        "clip_grad_norm_ clips the global norm of all the model's gradients at once; "
        "pass model.parameters() of the prepared model (a subset, or parameters of "
        "another model, cannot be clipped separately under ZeRO)"
    )


class PendingClip:
    """A clip request waiting for the optimizer step: sharded gradients have a norm only then."""

    def __init__(self) -> None:
        self.max_norm: float | None = None

    def clip(self, engine: ZeroEngine, max_norm: float) -> float | None:
        """At a boundary clip now and return the norm before clipping; else wait for the step."""
        if not engine.is_gradient_accumulation_boundary():
            self.max_norm = float(max_norm)
            return None
        return engine.clip_grad_norm_(float(max_norm))

    def step(self, engine: ZeroEngine) -> bool:
        """``engine.step()``, clipping first unless the engine's clip does it; whether it ran."""
        max_norm, self.max_norm = self.max_norm, None
        stepping = engine.is_gradient_accumulation_boundary()
        if stepping and max_norm is not None and engine.config.gradient_clipping != max_norm:
            engine.clip_grad_norm_(max_norm)
        engine.step()
        return stepping


def save_all(
    engines: Mapping[str, TrainingEngine],
    path: str | Path,
    client_state: object = None,
    include_optimizer: bool = True,
) -> None:
    """Save the engines of one job to the directory ``path``: one engine in its own layout,
    several under one commit point (``checkpoint/engines.py``). Collective."""
    if len(engines) == 1:
        engine = next(iter(engines.values()))
        engine.save_checkpoint(path, client_state=client_state, include_optimizer=include_optimizer)
    else:
        save_engines(engines, path, client_state, include_optimizer=include_optimizer)  # type: ignore[arg-type]


def load_all(
    engines: Mapping[str, TrainingEngine],
    path: str | Path,
    load_optimizer: bool = True,
    trust_checkpoint: bool = False,
) -> Any:  # the caller's own client_state, as it saved it
    """Restore what :func:`save_all` wrote (a one-engine job also from several engines'
    directory, which then names the engine); returns the client state. Collective."""
    if len(engines) == 1 and not holds_engines(Path(path)):
        engine = next(iter(engines.values()))
        return engine.load_checkpoint(
            path, load_optimizer=load_optimizer, trust_checkpoint=trust_checkpoint
        )
    return load_engines(
        engines,  # type: ignore[arg-type]
        path,
        load_optimizer=load_optimizer,
        trust_checkpoint=trust_checkpoint,
    )


def full_sizes(engines: Iterable[ZeroEngine]) -> dict[int, int]:
    """The full number of elements of each parameter the engines shard, by ``id`` (under
    ZeRO-3 a parameter is empty outside its unit's forward), for summaries that count them."""
    return {
        id(p): math.prod(shape)
        for engine in engines
        for g in engine.plan.groups
        for p, shape in zip(g.params, g.shapes, strict=True)
    }
