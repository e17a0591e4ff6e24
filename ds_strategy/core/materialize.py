"""Materialise parameters created on the meta device, a few modules at a time.

Parameters on the meta device cannot take real storage in place (``set_data`` refuses the
device change), so each one is replaced by a new ``nn.Parameter`` in every module that holds
it; tied weights stay tied because the same old object maps to the same new one. The map
old -> new lets the engine rebuild an optimizer that was built on the meta parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["has_meta", "materialize_modules"]

ParamInit = Callable[[nn.Module], None]


def has_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()])


def _post_order(modules: Iterable[nn.Module]) -> list[nn.Module]:
    # Children first: a parent's reset_parameters may override its children's defaults
    # (nn.MultiheadAttention zeroes out_proj.bias), exactly as in eager construction.
    seen: set[int] = set()
    out: list[nn.Module] = []
    for m in reversed(list(modules)):
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def materialize_modules(
    modules: Iterable[nn.Module],
    device: torch.device,
    replaced: dict[int, nn.Parameter],
    param_init_fn: ParamInit | None = None,
    names: dict[int, str] | None = None,
    init: bool = True,
) -> None:
    """Give real storage on ``device`` to the meta parameters and buffers held directly by
    ``modules`` and initialise them (``param_init_fn(module)``, else ``reset_parameters()``;
    ``init=False``: leave them uninitialised, for values about to be loaded)."""
    for m in _post_order(modules):
        direct = [*m._parameters.values(), *m._buffers.values()]
        if not any(t is not None and t.device.type == "meta" for t in direct):
            continue
        for name, p in list(m._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            new = replaced.get(id(p))
            if new is None:
                new = nn.Parameter(
                    torch.empty_like(p, device=device), requires_grad=p.requires_grad
                )
                replaced[id(p)] = new
            m._parameters[name] = new
        for name, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                m._buffers[name] = torch.zeros_like(b, device=device)
        if init:
            _init(m, param_init_fn, (names or {}).get(id(m), type(m).__name__))


def _init(m: nn.Module, param_init_fn: ParamInit | None, where: str) -> None:
    if param_init_fn is not None:
        with torch.no_grad():
            param_init_fn(m)
    elif callable(getattr(m, "reset_parameters", None)):
        with torch.no_grad():
            m.reset_parameters()  # type: ignore[operator]
    elif any(True for _ in m.parameters(recurse=False)):
        raise ValueError(
            f"module '{where}' ({type(m).__name__}) has parameters on the meta device but no "
            "reset_parameters() to initialise them; pass param_init_fn=fn to "
            "ds_strategy.initialize, where fn(module) initialises module's own parameters"
        )
