"""PEFT models (LoRA and the other adapter tuners) trained by a ZeRO engine.

``adapt_peft_model(engine)`` is called by the Accelerate front end (and so by ``ZeroTrainer``)
for every engine it builds; it changes nothing unless the engine's model is a ``peft``
``PeftModel`` (or ``PeftMixedModel``). The package never imports peft for it: a PEFT model
exists only once the user has imported peft.

[Note: PEFT under ZeRO]
Training needs nothing special: the adapters are trainable parameters, the base weights frozen
ones, and the engine shards both. Three of PEFT's methods read the parameters directly, and
at stage 3 a parameter is empty between forwards:

- ``get_nb_trainable_parameters`` (and so ``print_trainable_parameters``) counted 0 and
  divided by it. PEFT falls back on a ``ds_numel`` attribute, DeepSpeed's. We do not set one:
  the architecture keeps per-parameter state off ``nn.Parameter``, and a ``ds_*`` attribute
  tells other code that DeepSpeed owns the parameter (PEFT's ``ModulesToSaveWrapper.update``
  then imports deepspeed, Lightning's model summary asserts DeepSpeed's other attributes).
  Instead the PEFT model's own method is replaced, on that instance only, by one that counts
  each parameter's full size, read from the engine (``core/zero/gathered.full_numels``).
- ``merge_and_unload`` (and ``unload``) merged empty tensors: no error, no merge. On the
  tuner instance they become the same call inside ``engine.gathered_parameters()`` over every
  parameter: every rank merges the full weights (``modifier_rank="all"``: the merge is the
  same computation on every rank, so nothing is broadcast), the merged values go back into
  the shards and masters, and the engine hands the model over (see [Note: handing the model
  over] in ``core/zero/gathered.py``): the base model returned holds its full weights on
  every rank, to save with ``save_pretrained`` or generate with, and ``full_state_dict`` or
  ``ZeroTrainer.save_model`` read the merged weights too. It is collective: every rank calls
  it, as every rank runs the training step.
- Saving the merged model through the engine: the engine's names are the PEFT model's
  (``base_model.model.<name>``). :func:`merged_base_state` gives the base model and its own
  names, which ``from_pretrained`` of the base architecture loads.

Only the instance changes: no peft class is patched. ``copy.deepcopy`` of the model copies
the replacements with their bound methods rebound to the copy; a copy, which no engine
shards, runs PEFT's own methods.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from ..core.engine import ZeroEngine
from ..core.zero.gathered import ALL_RANKS, full_numels

__all__ = ["adapt_peft_model", "merged_base_state"]


class _PeftModel(Protocol):
    """What is read and replaced on a ``PeftModel`` (an instance attribute shadows the
    method)."""

    base_model: nn.Module
    get_nb_trainable_parameters: Callable[[], tuple[int, int]]


class _Tuner(Protocol):
    """What is read and replaced on a PEFT ``BaseTuner``."""

    model: nn.Module
    merge_and_unload: Callable[..., nn.Module]
    unload: Callable[..., nn.Module]


def _peft_classes() -> tuple[tuple[type, ...], type, type] | None:
    """PEFT's model classes, tuner base class and tuner layer class; None while peft is not
    imported (then no PEFT model exists)."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftMixedModel, PeftModel
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    return (PeftModel, PeftMixedModel), BaseTuner, BaseTunerLayer


def adapt_peft_model(engine: ZeroEngine) -> bool:
    """Make the PEFT model an engine trains count and merge its sharded parameters whole (see
    [Note: PEFT under ZeRO]); nothing for another model. Calling it again changes nothing.

    Args:
        engine: a built engine; ``engine.module`` may be a ``PeftModel``.

    Returns:
        Whether ``engine.module`` is a PEFT model (adapted now or before).

    Example::

        engine = ds_strategy.initialize(get_peft_model(model, LoraConfig(...)), opt, "zero3")
        adapt_peft_model(engine)  # ZeroAccelerator.prepare and ZeroTrainer do this
        engine.module.print_trainable_parameters()  # the full model's counts
        merged = engine.module.merge_and_unload()  # collective; full weights on every rank
    """
    classes = _peft_classes()
    model = engine.module
    if classes is None or not isinstance(model, classes[0]):
        return False
    _, base_tuner, _ = classes
    if isinstance(model.__dict__.get("get_nb_trainable_parameters"), _FullCounts):
        return True
    # (isinstance against classes imported at run time cannot narrow the type)
    peft_model = cast(_PeftModel, model)
    # instance attributes: nn.Module.__setattr__ keeps a callable in __dict__
    counts = _FullCounts(engine, peft_model.get_nb_trainable_parameters)
    peft_model.get_nb_trainable_parameters = counts
    tuner = peft_model.base_model
    if isinstance(tuner, base_tuner):  # prompt learning has no tuner layers to merge
        handed = _HandedOver()
        unloading = cast(_Tuner, tuner)
        unloading.merge_and_unload = _Unloading(engine, unloading.merge_and_unload, True, handed)
        unloading.unload = _Unloading(engine, unloading.unload, False, handed)
    return True


