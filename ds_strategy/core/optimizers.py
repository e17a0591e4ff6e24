"""Building an optimizer from a config's ``optimizer`` section, and moving a loop's lr
schedulers onto a rebuilt optimizer (marking its ``step`` for them).

Every front end goes through these functions (the engine when no optimizer is passed,
Accelerate for a ``DummyOptim``), so a section is checked the same way everywhere: the type
must name a ``torch.optim`` class or one of DeepSpeed's that this package implements
(``Lamb``, ``OneBitAdam``, ``OneBitLamb``, ``ZeroOneAdam``, in ``core/optim``), and every key of ``params``
must be an argument of it.

[Note: DeepSpeed's Adam flags]
DeepSpeed builds ``"Adam"`` and ``"AdamW"`` (``runtime/engine.py``,
``_configure_basic_optimizer``) as its ``FusedAdam`` with ``adam_w_mode`` defaulting to
**True**, and forced true for ``"AdamW"``: so ``{"type": "Adam", "params": {"weight_decay":
0.01}}`` trains with *decoupled* weight decay (AdamW) in DeepSpeed, and does here too; set
``adam_w_mode: false`` for Adam's L2 penalty. ``FusedAdam``'s ``weight_decay`` defaults to 0
(torch's AdamW to 0.01), which is kept unless ``torch_adam: true``, where DeepSpeed hands the
params to torch's class. Here torch's ``Adam`` / ``AdamW`` always run (``torch_adam`` changes
nothing else); only ``bias_correction: false``, which they lack, builds
:class:`ds_strategy.core.optim.Adam`.

[Note: checked before the constructor]
Passed to a class that does not take it, a key fails with a bare ``TypeError`` (``unexpected
keyword argument``) at the first use, possibly long after the config was read; comparing the
keys with the class's signature names all of them at once, with the config key, and lists what
the class does take.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import ParamsT

from ..config import ConfigError, OptimizerConfig, SchedulerConfig, ZeroConfig
from .optim import Adam, Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam
from .optim.lowbit import LOWBIT_TYPES, lowbit_class
from .optim.muon import Muon

__all__ = [
    "build_optimizer",
    "engine_schedule",
    "optimizer_class",
    "optimizer_factory",
    "optimizer_to_shard",
    "track_optimizer_step",
    "move_schedulers",
    "evaluation_optimizer",
]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[ParamsT], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
Given = TypeVar("Given")


class Optimizing(Protocol):
    """What :func:`move_schedulers` asks of an engine: its config and its rebuilt optimizer."""

    @property
    def config(self) -> ZeroConfig: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...


class Scheduling(Protocol):
    """A loop's lr scheduler, as :func:`move_schedulers` moves it: its optimizer."""

    optimizer: torch.optim.Optimizer


# DeepSpeed's optimizer types that torch.optim lacks, implemented in core/optim
_OWN: dict[str, type[torch.optim.Optimizer]] = {
    "lamb": Lamb,
    "onebitadam": OneBitAdam,
    "onebitlamb": OneBitLamb,
    "zerooneadam": ZeroOneAdam,
    # Muon for the matrices, AdamW for the rest, correct under ZeRO (torch.optim.Muon takes
    # matrices only)
    "muon": Muon,
}
# DeepSpeed's 1-bit optimizers' transport switches (MPI / NCCL): accepted, meaningless here
_TRANSPORT = ("cuda_aware", "comm_backend_name")
_ADAM_FLAGS = ("torch_adam", "adam_w_mode", "bias_correction")


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """``torch.optim``'s optimizer classes by lower-case name (the base class left out)."""
    out = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and name != "Optimizer":
            out[name.lower()] = obj
    return out


