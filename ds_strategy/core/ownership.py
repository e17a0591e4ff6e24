"""Which engine holds a parameter. Two engines over one parameter would each shard it, keep
their own master copy and step it, each overwriting the other's update: a model shared by two
engines (a module in both a generator and a discriminator, a reference model holding the
policy's own weights) is refused when the second engine is built, naming the parameter."""

from __future__ import annotations

import weakref
from typing import Protocol

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["check_parameters_free", "claim_parameters", "release_parameters"]


class Owner(Protocol):
    """An engine as the table knows it: the module it was built over (named in errors)."""

    @property
    def module(self) -> nn.Module: ...


# parameter -> a weak reference to its engine (kept off the parameter: a deepcopy of the
# model must not carry it, and both sides are weak: neither is kept alive by this table)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def check_parameters_free(model: nn.Module) -> None:
    """Raise if a live engine holds a parameter of ``model`` (before a new engine touches
    any: at stage 3 building it would shard the other engine's weights)."""
    for name, p in model.named_parameters():
        ref = _OWNERS.get(p)
        other = ref() if ref is not None else None
        if other is not None:
            raise ValueError(
                f"parameter {name!r} of {type(model).__name__} already belongs to another "
                f"engine (built over a {type(other.module).__name__}): two engines cannot "
                "shard or step one parameter. Put the modules that share it in one model "
                "(one engine), give this model its own copy (copy.deepcopy), or destroy() "
                "the other engine first"
            )


def claim_parameters(model: nn.Module, engine: Owner) -> list[weakref.ref[nn.Parameter]]:
    """Mark ``model``'s parameters as ``engine``'s (once it is built: a constructor that
    raised claims nothing). Returns what :func:`release_parameters` releases."""
    claimed = []
    for p in model.parameters():
        _OWNERS[p] = weakref.ref(engine)
        claimed.append(weakref.ref(p))
    return claimed


def release_parameters(claimed: list[weakref.ref[nn.Parameter]], engine: Owner) -> None:
    for ref in claimed:
        p = ref()
        owner = _OWNERS.get(p) if p is not None else None
        if owner is not None and owner() is engine:
            del _OWNERS[p]