def merged_base_state(
    model: nn.Module, state: dict[str, torch.Tensor]
) -> tuple[nn.Module, dict[str, torch.Tensor]] | None:
    """For a PEFT model whose adapters ``merge_and_unload`` (or ``unload``) removed: its base
    model and ``state`` (the engine's ``full_state_dict`` of ``model``) under the base model's
    own names. ``None`` for any other model, whose state is saved as it is.

    Args:
        model: the engine's model.
        state: its consolidated weights, named as ``model.state_dict()`` names them (``{}``
            on ranks that do not save).

    Returns:
        ``(base model, state renamed)``, or ``None``.

    Example::

        merged = trainer.model.merge_and_unload()
        base, named = merged_base_state(engine.module, engine.full_state_dict())
        base.save_pretrained("out", state_dict=named)  # loads with from_pretrained
    """
    classes = _peft_classes()
    if classes is None or not isinstance(model, classes[0]):
        return None
    _, base_tuner, tuner_layer = classes
    tuner = cast(_PeftModel, model).base_model  # (a PeftModel: see adapt_peft_model)
    if not isinstance(tuner, base_tuner) or any(
        isinstance(m, tuner_layer) for m in model.modules()
    ):
        return None
    base = cast(_Tuner, tuner).model
    prefix = next(name for name, m in model.named_modules() if m is base) + "."
    renamed = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
    return base, renamed


class _EngineMethod:
    """A PEFT method that needs the engine, in place of the instance's own (``inner``, bound
    to the PEFT object); the plain method once the engine is gone or no longer holds it."""

    def __init__(self, engine: ZeroEngine, inner: Callable[..., Any]) -> None:
        self.engine = weakref.ref(engine)
        self.inner = inner
        functools.update_wrapper(self, inner)  # its name, docstring and signature

    if TYPE_CHECKING:  # each kind of method answers its own call

        def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def owner(self) -> object:
        """The PEFT object ``inner`` is bound to."""
        return getattr(self.inner, "__self__", None)

    def live_engine(self) -> ZeroEngine | None:
        engine = self.engine()
        owner = self.owner
        if engine is None or not any(m is owner for m in engine.module.modules()):
            return None  # a deep copy of the model, or an engine freed
        return engine


class _FullCounts(_EngineMethod):
    """``get_nb_trainable_parameters`` counting each parameter whole (see the module note)."""

    def __call__(self) -> tuple[int, int]:
        engine = self.live_engine()
        if engine is None:
            return self.inner()
        numels = full_numels(engine.plan)
        trainable = total = 0
        owner = self.owner
        assert isinstance(owner, nn.Module)  # (live_engine found it in the engine's model)
        for _, p in owner.named_parameters():
            n = numels.get(id(p), p.numel())
            total += n
            trainable += n if p.requires_grad else 0
        return trainable, total


class _HandedOver:
    """Whether one of a tuner's unloading methods handed the model over already (after that
    its parameters are the model's own, full: PEFT's methods work on them as they are)."""

    done = False


class _Unloading(_EngineMethod):
    """``merge_and_unload`` / ``unload`` on the full weights, handing the model over."""

    def __init__(
        self, engine: ZeroEngine, inner: Callable[..., Any], merge: bool, handed: _HandedOver
    ) -> None:
        super().__init__(engine, inner)
        self.merge = merge
        self.handed = handed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.live_engine()
        if engine is None or self.handed.done:
            return self.inner(*args, **kwargs)
        with engine.gathered_parameters(modifier_rank=ALL_RANKS if self.merge else None) as block:
            base = self.inner(*args, **kwargs)
            block.hand_over()
        self.handed.done = True
        return base
