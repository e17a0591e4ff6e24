"""Small operations both Lightning front ends (Trainer and Fabric) perform on a ``ZeroEngine``.

Nothing here knows how the engine shards: these are loop-level helpers written against the
engine's public surface (``step``, ``config``, ``full_state_dict``, ``rank``, ``comm``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.engine import ZeroEngine

__all__ = [
    "inference_optimizer",
    "move_real_tensors",
    "save_consolidated",
    "step_with_clip",
    "write_weights",
]


def step_with_clip(engine: ZeroEngine, max_norm: float | None) -> bool:
    """``engine.step()``; when it runs the optimizer and ``max_norm`` is given, first clip the
    global gradient norm at ``max_norm`` (``engine.clip_grad_norm_``). Returns whether the
    optimizer ran.

    A clip request made between accumulation boundaries (``fabric.clip_gradients`` or
    ``LightningModule.clip_gradients`` while gradients are still accumulating) is kept by the
    caller and passed here, so it clips the accumulated gradients of the next optimizer step.
    A request equal to the config's ``gradient_clipping`` is left to the engine's own clip.
    """
    stepping = engine.is_gradient_accumulation_boundary()
    if stepping and max_norm is not None and float(engine.config.gradient_clipping) != max_norm:
        engine.clip_grad_norm_(max_norm)
    engine.step()
    return stepping


def inference_optimizer(params: Any) -> torch.optim.Optimizer:
    """Engines built only to evaluate still need an optimizer; plain SGD at lr 0 keeps no state."""
    return torch.optim.SGD(params, lr=0.0)


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer that is not on the meta device to ``device`` (the engine
    materialises the meta ones on the device of the real ones, so both must agree)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def _detach_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Tied weights appear under every name as one tensor; safetensors refuses shared storage.
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    return out


def save_consolidated(
    engine: ZeroEngine, path: str | os.PathLike, prefix: str = "", barrier: bool = True
) -> Path:
    """Write the engine's consolidated fp32 weights to one file (collective; rank 0 writes).

    A path ending in ``.safetensors`` is written with safetensors, anything else with
    ``torch.save``. ``prefix`` is stripped from every key (the Lightning front end wraps the
    LightningModule in one module, whose name it removes here).
    """
    state = engine.full_state_dict(rank0_only=True)  # collective: every rank must call it
    if prefix:
        state = {k.removeprefix(prefix): v for k, v in state.items()}
    path = Path(path)
    if engine.rank == 0:
        write_weights(state, path)
    if barrier:
        engine.comm.barrier()
    return path


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` to one file: safetensors for a ``.safetensors`` path, else ``torch.save``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(_detach_shared({k: v.cpu() for k, v in state.items()}), str(path))
    else:
        torch.save({k: v.cpu() for k, v in state.items()}, path)
