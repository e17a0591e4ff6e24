"""``save_state`` / ``load_state`` for a :class:`ZeroAccelerator`: the engine writes its sharded
checkpoint (loadable at any world size or stage) under ``<output_dir>/zero_checkpoint``;
Accelerate's own helpers write what else it tracks (schedulers it steps, samplers, RNG
states, its step, objects registered for checkpointing) beside it, as with DeepSpeed.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from accelerate import Accelerator
from accelerate.checkpointing import (
    load_accelerator_state,
    save_accelerator_state,
    save_custom_state,
)

from ..core.checkpoint.trust import loads
from ..core.collectives import Comm
from ..core.faults import together
from ..core.training import TrainingEngine

__all__ = ["ENGINE_DIR", "load_state", "save_state"]

ENGINE_DIR = "zero_checkpoint"


def _iteration(folder: str) -> int:
    found = re.findall(r"(\d+)$", os.path.basename(folder.rstrip("/")))
    return int(found[0]) if found else -1


def _automatic_dirs(acc: Accelerator) -> list[str]:
    root = os.path.join(acc.project_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted((os.path.join(root, f) for f in os.listdir(root)), key=_iteration)


def _save_dir(acc: Accelerator, output_dir: str | None) -> str:
    """``output_dir``, or with ProjectConfiguration(automatic_checkpoint_naming=True) the next
    ``checkpoints/checkpoint_<i>`` (oldest removed beyond ``total_limit``), as Accelerate does."""
    config = acc.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir (or automatic_checkpoint_naming)")
        return os.fspath(output_dir)
    existing = _automatic_dirs(acc)
    limit = config.total_limit
    if limit is not None and len(existing) + 1 > limit and acc.is_main_process:
        for folder in existing[: len(existing) + 1 - limit]:
            shutil.rmtree(folder)
    path = os.path.join(acc.project_dir, "checkpoints", f"checkpoint_{acc.save_iteration}")
    if os.path.exists(path):
        raise ValueError(
            f"{path} already exists: set accelerator.project_configuration.iteration to the "
            "iteration to save next"
        )
    acc.wait_for_everyone()  # every rank checked before any rank creates it
    return path


def save_state(
    acc: Accelerator, engine: TrainingEngine, output_dir: str | None, safe_serialization: bool
) -> str:
    """The engine (ZeRO or pipeline) writes its checkpoint; Accelerate's helpers the rest.
    Collective."""
    path = _save_dir(acc, output_dir)
    world = Comm()
    # a rank failing in its own part (a read-only mount, a hook raising) fails every rank
    # instead of leaving them waiting in the next collective (see core/faults.py)
    with together(world):
        os.makedirs(path, exist_ok=True)
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, [], path)  # as with DeepSpeed: the engine, no consolidated weights
    engine.save_checkpoint(os.path.join(path, ENGINE_DIR))
    with together(world):
        _save_rest(acc, path, safe_serialization)
    acc.project_configuration.iteration += 1
    return path


def _save_rest(acc: Accelerator, path: str, safe_serialization: bool) -> None:
    save_accelerator_state(
        path,
        [],
        [],
        acc._schedulers,
        acc._dataloaders,
        acc.state.process_index,
        acc.step,
        None,
        save_on_each_node=acc.project_configuration.save_on_each_node,
        safe_serialization=safe_serialization,
    )
    for i, obj in enumerate(acc._custom_objects):
        save_custom_state(
            obj, path, i, save_on_each_node=acc.project_configuration.save_on_each_node
        )


def load_state(
    acc: Accelerator, engine: TrainingEngine, input_dir: str | None, trust_checkpoint: bool
) -> None:
    """Nothing is unpickled beyond tensors and plain data unless ``trust_checkpoint``: the
    engine's checkpoint, and the objects registered with ``register_for_checkpointing``
    (which Accelerate itself would unpickle in full)."""
    world = Comm()
    with together(world):
        path = _load_dir(acc, input_dir)
        for hook in acc._load_model_state_pre_hook.values():
            hook(acc._models, path)
    engine.load_checkpoint(os.path.join(path, ENGINE_DIR), trust_checkpoint=trust_checkpoint)
    with together(world):
        _load_rest(acc, path, trust_checkpoint)


def _load_dir(acc: Accelerator, input_dir: str | None) -> str:
    if input_dir is not None:
        path = os.path.expanduser(os.fspath(input_dir))
    elif acc.project_configuration.automatic_checkpoint_naming:
        found = _automatic_dirs(acc)
        if not found:
            raise ValueError(f"no checkpoint under {os.path.join(acc.project_dir, 'checkpoints')}")
        path = found[-1]
    else:
        raise ValueError("load_state needs input_dir (or automatic_checkpoint_naming)")
    if not os.path.isdir(os.path.join(path, ENGINE_DIR)):
        raise FileNotFoundError(
            f"{path}: no {ENGINE_DIR}/ here; pass a directory written by ZeroAccelerator.save_state"
        )
    return path


def _load_rest(acc: Accelerator, path: str, trust_checkpoint: bool) -> None:
    restored = load_accelerator_state(
        path, [], [], acc._schedulers, acc._dataloaders, acc.state.process_index, None, "cpu"
    )
    if "step" in restored:
        acc.step = restored["step"]
    saved = [f for f in os.listdir(path) if re.fullmatch(r"custom_checkpoint_\d+\.pkl", f)]
    if len(saved) != len(acc._custom_objects):
        raise RuntimeError(
            f"{path}: {len(saved)} custom checkpoint(s) saved but {len(acc._custom_objects)} "
            "object(s) registered with register_for_checkpointing; register the same objects"
        )
    for i, obj in enumerate(acc._custom_objects):
        f = Path(path) / f"custom_checkpoint_{i}.pkl"
        obj.load_state_dict(loads(f.read_bytes(), str(f), trust_checkpoint))
