"""``generate()`` on a sharded model keeps the ranks in step by default.

[Note: why a sharded model's generate needs synced_gpus]
Under ZeRO-3 every forward all-gathers each block's parameters, so every rank must run the
same number of forwards. Hugging Face's ``generate`` stops a rank's loop once its sequences
are done; a rank whose prompt meets the end-of-sequence token first then stops calling forward,
and its peers wait in their next all-gather forever. ``generate(synced_gpus=True)`` keeps a
finished rank running forwards (its tokens ignored) until every rank is done, agreeing on that
with one all-reduce per token. transformers turns it on by itself only for DeepSpeed's ZeRO-3
and FSDP (``is_deepspeed_zero3_enabled()`` / ``is_fsdp_managed_module``), so a model sharded by
ds_strategy would need every caller to pass it.

:func:`sync_generation` gives each module of the model whose ``generate`` accepts
``synced_gpus`` a per-instance ``generate`` that defaults it to True. Only that instance
changes: no class is patched, and the package never imports transformers (a ``generate``
method with a ``synced_gpus`` parameter is what it looks for). A ``synced_gpus`` the caller
passes (True or False) goes through unchanged; None, transformers' "decide for me", means
True here. The engines call it once they are built: ``ZeroEngine`` when ZeRO-3 shards the
parameters over more than one rank, ``InferenceEngine`` under ZeRO-Inference. Stages 0-2
run no collective in forward and keep transformers' default (off).

The wrapper holds the method it replaces, bound to its module. ``copy.deepcopy`` of the model
rebinds that method to the copy, so a copy's ``generate`` runs on the copy.

transformers' all-reduce runs over the default process group: every rank of the job calls
``generate``, as every rank runs the training step.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["SyncedGenerate", "accepts_synced_gpus", "sync_generation"]

log = logging.getLogger(__name__)

SYNCED_GPUS = "synced_gpus"


def _signature(fn: Callable[..., object]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a callable without one
        return None


def accepts_synced_gpus(module: nn.Module) -> bool:
    """Whether ``module``'s class defines a ``generate`` method with a ``synced_gpus``
    parameter (a Hugging Face ``GenerationMixin``'s, or any with the same contract). A wrapper
    that only forwards attribute reads to its model (peft's tuners) is not one: the model
    inside it is.

    Args:
        module: any module.

    Example::

        >>> from torch import nn
        >>> accepts_synced_gpus(nn.Linear(2, 2))
        False
    """
    generate = getattr(type(module), "generate", None)
    if not callable(generate):
        return False
    sig = _signature(generate)
    return sig is not None and SYNCED_GPUS in sig.parameters


class SyncedGenerate:
    """A module's ``generate`` with ``synced_gpus`` defaulting to True.

    Args:
        inner: the ``generate`` it replaces, bound to its module.

    Example (what :func:`sync_generation` does for each module it changes)::

        model.generate = SyncedGenerate(model.generate)
        model.generate(input_ids)  # as model.generate(input_ids, synced_gpus=True)
    """

    def __init__(self, inner: Callable[..., Any]) -> None:  # a model's generate
        self.inner = inner
        functools.update_wrapper(self, inner)  # its name, docstring and signature
        sig = _signature(inner)
        self._position: int | None = None  # synced_gpus's index among positional arguments
        if sig is not None:
            for i, p in enumerate(sig.parameters.values()):
                if p.name == SYNCED_GPUS:
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                        self._position = i
                    break

    def __call__(self, *args: object, **kwargs: object) -> Any:  # generate's own output
        at = self._position
        if at is not None and len(args) > at:  # given positionally
            if args[at] is None:
                args = (*args[:at], True, *args[at + 1 :])
        elif kwargs.get(SYNCED_GPUS) is None:
            kwargs[SYNCED_GPUS] = True
        return self.inner(*args, **kwargs)


def sync_generation(module: nn.Module, *, collective_forward: bool, world_size: int) -> list[str]:
    """Make ``generate()`` default to ``synced_gpus=True`` on ``module`` and each of its
    submodules that accepts it, when forward is collective over more than one rank.

    See the note at the top of this file for why. Call it on every rank. Modules already
    changed are left as they are, so calling it twice changes nothing. A caller's explicit
    ``synced_gpus=False`` still goes through: under ZeRO-3 it hangs once the ranks' sequences
    stop at different lengths.

    Args:
        module: the model an engine wraps (a Hugging Face model, or a module holding one,
            such as a LightningModule).
        collective_forward: whether every forward runs collectives whose count must match
            across ranks (ZeRO-3's parameter all-gathers).
        world_size: how many ranks those collectives span.

    Returns:
        The names (as ``named_modules`` gives them, ``""`` for ``module``) of the modules
        whose ``generate`` now defaults to ``synced_gpus=True``.

    Example::

        engine = ds_strategy.initialize(model, opt, {"zero_optimization": {"stage": 3}})
        # ZeroEngine called sync_generation(model, collective_forward=True, world_size=2):
        model.generate(input_ids, max_new_tokens=16)  # synced_gpus=True
        model.generate(input_ids, max_new_tokens=16, synced_gpus=False)  # as asked
    """
    if not collective_forward or world_size <= 1:
        return []
    changed = []
    for name, sub in module.named_modules():
        current = sub.__dict__.get("generate")
        if isinstance(current, SyncedGenerate) or not accepts_synced_gpus(sub):
            continue
        # an instance attribute: nn.Module.__setattr__ keeps a callable in __dict__
        sub.generate = SyncedGenerate(sub.generate)  # type: ignore[method-assign]
        changed.append(name)
    if changed:
        log.debug("generate() defaults to synced_gpus=True on %s", changed)
    return changed
