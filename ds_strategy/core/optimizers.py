"""Building a ``torch.optim`` optimizer from a config's ``optimizer`` section, and marking a
rebuilt optimizer's ``step`` for the lr schedulers bound to it.

Every front end goes through these functions (the engine when no optimizer is passed,
Accelerate for a ``DummyOptim``), so a section is checked the same way everywhere: the type
must name a ``torch.optim`` class and every key of ``params`` must be an argument of it.

[Note: checked before the constructor]
A DeepSpeed config often carries options of DeepSpeed's own fused optimizers
(``torch_adam``, ``adam_w_mode``). Passed to a ``torch.optim`` class they fail with a bare
``TypeError`` (``unexpected keyword argument``) at the first use, possibly long after the
config was read; comparing the keys with the class's signature names all of them at once,
with the config key, and lists what the class does take.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..config import ConfigError, OptimizerConfig

__all__ = ["build_optimizer", "optimizer_class", "optimizer_factory", "track_optimizer_step"]

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """``torch.optim``'s optimizer classes by lower-case name (the base class left out)."""
    out = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and name != "Optimizer":
            out[name.lower()] = obj
    return out


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class a config's ``optimizer.type`` names, case-insensitively.

    >>> optimizer_class("adamw").__name__
    'AdamW'

    Raises :class:`~ds_strategy.config.ConfigError` (``key="optimizer.type"``) listing the valid
    names when ``name`` is not one of them."""
    classes = _torch_optimizers()
    cls = classes.get(str(name).lower())
    if cls is None:
        names = ", ".join(sorted(c.__name__ for c in classes.values()))
        raise ConfigError(
            f"optimizer.type: unknown optimizer {name!r}, which is not a torch.optim optimizer "
            f"class; use one of {names}",
            key="optimizer.type",
        )
    return cls


def _checked(section: OptimizerConfig | None) -> tuple[type[torch.optim.Optimizer], dict]:
    """The class and keyword arguments of ``section``, after the checks in the note above."""
    if section is None:
        raise ConfigError(
            "optimizer: the config has no 'optimizer' section; add one ({'type': 'AdamW', "
            "'params': {'lr': ...}}) or pass a torch.optim optimizer",
            key="optimizer",
        )
    cls = optimizer_class(section.type)
    params = dict(section.params)
    signature = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values()):
        return cls, params  # takes any keyword: the constructor checks them
    accepted = [k for k in signature if k not in ("self", "params")]
    unknown = sorted(k for k in params if k not in accepted)
    if unknown:
        raise ConfigError(
            f"optimizer.params: {unknown} are not arguments of torch.optim.{cls.__name__} "
            "(DeepSpeed-only options such as torch_adam / adam_w_mode have no meaning here); "
            f"remove them. {cls.__name__} takes: {', '.join(accepted)}",
            key="optimizer.params",
        )
    return cls, params


def _construct(cls: type[torch.optim.Optimizer], params: Any, kwargs: dict) -> Any:
    try:
        return cls(params, **kwargs)
    except TypeError as err:  # a value of the wrong type, say
        raise ConfigError(
            f"optimizer.params: torch.optim.{cls.__name__} rejected {sorted(kwargs)}: {err}; "
            f"keep only arguments torch.optim.{cls.__name__} accepts, with values of their type",
            key="optimizer.params",
        ) from None


def build_optimizer(
    section: OptimizerConfig | None, params: Iterable[Any]
) -> torch.optim.Optimizer:
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
    return _construct(cls, list(params), kwargs)


def optimizer_factory(section: OptimizerConfig | None) -> OptimizerFactory:
    """``params -> optimizer`` for a config's ``optimizer`` section, checked now (the same
    checks as :func:`build_optimizer`), so a bad section fails before the model is sharded.

    >>> from ds_strategy.config import OptimizerConfig
    >>> make = optimizer_factory(OptimizerConfig(type="AdamW", params={"lr": 1e-3}))
    >>> type(make([torch.nn.Parameter(torch.zeros(2))])).__name__
    'AdamW'
    """
    cls, kwargs = _checked(section)

    def factory(params: Any) -> torch.optim.Optimizer:
        return _construct(cls, params, kwargs)

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
    step: Any = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    def wrapper(*args: object, **kwargs: object) -> object:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign,assignment]
