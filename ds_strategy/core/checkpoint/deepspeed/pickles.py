"""DeepSpeed's pickles without DeepSpeed and without running code from the file.

A DeepSpeed checkpoint is ``torch.save`` output whose small objects include a few of
DeepSpeed's own classes: the loss scaler, the ZeRO stage enum, a fragment's address. They load
here as plain records (:class:`LossScalerState`, :class:`ZeroStage`, :class:`FragmentAddress`)
through torch's weights-only unpickler, which allows exactly those names besides tensors and
plain data, and refuses any other global, naming it (see [Note: pickles in a checkpoint] in
``trust.py``). ``trust_checkpoint=True`` loads any other object too, the DeepSpeed classes
still as records, so DeepSpeed need not be installed either way.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

from ..trust import UntrustedContentError, refused_global

__all__ = ["FragmentAddress", "LossScalerState", "ZeroStage", "load_pickle"]


class LossScalerState:
    """DeepSpeed's ``LossScaler`` / ``DynamicLossScaler``: its attributes (``cur_scale``,
    ``cur_iter``, ``last_overflow_iter``, ``scale_window``, ``delayed_shift``, ...)."""

    def __repr__(self) -> str:
        return f"LossScalerState({vars(self)})"


class FragmentAddress:
    """DeepSpeed's ``fragment_address``: ``numel`` elements at ``start`` of a flat partition."""

    numel: int
    start: int


class ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum``: the stage as an int."""


RECORDS: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}


class _Unpickler(pickle.Unpickler):
    """For a trusted file: DeepSpeed's classes as records, anything else as pickle finds it."""

    def find_class(self, module: str, name: str) -> Any:
        record = RECORDS.get(f"{module}.{name}")
        return record if record is not None else super().find_class(module, name)


_TRUSTED = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def load_pickle(path: Path, trust_checkpoint: bool = False, mmap: bool = True) -> Any:
    """The object ``torch.save`` wrote at ``path`` (tensors memory-mapped with ``mmap``)."""
    try:
        if trust_checkpoint:
            return torch.load(
                path, map_location="cpu", weights_only=False, pickle_module=_TRUSTED, mmap=mmap
            )
        with torch.serialization.safe_globals([(c, n) for n, c in RECORDS.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UntrustedContentError(
            f"{path}: holds {refused_global(str(e))}, which loading does not unpickle unless "
            "the checkpoint is trusted (tensors, plain data and DeepSpeed's loss scaler, ZeRO "
            "stage and fragment records load by default); pass trust_checkpoint=True if you "
            "trust who wrote it"
        ) from None
