"""Activation checkpointing: chosen modules keep only their inputs in forward and recompute
their activations in backward (non-reentrant ``torch.utils.checkpoint``).

[Note: patching ``forward`` instead of wrapping the module]
A wrapper module would add a level to every parameter name, so ``state_dict()`` keys,
sharded checkpoints and ``full_state_dict()`` would differ with and without checkpointing.
Instead the chosen module's ``forward`` is replaced, on the instance, by one that runs the
original under ``checkpoint``. The module's own hooks run once, outside the checkpointed
region; hooks of modules inside it run again during the recompute, which is why ZeRO-3's
runtime treats a forward seen during backward as a recompute (gather, never release).

[Note: what ``cpu_checkpointing`` offloads]
Under non-reentrant checkpointing the only activations kept between forward and backward are
the region's inputs (held by the recompute closure). With ``cpu_checkpointing`` they are held
as CPU copies and moved back to the compute device when the recompute starts. On a CPU-only
run this changes nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import checkpoint

from ..config import ConfigError, UnsupportedConfigWarning, type_pattern
from ..config._schema import ActivationCheckpointingConfig

__all__ = [
    "SavedTensorMeter",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "remove_activation_checkpointing",
    "select_modules",
]

_WARN_KEYS = {
    "partition_activations": "activations are not partitioned across ranks",
    "contiguous_memory_optimization": "checkpointed inputs are not copied to one buffer",
    "number_checkpoints": "the modules are chosen with 'modules' and 'every'",
    "synchronize_checkpoint_boundary": "no device synchronisation is done at boundaries",
    "profile": "checkpointed forwards are not timed",
}

_ORIGINAL = "_ds_strategy_original_forward"  # instance attribute: the forward we replaced


def select_modules(
    model: nn.Module, modules: str = "blocks", every: int = 1, *, key: str = "modules"
) -> list[nn.Module]:
    """The modules ``modules`` names, in registration order, then one in ``every``.

    ``"blocks"``: the outermost elements of the model's ``nn.ModuleList`` / ``nn.Sequential``
    containers (a transformer's blocks; every layer of a Sequential). ``"type:<regex>"``:
    every module whose class name matches (searched from the root; a match's own submodules
    are not considered).

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    >>> [type(x).__name__ for x in select_modules(m, "type:Lin.*")]
    ['Linear', 'Linear']
    """
    if modules == "blocks":

        def chosen(parent: nn.Module, child: nn.Module) -> bool:
            return isinstance(parent, (nn.ModuleList, nn.Sequential))

    elif (pattern := type_pattern(modules, key)) is not None:

        def chosen(parent: nn.Module, child: nn.Module) -> bool:
            return pattern.fullmatch(type(child).__name__) is not None

    else:
        raise ConfigError(
            f"{key}: {modules!r} is not a module choice; use 'blocks' or 'type:<class name regex>'",
            key=key,
        )
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if chosen(parent, child):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out[every - 1 :: every]


def _to_cpu(x: object) -> object:
    return x.to("cpu", non_blocking=True) if torch.is_tensor(x) else x


def _checkpointed_forward(
    module: nn.Module,
    original: Callable[..., object],
    cpu: bool,
    *args: object,
    **kwargs: Any,  # the forward's own, beside checkpoint()'s typed keywords
) -> object:
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, nothing to recompute
        return original(*args, **kwargs)
    _note_held((args, kwargs))
    if not cpu:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)
    devices = [t.device for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)]
    device = devices[0] if devices else torch.device("cpu")

    def run(*a: object, **kw: object) -> object:
        a, kw = tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, (a, kw))
        return original(*a, **kw)

    cargs, ckwargs = tree_map(_to_cpu, (args, kwargs))
    return checkpoint(run, *cargs, use_reentrant=False, **ckwargs)


def _wrap(module: nn.Module, cpu: bool) -> None:
    if _ORIGINAL in module.__dict__:
        return
    original = module.forward
    module.__dict__[_ORIGINAL] = original
    module.forward = functools.partial(_checkpointed_forward, module, original, cpu)  # type: ignore[method-assign]


def checkpointed_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose forward runs under activation checkpointing."""
    return [m for m in model.modules() if _ORIGINAL in m.__dict__]


def remove_activation_checkpointing(model: nn.Module) -> None:
    """Undo :func:`apply_activation_checkpointing` on every module of ``model``."""
    for m in checkpointed_modules(model):
        del m.__dict__["forward"]
        del m.__dict__[_ORIGINAL]


def apply_activation_checkpointing(
    model: nn.Module,
    config: ActivationCheckpointingConfig,
    modules: list[nn.Module] | None = None,
) -> list[nn.Module]:
    """Checkpoint the modules ``config`` chooses (or ``modules``) when ``config.enabled``;
    returns the checkpointed modules. DeepSpeed keys without an effect here warn.

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    >>> cfg = ActivationCheckpointingConfig(enabled=True, every=2)
    >>> len(apply_activation_checkpointing(m, cfg))
    1
    """
    if not config.enabled:
        return []
    defaults = ActivationCheckpointingConfig()
    for name, why in _WARN_KEYS.items():
        if getattr(config, name) != getattr(defaults, name):
            warnings.warn(
                f"activation_checkpointing.{name}: DeepSpeed key not implemented by "
                f"ds_strategy, ignored ({why})",
                UnsupportedConfigWarning,
                stacklevel=3,
            )
    if modules is None:
        modules = select_modules(
            model, config.modules, config.every, key="activation_checkpointing.modules"
        )
        if not modules:
            raise ConfigError(
                f"activation_checkpointing.modules: {config.modules!r} chose no module of "
                f"{type(model).__name__}; use 'type:<class name regex>' naming its blocks",
                key="activation_checkpointing.modules",
            )
    for m in modules:
        _wrap(m, config.cpu_checkpointing)
    return modules


# -- measuring what autograd keeps --------------------------------------------------------------

_METER: contextvars.ContextVar[SavedTensorMeter | None] = contextvars.ContextVar(
    "ds_strategy_saved_tensor_meter", default=None
)


def _note_held(tree: object) -> None:
    if torch.compiler.is_compiling():
        return  # Dynamo cannot read a ContextVar: a compiled region's inputs are not metered
    meter = _METER.get()
    if meter is not None:
        for t in tree_flatten(tree)[0]:
            if torch.is_tensor(t):
                meter.add(t)


class SavedTensorMeter:
    """Bytes of activations autograd keeps for backward during a forward: tensors saved for
    backward plus the inputs held by checkpointed regions, each storage counted once and
    parameters excluded. Deterministic, so tests can compare it exactly.

    >>> m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    >>> with SavedTensorMeter(m) as meter:
    ...     _ = m(torch.randn(3, 4)).sum()
    >>> meter.bytes > 0
    True
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._params = (
            {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        )
        self._seen: set[int] = set()
        # Storages counted so far stay referenced until the meter exits: a tensor dropped
        # mid-forward could otherwise hand its address to a new one, which would then be
        # mistaken for the first and not counted.
        self._held: list[torch.UntypedStorage] = []
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        if isinstance(t, nn.Parameter) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or key in self._params or key == 0:
            return
        self._seen.add(key)
        self._held.append(storage)
        self.bytes += storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @contextlib.contextmanager
    def _active(self) -> Iterator[SavedTensorMeter]:
        token = _METER.set(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _METER.reset(token)
            self._held.clear()

    def __enter__(self) -> SavedTensorMeter:
        self._ctx = self._active()
        return self._ctx.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._ctx.__exit__(exc_type, exc, tb)
