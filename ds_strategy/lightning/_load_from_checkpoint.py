"""``LightningModule.load_from_checkpoint`` on a checkpoint directory ``ZeroStrategy`` saved.

Lightning reads the path it is given with one ``torch.load``, which a directory fails
(``IsADirectoryError``). :func:`read_checkpoint_directories` wraps that reader
(``frontends/lightning_private.py``): a local directory is consolidated in memory, in this
process alone (no process group; any world size or stage may have saved it), into the dict
Lightning's own checkpoint file holds. That is the Trainer's entries as saved (version,
hyper-parameters, loops, callbacks) with the module's weights under ``state_dict``, as
``ds_strategy.consolidate`` writes it to a ``.ckpt`` file. A file, a URL or a stream goes to
Lightning's reader unchanged. ``import ds_strategy`` installs the wrapper once Lightning is
imported (``_lightning_hook.py``); a process that never loads a directory pays nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..core.checkpoint.consolidate import LIGHTNING_VERSION, consolidated_state
from ..core.checkpoint.deepspeed.layout import find_deepspeed
from ..frontends.lightning_private import wrap_checkpoint_reader

__all__ = ["read_checkpoint_directories", "read_lightning_directory"]


def read_checkpoint_directories() -> None:
    """Make ``load_from_checkpoint`` read a checkpoint directory of ours; calling it again is
    harmless."""
    wrap_checkpoint_reader(_reader_for)


def _reader_for(lightning_reader: Callable[..., Any]) -> Callable[..., Any]:
    def read(path_or_url: Any, map_location: Any = None, **kwargs: Any) -> Any:
        if _local_directory(path_or_url):
            weights_only = kwargs.get("weights_only")
            return read_lightning_directory(path_or_url, map_location, weights_only)
        return lightning_reader(path_or_url, map_location=map_location, **kwargs)

    return read


def _local_directory(path: Any) -> bool:
    if not isinstance(path, (str, os.PathLike)) or str(path).startswith("http"):
        return False
    return os.path.isdir(path)


def read_lightning_directory(
    path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """The checkpoint dict Lightning's own file holds, from a directory ``ZeroStrategy`` saved.

    Args:
        path: the directory ``trainer.save_checkpoint`` wrote, or its root.
        map_location: where the weights go, as ``torch.load`` takes it (a device, a string,
            a ``{"cpu": device}`` dict or a ``fn(storage, "cpu")``); they are read to the CPU.
        weights_only: ``False`` trusts the checkpoint: its entries may hold objects other
            than plain data (Lightning's ``load_from_checkpoint(..., weights_only=False)``).

    Example::

        checkpoint = read_lightning_directory("lightning_logs/version_0/checkpoints/last.ckpt")
        checkpoint["hyper_parameters"], checkpoint["state_dict"]["head.weight"]
    """
    where = Path(path)
    if find_deepspeed(where.absolute(), None) is not None:
        raise ValueError(
            f"{where}: a DeepSpeed checkpoint. load_from_checkpoint reads a directory only when "
            "ds_strategy's ZeroStrategy saved it; convert this one to a file first with "
            "lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict"
        )
    try:
        weights, entries = consolidated_state(where, trust_checkpoint=weights_only is False)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{where}: load_from_checkpoint reads a directory only when ds_strategy's "
            f"ZeroStrategy saved it (trainer.save_checkpoint), and this one it did not: {e}"
        ) from None
    if not isinstance(entries, dict) or LIGHTNING_VERSION not in entries:
        raise ValueError(
            f"{where}: a ds_strategy checkpoint, but no Lightning Trainer saved it (it holds no "
            f"'{LIGHTNING_VERSION}'), so it has no hyper-parameters to build the module from; "
            "build the module yourself and load ds_strategy.consolidate's weights into it "
            "(model.load_state_dict)"
        )
    checkpoint = {k: v for k, v in entries.items() if k not in ("state_dict", "optimizer_states")}
    checkpoint["state_dict"] = {k: _placed(t, map_location) for k, t in weights.items()}
    return checkpoint


def _placed(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    """``t`` (on the CPU) where ``torch.load(..., map_location)`` would put it."""
    if map_location is None:
        return t
    if callable(map_location):  # torch.load's fn(storage, location) -> storage or None
        moved = map_location(t.untyped_storage(), "cpu")
        return t if moved is None else t.to(moved.device)
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return t if target is None else t.to(target)
    return t.to(map_location)
