"""Filling a config's ``"auto"`` values from what the training loop knows (its accumulation
steps, the loader's batch size, the model's hidden size, a placeholder optimizer's settings),
as DeepSpeed's Hugging Face integrations do. Plain values in, a resolved config out.

[Note: which side wins]
A value written in the config wins over the loop's (the front end then tells its loop, with a
warning when they differ), and ``"auto"`` takes the loop's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._schema import AUTO, ZeroConfig

__all__ = ["LoopFacts", "fill_auto"]


@dataclass(frozen=True)
class LoopFacts:
    """What a training loop knows that fills ``"auto"`` values; ``None`` where it does not."""

    world_size: int
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


def fill_auto(cfg: ZeroConfig, facts: LoopFacts) -> ZeroConfig:
    """Fill every ``"auto"`` from ``facts`` (else the key's default) and settle the batch sizes.

    >>> from ds_strategy.config import load_config
    >>> cfg = load_config({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    ...                    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
    >>> r = fill_auto(cfg, LoopFacts(world_size=2, gradient_accumulation_steps=4,
    ...                              micro_batch_size=8))
    >>> (r.train_batch_size, r.gradient_accumulation_steps, r.gradient_clipping)
    (64, 4, 0.0)
    """
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


def _fill_batch_sizes(cfg: ZeroConfig, facts: LoopFacts) -> ZeroConfig:
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
