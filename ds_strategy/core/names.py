"""The names of a model's parameters and buffers without the wrappers around it.

``torch.compile(model)`` holds the model as ``_orig_mod``, ``DistributedDataParallel`` and
``DataParallel`` as ``module``, so ``wrapper.state_dict()`` names every tensor with that
prefix. The engine's weights (``full_state_dict``, ``save_weights``) and the names a checkpoint
records are the wrapped model's own, so they load into the plain model, and the plain model's
into a wrapped one. Only a wrapper's attribute is dropped, where the module tree holds that
wrapper: a user's own submodule called ``module`` keeps its name.

A checkpoint written before names were unwrapped may still carry ``_orig_mod``: that part
is always the compile wrapper's (no model has a reason to name a submodule so), so
:func:`saved_name` drops it from a saved name without the module tree.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

__all__ = ["COMPILED_ATTR", "plain_names", "saved_name", "unwrapped"]

COMPILED_ATTR = "_orig_mod"  # where torch.compile's OptimizedModule keeps the model

# each wrapper type and the attribute it holds the wrapped model in
_PARALLEL: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.parallel.DistributedDataParallel, "module"),
    (nn.DataParallel, "module"),
)


def _held_by_wrapper(module: nn.Module) -> str | None:
    """The attribute a wrapper holds its model in, or None for any other module."""
    # importing Dynamo costs seconds; a compiled module exists only once it is imported
    frames = sys.modules.get("torch._dynamo.eval_frame")
    if frames is not None and isinstance(module, frames.OptimizedModule):
        return COMPILED_ATTR
    for kind, attr in _PARALLEL:
        if isinstance(module, kind):
            return attr
    return None


def plain_names(module: nn.Module) -> Callable[[str], str]:
    """A function from a name in ``module.state_dict()`` (or ``named_parameters()``) to the
    name it has in the model without wrappers: each part that is a wrapper's attribute (the
    ``_orig_mod`` of ``torch.compile``, the ``module`` of DDP and ``DataParallel``), at a place
    where ``module``'s tree holds that wrapper, is dropped.

    Args:
        module: the model as given to the engine, wrapped or not, at any depth.

    Returns:
        The mapping, as a function of one name; the identity when nothing is wrapped.

    Example:
        >>> import torch
        >>> names = plain_names(torch.compile(nn.Linear(2, 2)))
        >>> names("_orig_mod.weight")
        'weight'
    """
    dropped = frozenset(
        f"{path}.{attr}" if path else attr
        for path, sub in module.named_modules(remove_duplicate=False)
        if (attr := _held_by_wrapper(sub)) is not None
    )
    if not dropped:
        return _same

    def plain(name: str) -> str:
        parts = name.split(".")
        keep = [p for i, p in enumerate(parts) if ".".join(parts[: i + 1]) not in dropped]
        return ".".join(keep)

    return plain


def _same(name: str) -> str:
    return name


def saved_name(name: str) -> str:
    """A name read from a checkpoint, without the ``_orig_mod`` parts an older save recorded
    for a compiled model (see the module's docstring).

    Args:
        name: a parameter or buffer name as a checkpoint holds it.

    Example:
        >>> saved_name("_orig_mod.blocks.0._orig_mod.attn.weight")
        'blocks.0.attn.weight'
    """
    if COMPILED_ATTR not in name:
        return name
    return ".".join(p for p in name.split(".") if p != COMPILED_ATTR)


def unwrapped(module: nn.Module) -> nn.Module:
    """``module`` without the wrappers around it at the top (``torch.compile(DDP(model))``:
    ``model``), whose names are then those :func:`plain_names` gives.

    Args:
        module: the model, wrapped or not.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> unwrapped(nn.DataParallel(lin)) is lin
        True
    """
    while (attr := _held_by_wrapper(module)) is not None:
        module = getattr(module, attr)
    return module