def _qualname(cls: type) -> str:
    """``torch.optim.AdamW``, ``ds_strategy.core.optim.Lamb``: where a class comes from."""
    home = "torch.optim" if cls.__module__.startswith("torch.optim") else "ds_strategy.core.optim"
    if cls.__module__.startswith("torchao.optim"):
        home = "torchao.optim"
    return f"{home}.{cls.__name__}"


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class a config's ``optimizer.type`` names, case-insensitively: a ``torch.optim``
    class, or one of DeepSpeed's in :mod:`ds_strategy.core.optim` (``Lamb``, ``OneBitAdam``,
    ``OneBitLamb``, ``ZeroOneAdam``). The name alone: the params of
    a section may change it (``Adam`` trains as ``AdamW`` by default, see the module note).

    >>> optimizer_class("adamw").__name__, optimizer_class("LAMB").__name__
    ('AdamW', 'Lamb')

    Raises :class:`~ds_strategy.config.ConfigError` (``key="optimizer.type"``) listing the valid
    names when ``name`` is not one of them."""
    key = str(name).lower()
    classes = {**_torch_optimizers(), **_OWN}
    cls = classes.get(key) or lowbit_class(key)
    if cls is None:
        names = ", ".join(sorted([*(c.__name__ for c in classes.values()), *LOWBIT_TYPES.values()]))
        raise ConfigError(
            f"optimizer.type: unknown optimizer {name!r}, which is not a torch.optim optimizer "
            f"class nor one of DeepSpeed's implemented here; use one of {names}",
            key="optimizer.type",
        )
    return cls


def _flag(params: dict, key: str, default: bool) -> bool:
    value = params.pop(key, default)
    if not isinstance(value, bool):
        raise ConfigError(
            f"optimizer.params.{key}: expected true or false, got {value!r}",
            key=f"optimizer.params.{key}",
        )
    return value


def _deepspeed_adam(name: str, params: dict) -> tuple[type[torch.optim.Optimizer], dict]:
    """The class and arguments DeepSpeed's Adam flags select (the module note)."""
    torch_adam = _flag(params, "torch_adam", False)
    decoupled = _flag(params, "adam_w_mode", True) or name == "adamw"
    bias_correction = _flag(params, "bias_correction", True)
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)
    if bias_correction:
        return (torch.optim.AdamW if decoupled else torch.optim.Adam), params
    return Adam, {**params, "bias_correction": False, "adam_w_mode": decoupled}


def _checked(section: OptimizerConfig | None) -> tuple[type[torch.optim.Optimizer], dict]:
    """The class and keyword arguments of ``section``, after the checks in the notes above."""
    if section is None:
        raise ConfigError(
            "optimizer: the config has no 'optimizer' section; add one ({'type': 'AdamW', "
            "'params': {'lr': ...}}) or pass a torch.optim optimizer",
            key="optimizer",
        )
    cls = optimizer_class(section.type)
    params = dict(section.params)
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm: not an optimizer parameter here (nor in DeepSpeed); "
            "remove it and set the top-level 'gradient_clipping' instead",
            key="optimizer.params.max_grad_norm",
        )
    flags: tuple[str, ...] = ()
    named = sorted(k for k in _TRANSPORT if k in params)
    if named and any(k in inspect.signature(cls.__init__).parameters for k in named):
        log.warning(
            "optimizer.params %s: DeepSpeed's choice of MPI / NCCL transport for %s, which "
            "means nothing here (the 1-bit exchange runs on the engine's process group); "
            "ignored",
            named,
            section.type,
        )
    if str(section.type).lower() in ("adam", "adamw"):
        cls, params = _deepspeed_adam(str(section.type).lower(), params)
        flags = _ADAM_FLAGS
    signature = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values()):
        return cls, params  # takes any keyword: the constructor checks them
    accepted = [k for k in signature if k not in ("self", "params")]
    unknown = sorted(k for k in params if k not in accepted)
    if unknown:
        also = f", and DeepSpeed's {', '.join(flags)}" if flags else ""
        raise ConfigError(
            f"optimizer.params: {unknown} are not arguments of {_qualname(cls)} (which "
            f"optimizer.type {section.type!r} builds here); remove them. {cls.__name__} takes: "
            f"{', '.join(k for k in accepted if k not in flags)}{also}",
            key="optimizer.params",
        )
    return cls, params


