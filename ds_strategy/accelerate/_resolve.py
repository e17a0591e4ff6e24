"""Filling a ZeRO config from what the Accelerator knows: its mixed precision, its gradient
accumulation steps, the prepared dataloaders' batch size, the model's hidden size.

Kept free of Accelerate objects (plain values in, a config out) so it is tested in one process.

[Note: which side wins]
As in Accelerate's DeepSpeed integration: a value written in the ZeRO config wins over the
Accelerator's (the Accelerator is then told, with a warning when they differ), and ``"auto"``
takes the Accelerator's value. Mixed precision is the exception that cannot be settled by
precedence: a config enabling bf16 while Accelerate asks for fp16 (or the reverse) is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import AUTO, ConfigError, ZeroConfig

__all__ = [
    "AcceleratorFacts",
    "apply_mixed_precision",
    "build_config_optimizer",
    "resolve",
    "torch_optimizer",
]

_PRECISIONS = ("no", "fp16", "bf16")


@dataclass(frozen=True)
class AcceleratorFacts:
    """What an Accelerator contributes to "auto" values; ``None`` where it does not know."""

    world_size: int
    mixed_precision: str = "no"
    gradient_accumulation_steps: int | None = None
    micro_batch_size: int | None = None
    gradient_clipping: float | None = None
    hidden_size: int | None = None
    optimizer_lr: float | None = None
    optimizer_weight_decay: float | None = None
    # for a config scheduler's "auto" params, as Accelerate's DeepSpeed integration fills them:
    # warmup to the optimizer's lr, steps from the DummyScheduler
    base_lr: float | None = None
    warmup_num_steps: int | None = None
    total_num_steps: int | None = None


def apply_mixed_precision(cfg: ZeroConfig, mixed_precision: str) -> ZeroConfig:
    """Map Accelerate's ``mixed_precision`` ("no"/"fp16"/"bf16") onto ``fp16.enabled`` /
    ``bf16.enabled``. A section the config enables itself stays enabled.

    >>> from ds_strategy.config import load_config
    >>> apply_mixed_precision(load_config({"bf16": {"enabled": "auto"}}), "bf16").bf16.enabled
    True
    """
    mp = str(mixed_precision)
    if mp not in _PRECISIONS:
        raise ValueError(
            f"mixed_precision={mp!r} is not supported by ds_strategy; use one of "
            f"{', '.join(repr(p) for p in _PRECISIONS)}"
        )
    fp16, bf16 = cfg.fp16.enabled, cfg.bf16.enabled
    for key, enabled, wanted, other in (
        ("fp16", fp16, "fp16", "bf16"),
        ("bf16", bf16, "bf16", "fp16"),
    ):
        if enabled is True and mp == other:
            raise ConfigError(
                f"{key}.enabled is true in the ZeRO config but Accelerate's mixed_precision is "
                f"{mp!r}; make them agree (set mixed_precision={wanted!r} or {key}.enabled: false)",
                key=f"{key}.enabled",
            )
    changes: dict[str, Any] = {}
    for key, enabled in (("fp16", fp16), ("bf16", bf16)):
        # "auto", or a default false that Accelerate's setting turns on
        if enabled == AUTO or (enabled is False and mp == key):
            changes[f"{key}.enabled"] = mp == key
    return cfg.replace(**changes) if changes else cfg


def resolve(cfg: ZeroConfig, facts: AcceleratorFacts) -> ZeroConfig:
    """Fill every ``"auto"`` from ``facts`` (else the key's default) and settle the batch sizes.

    >>> from ds_strategy.config import load_config
    >>> cfg = load_config({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    ...                    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
    >>> r = resolve(cfg, AcceleratorFacts(world_size=2, gradient_accumulation_steps=4,
    ...                                   micro_batch_size=8))
    >>> (r.train_batch_size, r.gradient_accumulation_steps, r.gradient_clipping)
    (64, 4, 0.0)
    """
    cfg = apply_mixed_precision(cfg, facts.mixed_precision)
    cfg = _fill_batch_sizes(cfg, facts)
    fills: dict[str, Any] = {
        # "auto" clipping: nothing unless the loop calls clip_grad_norm_, as with Accelerate
        "gradient_clipping": facts.gradient_clipping if facts.gradient_clipping is not None else 0.0
    }
    if facts.hidden_size is not None:
        # the sizes Accelerate's DeepSpeed integration derives from model.config.hidden_size
        h = facts.hidden_size
        fills["zero_optimization.reduce_bucket_size"] = h * h
        fills["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        fills["zero_optimization.stage3_param_persistence_threshold"] = 10 * h
    if facts.optimizer_lr is not None:
        fills["optimizer.params.lr"] = facts.optimizer_lr
    if facts.optimizer_weight_decay is not None:
        fills["optimizer.params.weight_decay"] = facts.optimizer_weight_decay
    lr = facts.optimizer_lr if facts.optimizer_lr is not None else facts.base_lr
    for key, value in (
        ("warmup_min_lr", 0.0),
        ("warmup_max_lr", lr),
        ("warmup_num_steps", facts.warmup_num_steps),
        ("total_num_steps", facts.total_num_steps),
    ):
        if value is not None:
            fills[f"scheduler.params.{key}"] = value
    return cfg.resolve(facts.world_size, fills)


def _given(value: Any) -> bool:
    return value is not None and value != AUTO


def _fill_batch_sizes(cfg: ZeroConfig, facts: AcceleratorFacts) -> ZeroConfig:
    """The Accelerator's accumulation steps and the loader's batch size, for each of the two
    the config leaves open ("auto" or absent) and does not fix through the other two sizes
    (``train_batch_size = micro * accumulation * world``)."""
    tb, gas, mb = (
        cfg.train_batch_size,
        cfg.gradient_accumulation_steps,
        cfg.train_micro_batch_size_per_gpu,
    )
    changes: dict[str, Any] = {}
    open_gas = facts.gradient_accumulation_steps is not None and not _given(gas)
    if open_gas and not (_given(tb) and _given(mb)):
        gas = changes["gradient_accumulation_steps"] = facts.gradient_accumulation_steps
    open_mb = facts.micro_batch_size is not None and not _given(mb)
    if open_mb and not (_given(tb) and _given(gas)):
        changes["train_micro_batch_size_per_gpu"] = facts.micro_batch_size
    return cfg.replace(**changes) if changes else cfg


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    classes = {
        n.lower(): getattr(torch.optim, n)
        for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    }
    cls = classes.get(name.lower())
    if cls is None:
        names = ", ".join(sorted(c.__name__ for c in classes.values()))
        raise ConfigError(
            f"optimizer.type: {name!r} is not a torch.optim optimizer; use one of {names}",
            key="optimizer.type",
        )
    return cls


def build_config_optimizer(cfg: ZeroConfig, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The torch optimizer a resolved config's ``optimizer`` section describes, over
    ``params`` (parameters or param groups, e.g. those of an ``accelerate.utils.DummyOptim``),
    so per-group settings survive.

    >>> from ds_strategy.config import load_config
    >>> cfg = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    >>> type(build_config_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])).__name__
    'AdamW'
    """
    section = cfg.optimizer
    if section is None:
        raise ConfigError(
            "optimizer: accelerate.utils.DummyOptim needs an 'optimizer' section in the ZeRO "
            "config; add one or pass a torch.optim optimizer to prepare()",
            key="optimizer",
        )
    cls = _optimizer_class(section.type)
    try:
        return cls(list(params), **section.params)
    except TypeError as err:
        raise ConfigError(
            f"optimizer.params: {cls.__name__} rejected {sorted(section.params)}: {err}; keep "
            f"only arguments torch.optim.{cls.__name__} accepts",
            key="optimizer.params",
        ) from None


def torch_optimizer(cfg: ZeroConfig, optimizer: Any) -> Any:
    """The optimizer to shard: built from the config's section for a ``DummyOptim`` ("auto"
    lr / weight decay filled from it), else the user's own, which must not meet a section."""
    from accelerate.utils.deepspeed import DummyOptim

    if isinstance(optimizer, DummyOptim):
        return build_config_optimizer(cfg, optimizer.params)
    if cfg.optimizer is not None:
        raise ValueError(
            f"the ZeRO config has an 'optimizer' section ({cfg.optimizer.type}) and a "
            f"{type(optimizer).__name__} was passed to prepare(); remove the section or pass "
            "accelerate.utils.DummyOptim(model.parameters()) to use it"
        )
    return optimizer
