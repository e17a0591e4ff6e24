"""Where ``ZeroAccelerator.save_state`` writes and what ``load_state`` reads: a bundle
(``core/checkpoint/bundle.py``: one commit point for the engines and every file Accelerate
writes, checked whole before a load changes anything), in ``output_dir`` or in Accelerate's
automatically named ``checkpoints/checkpoint_<i>``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from accelerate import Accelerator

from ..core.checkpoint.bundle import Bundle, named
from ..core.checkpoint.deepspeed.layout import engine_dir

__all__ = [
    "ENGINE_DIR",
    "MANIFEST",
    "SAVE_STATE",
    "automatic_dirs",
    "load_target",
    "save_target",
]

ENGINE_DIR = "zero_checkpoint"
MANIFEST = "ds_strategy_accelerate.json"
SAVE_STATE = Bundle(
    manifest=MANIFEST,
    format="ds_strategy-accelerate-1",
    what="save_state",
    engines=ENGINE_DIR,
    engines_alone="accelerator.zero_engine.load_checkpoint",
)
_AUTOMATIC = re.compile(r"checkpoint_(\d+)")


def automatic_dirs(acc: Accelerator) -> tuple[Path, list[Path]]:
    """Accelerate's ``checkpoints`` folder, and its committed ``checkpoint_<i>`` folders by
    ``i`` (a ``.tmp``/``.old`` beside them, or a folder of another name, is none of them)."""
    root = Path(acc.project_dir) / "checkpoints"
    found = [p for p in root.iterdir() if _AUTOMATIC.fullmatch(p.name)] if root.is_dir() else []
    return root, sorted((p for p in found if p.is_dir()), key=lambda p: int(p.name[11:]))


def save_target(
    acc: Accelerator, output_dir: str | os.PathLike[str] | None
) -> tuple[Path | None, Path]:
    """``(root, directory)`` of a save: ``output_dir`` (no root), or the next
    ``checkpoints/checkpoint_<i>`` as Accelerate names it (its ``checkpoints`` root)."""
    config = acc.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir (or automatic_checkpoint_naming)")
        return None, named(output_dir)
    root, _ = automatic_dirs(acc)
    path = root / f"checkpoint_{acc.save_iteration}"
    if path.exists():
        raise ValueError(
            f"{path} already exists: set accelerator.project_configuration.iteration to the "
            "iteration to save next"
        )
    acc.wait_for_everyone()  # every rank checked before any rank creates it
    return root, path


def load_target(acc: Accelerator, input_dir: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """The directory to load (the previous content where a save replacing it was
    interrupted), and the engine's checkpoint in it: ours, or DeepSpeed's where Accelerate
    saved with DeepSpeed (its own files beside it are the same)."""
    if input_dir is not None:
        path = SAVE_STATE.committed(named(input_dir))
    elif acc.project_configuration.automatic_checkpoint_naming:
        root, found = automatic_dirs(acc)
        if not found:
            raise ValueError(f"no checkpoint under {root}")
        path = found[-1]
    else:
        raise ValueError("load_state needs input_dir (or automatic_checkpoint_naming)")
    engine_path = engine_dir(path, ENGINE_DIR)
    if engine_path is None:
        raise FileNotFoundError(
            f"{path}: no {ENGINE_DIR}/ here, nor a DeepSpeed checkpoint (latest and its tag "
            "directory); pass a directory written by save_state (ZeroAccelerator's, or "
            "Accelerate's with DeepSpeed)"
        )
    return path, engine_path