def _construct(
    cls: type[torch.optim.Optimizer], params: ParamsT, kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    # kwargs: the config's ``optimizer.params``, values as the user wrote them
    try:
        return cls(params, **kwargs)
    except TypeError as err:  # a value of the wrong type, say
        raise ConfigError(
            f"optimizer.params: {_qualname(cls)} rejected {sorted(kwargs)}: {err}; "
            f"keep only arguments {cls.__name__} accepts, with values of their type",
            key="optimizer.params",
        ) from None


def build_optimizer(section: OptimizerConfig | None, params: ParamsT) -> torch.optim.Optimizer:
    """The optimizer a config's ``optimizer`` section (``cfg.optimizer``) describes, over
    ``params`` (parameters or param groups, whose per-group settings are kept).

    >>> from ds_strategy.config import load_config
    >>> cfg = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    >>> build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(2))]).defaults["lr"]
    0.1

    Raises :class:`~ds_strategy.config.ConfigError` for an unknown type
    (``key="optimizer.type"``), for keys the class does not take and for a value its
    constructor rejects (``key="optimizer.params"``)."""
    cls, kwargs = _checked(section)
    # a list of the same parameters or groups: mypy loses the union's kind through list()
    return _construct(cls, cast(ParamsT, list(params)), kwargs)


def optimizer_to_shard(
    section: OptimizerConfig | None, optimizer: Given, stand_in: type, named: str, call: str
) -> Given | torch.optim.Optimizer:
    """What a loop's engine shards: the config's ``optimizer`` section built over the params
    of a ``stand_in`` (Accelerate's ``DummyOptim``, spelt ``named`` in errors), else the loop's
    own optimizer; a stand-in without a section, or a section beside the loop's own optimizer
    (passed to ``call``), is refused."""
    if isinstance(optimizer, stand_in):
        if section is None:
            raise ValueError(
                f"optimizer: {named} needs an 'optimizer' section in the ZeRO config; add one "
                f"or pass a torch.optim optimizer to {call}"
            )
        return build_optimizer(section, optimizer.params)  # type: ignore[attr-defined]
    if section is not None:
        raise ValueError(
            f"the ZeRO config has an 'optimizer' section ({section.type}) and a "
            f"{type(optimizer).__name__} was passed to {call}; remove the section or pass "
            f"{named}(model.parameters()) to use it"
        )
    return optimizer


def engine_schedule(
    section: SchedulerConfig | None,
    stand_in: object,
    callable_: SchedulerFactory | None,
    named: str,
) -> SchedulerFactory | None:
    """What the engine builds its lr scheduler from: ``None`` under a ``scheduler`` section
    (a ``stand_in``, Accelerate's ``DummyScheduler`` spelt ``named``, then only gives its
    ``"auto"`` step counts), else the stand-in's ``callable_``; one of the two, not both."""
    if section is not None and callable_ is not None:
        raise ValueError(
            f"the ZeRO config's scheduler section ({section.type}) and "
            f"{named}(lr_scheduler_callable=...) both define the lr schedule; keep one"
        )
    if section is None and stand_in is not None and callable_ is None:
        raise ValueError(
            f"{named} without lr_scheduler_callable needs a 'scheduler' section in the "
            "ZeRO config (e.g. WarmupLR); add one or pass lr_scheduler_callable"
        )
    return callable_


def optimizer_factory(section: OptimizerConfig | None) -> OptimizerFactory:
    """``params -> optimizer`` for a config's ``optimizer`` section, checked now (the same
    checks as :func:`build_optimizer`), so a bad section fails before the model is sharded.

    >>> from ds_strategy.config import OptimizerConfig
    >>> make = optimizer_factory(OptimizerConfig(type="AdamW", params={"lr": 1e-3}))
    >>> type(make([torch.nn.Parameter(torch.zeros(2))])).__name__
    'AdamW'
    """
    cls, kwargs = _checked(section)

    def factory(params: ParamsT) -> torch.optim.Optimizer:
        return _construct(cls, params, kwargs)

    # what the engine reads before building it (a low-bit optimizer's block: lowbit.py)
    factory.optimizer_class = cls  # type: ignore[attr-defined]
    factory.block = kwargs.get("block_size")  # type: ignore[attr-defined]
    return factory


def track_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way ``LRScheduler`` does when it is built, for a scheduler
    moved onto a rebuilt optimizer: otherwise the scheduler's first ``step()`` warns that the
    optimizer never stepped. Idempotent.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> track_optimizer_step(opt); track_optimizer_step(opt)
    >>> opt.step._wrapped_by_lr_sched
    True
    """
    step: Callable[..., object] = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    def wrapper(*args: object, **kwargs: object) -> object:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign,assignment]


def move_schedulers(engine: Optimizing, schedulers: Sequence[Scheduling]) -> None:
    """Point a loop's lr schedulers at ``engine.optimizer``, the one the engine rebuilt over
    its shards (the groups keep ``initial_lr``); refused when the config schedules the lr."""
    if schedulers and engine.config.scheduler is not None:
        raise ValueError(
            f"the ZeRO config's scheduler section ({engine.config.scheduler.type}) already "
            "schedules the learning rate (the engine steps it); remove the section or do not "
            "pass another lr scheduler"
        )
    for scheduler in schedulers:
        scheduler.optimizer = engine.optimizer
    if schedulers:
        track_optimizer_step(engine.optimizer)


def evaluation_optimizer(params: ParamsT) -> torch.optim.Optimizer:
    """The optimizer of an engine that only evaluates (or has nothing to train): plain SGD at
    lr 0 keeps no state and changes nothing."""
    return torch.optim.SGD(params, lr=0.0)
