"""DeepSpeed's pickles without DeepSpeed and without running code from the file.

A DeepSpeed checkpoint is ``torch.save`` output whose small objects include a few of
DeepSpeed's own classes: the loss scaler, the ZeRO stage enum, a fragment's address. They load
here as plain records (:class:`LossScalerState`, :class:`ZeroStage`, :class:`FragmentAddress`)
through torch's weights-only unpickler, which allows exactly those names besides tensors and
plain data, and refuses any other global, naming it (see [Note: pickles in a checkpoint] in
``trust.py``). ``trust_checkpoint=True`` loads any other object too, the DeepSpeed classes
still as records, so DeepSpeed need not be installed either way.

[Note: a tensor holds no more than its file stores]
A tensor in the file is a storage (bytes of the file, memory-mapped) and a size, stride and
offset into it, all declared by the pickle. Declared beyond its storage, the rebuild fails in
torch (a mapped storage cannot grow). Declared with stride 0, a tensor of 5e9 elements is a
view of one stored element: nothing fails until something copies it (``torch.cat``,
``.contiguous()``, a dtype change) and allocates 20 GB. So every tensor of a loaded file is
checked before the file's content is returned: it is dense, on the CPU, and holds no more
elements than its storage (an expanded tensor, which DeepSpeed never saves, is refused), and
every element it addresses is stored. Every size used later is then bounded by the file's.
torch's weights-only unpickler has no hook at the rebuild; the rebuild allocates nothing (a
tensor is a view of the mapped file), so checking as the load returns is still before
anything allocates. Any other failure to read the file (truncated, not ``torch.save``'s, a
storage that is not there) is a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from ..trust import UntrustedContentError, refused_global
from ..validate import CheckpointError

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

    def find_class(self, module: str, name: str) -> object:  # a class or function
        record = RECORDS.get(f"{module}.{name}")
        return record if record is not None else super().find_class(module, name)


_TRUSTED = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def load_pickle(path: Path, trust_checkpoint: bool = False, mmap: bool = True) -> object:
    """The object ``torch.save`` wrote at ``path`` (tensors memory-mapped with ``mmap``), each
    of its tensors checked against the bytes stored for it (see [Note: a tensor holds no more
    than its file stores])."""
    obj = _load(path, trust_checkpoint, mmap)
    for t in _tensors(obj):
        _check_tensor(t, path)
    return obj


def _load(path: Path, trust_checkpoint: bool, mmap: bool) -> object:
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
    except OSError:
        raise  # the file is missing or unreadable: not its content
    except Exception as e:  # noqa: BLE001 - any other failure to unpickle is a damaged file
        said = " ".join(str(e).split())[:300]
        raise CheckpointError(
            f"{path}: cannot be read ({type(e).__name__}: {said}); the file is truncated, "
            "damaged or crafted (a tensor declared larger than the bytes stored for it, for "
            "one): restore it from a good copy"
        ) from None


def _tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``'s containers and records, each once (a pickle may share or
    nest them, even in a cycle)."""
    seen: set[int] = set()
    todo: list[object] = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, (str, bytes, int, float)) or x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo.extend(x)
        elif isinstance(getattr(x, "__dict__", None), dict):
            todo.extend(vars(x).values())


def _check_tensor(t: torch.Tensor, path: Path) -> None:
    if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
        raise CheckpointError(
            f"{path}: holds a {t.layout} tensor on {t.device}; DeepSpeed's checkpoints hold "
            "dense tensors with their data: the file is damaged or crafted, refusing to read it"
        )
    held = t.untyped_storage().nbytes() // t.element_size()
    if t.numel() == 0:
        return
    offset, sizes, strides = t.storage_offset(), tuple(t.shape), t.stride()
    end = offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    if t.numel() > held or end > held or min(strides, default=0) < 0:
        raise CheckpointError(
            f"{path}: a tensor declares {t.numel()} elements (shape {list(sizes)}, strides "
            f"{list(strides)}, offset {offset}) over a storage of {held}; a tensor never holds "
            "more elements than the file stores for it: the file is damaged or crafted, "
            "refusing to read it"
        )
