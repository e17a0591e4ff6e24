"""Accelerate's ``ParallelismConfig`` read as the ZeRO config's parallel sizes (for
``ZeroAccelerator``; read by attribute, without importing Accelerate).

``sp_size`` is ``sequence_parallel_size`` (Ulysses; Accelerate's ``sp_backend="deepspeed"``),
``cp_size`` is ``context_parallel_size`` (ring attention; ``cp_backend="torch"``) and
``tp_size`` is ``tensor_parallel.autotp_size``. The data-parallel ranks are the rest of the
processes, and ZeRO shards over them and the sequence ranks together, as DeepSpeed's Ulysses
does; so ``dp_shard_size`` only has to fit. What has no counterpart is refused, naming the
field.
"""

from __future__ import annotations

from typing import Any

from ._schema import ConfigError, ZeroConfig

__all__ = ["apply_parallelism_config"]

_ATTENTION = (None, "sdpa", "eager")  # what the model's attention may be set to
_SIZES = {
    "sp_size": "sequence_parallel_size",
    "cp_size": "context_parallel_size",
    "tp_size": "tensor_parallel.autotp_size",
}


def apply_parallelism_config(cfg: ZeroConfig, pc: Any) -> ZeroConfig:
    """``cfg`` with ``pc``'s sequence, context and tensor sizes.

    Args:
        cfg: the ZeRO config.
        pc: an ``accelerate.ParallelismConfig``.
    """
    _refuse_unmapped(pc)
    changes: dict[str, int] = {}
    for field, key in _SIZES.items():
        size = int(getattr(pc, field) or 1)
        if size == 1:
            continue
        current = _value(cfg, key)
        if current not in (1, "auto", size):
            raise ConfigError(
                f"ParallelismConfig({field}={size}) but the ZeRO config has {key}={current}: "
                "keep one of them",
                key=key,
            )
        changes[key] = size
    return cfg.replace(**changes) if changes else cfg


def _value(cfg: ZeroConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _refuse_unmapped(pc: Any) -> None:
    if int(pc.dp_replicate_size or 1) > 1:
        raise ConfigError(
            f"ParallelismConfig(dp_replicate_size={pc.dp_replicate_size}): ZeRO shards over "
            "every data-parallel rank; for replicas of sharded groups (HSDP) set "
            "zero_optimization.mics_shard_size in the ZeRO config instead",
            key="zero_optimization.mics_shard_size",
        )
    if int(pc.sp_size or 1) > 1 and pc.sp_backend not in (None, "deepspeed"):
        raise ConfigError(
            f"ParallelismConfig(sp_backend={pc.sp_backend!r}): sequence parallelism here is "
            "Ulysses, Accelerate's 'deepspeed' backend",
            key="sequence_parallel_size",
        )
    if int(pc.cp_size or 1) > 1 and pc.cp_backend not in (None, "torch"):
        raise ConfigError(
            f"ParallelismConfig(cp_backend={pc.cp_backend!r}): context parallelism here is "
            "ring attention, Accelerate's 'torch' backend",
            key="context_parallel_size",
        )
    attention = getattr(pc.sp_handler, "sp_attn_implementation", None)
    if attention not in _ATTENTION:
        raise ConfigError(
            f"ParallelismConfig's sp_attn_implementation={attention!r}: the sequence-parallel "
            "attention runs on the model's own q/k/v with torch's scaled_dot_product_attention; "
            "leave it unset or 'sdpa'",
            key="sequence_parallel_size",
        )
