"""Consolidated weights to one file: ``.safetensors`` (safetensors) or anything else
(``torch.save``). What ``engine.save_weights`` writes, for either engine."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["write_weights"]


def _detach_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Tied weights appear under every name as one tensor; safetensors refuses shared storage.
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    return out


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` to one file: safetensors for a ``.safetensors`` path, else ``torch.save``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(_detach_shared({k: v.cpu() for k, v in state.items()}), str(path))
    else:
        torch.save({k: v.cpu() for k, v in state.items()}, path)
