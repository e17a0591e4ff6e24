"""Every use of ``accelerate.Accelerator``'s private state, in one place: the lists of what it
tracks, the hooks ``save_state``/``load_state`` run, and the flag ``prepare`` sets on what it
returned. Checked against accelerate 1.16.0 (and the package's floor, 1.0: these names are the
same there). A new accelerate that renames them breaks here, and only here.

Accelerate has no public way to register an object it did not prepare itself (the engine and
its optimizer wrapper stand where its DDP model and ``AcceleratedOptimizer`` would), nor to
run its save/load model hooks for an engine that writes its own checkpoint.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

__all__ = [
    "custom_objects",
    "is_prepared",
    "mark_prepared",
    "prepared_objects",
    "run_load_hooks",
    "run_save_hooks",
    "track",
    "tracked",
]

# Accelerator._models, ._optimizers, ._schedulers, ._dataloaders
_KINDS = {kind: f"_{kind}s" for kind in ("model", "optimizer", "scheduler", "dataloader")}


def tracked(acc: Accelerator, kind: str) -> list[Any]:
    """What ``acc`` tracks as prepared ``kind`` (model, optimizer, scheduler, dataloader):
    ``save_state``, ``free_memory`` and ``accumulate`` see these."""
    return getattr(acc, _KINDS[kind])


def track(acc: Accelerator, kind: str, obj: Any) -> None:
    tracked(acc, kind).append(obj)


def prepared_objects(acc: Accelerator) -> tuple[list[Any], ...]:
    return tuple(tracked(acc, kind) for kind in _KINDS)


def mark_prepared(obj: Any) -> None:
    """Flag ``obj`` as ``prepare`` flags what it returns, so that a later ``prepare`` passes it
    through."""
    obj._is_accelerate_prepared = True


def is_prepared(obj: Any) -> bool:
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def custom_objects(acc: Accelerator) -> list[Any]:
    """The objects registered with ``register_for_checkpointing``."""
    return acc._custom_objects


def run_save_hooks(acc: Accelerator, path: str) -> None:
    """The hooks ``register_save_state_pre_hook`` added, given the models (no weights, as
    under DeepSpeed: the engine writes its own)."""
    for hook in acc._save_model_state_pre_hook.values():
        hook(acc._models, [], path)


def run_load_hooks(acc: Accelerator, path: str) -> None:
    """The hooks ``register_load_state_pre_hook`` added, given the models."""
    for hook in acc._load_model_state_pre_hook.values():
        hook(acc._models, path)
