"""How the Lightning front ends (Trainer and Fabric) turn their own settings into a ZeRO config.

Two layers of settings meet here: the strategy's constructor arguments (``stage``,
``offload_optimizer``, ...), which override the matching keys of the user's config, and the
loop's flags (``Trainer(precision=..., accumulate_grad_batches=..., gradient_clip_val=...)``),
which must *agree* with the config: when both say something different, the user gets an
error that names both values and the one to change, never a silent choice.

Pure functions of config objects and numbers: no process group, no Lightning import, so the
whole mapping is testable in one process.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import AUTO, ZeroConfig, load_config

__all__ = ["PRESETS", "PRECISION_KEYS", "apply_loop_flags", "base_config", "precision_key"]

ConfigSource = ZeroConfig | dict[str, Any] | str | os.PathLike | None

PRESETS: dict[str, dict[str, Any]] = {
    # registered name -> constructor arguments (the same table for Trainer and Fabric)
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3": {"stage": 3},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}

PRECISION_KEYS: dict[str, dict[str, Any]] = {
    # Lightning's precision flag -> the config keys it sets. "-true" means no fp32 copy of the
    # weights: for bf16 that is the engine's bf16.master_weights=false; fp16 always keeps fp32
    # master weights in the engine (its loss scaling needs them), so 16-true equals 16-mixed.
    "32-true": {},
    "32": {},
    "bf16-mixed": {"bf16.enabled": True},
    "bf16": {"bf16.enabled": True},
    "bf16-true": {"bf16.enabled": True, "bf16.master_weights": False},
    "16-mixed": {"fp16.enabled": True},
    "16": {"fp16.enabled": True},
    "16-true": {"fp16.enabled": True},
}


def base_config(
    source: ConfigSource,
    stage: int | None,
    offload_optimizer: bool,
    offload_parameters: bool,
) -> ZeroConfig:
    """The user's config with the strategy's explicit arguments applied.

    ``stage=None`` keeps the config's stage, or stage 2 when no config was given (DeepSpeed's
    default). Explicit arguments win over the config: they are the more specific setting.

    >>> base_config(None, None, False, False).zero_optimization.stage
    2
    >>> cfg = base_config({"zero_optimization": {"stage": 1}}, 3, True, True)
    >>> cfg.zero_optimization.stage, cfg.zero_optimization.offload_param.device
    (3, 'cpu')
    """
    cfg = load_config(source)
    changes: dict[str, Any] = {}
    if stage is not None:
        changes["zero_optimization.stage"] = stage
    elif source is None:
        changes["zero_optimization.stage"] = 2
    if offload_optimizer:
        changes["zero_optimization.offload_optimizer.device"] = "cpu"
    if offload_parameters:
        changes["zero_optimization.offload_param.device"] = "cpu"
    return cfg.replace(**changes) if changes else cfg


def precision_key(precision: str, front: str) -> str | None:
    """The config section (``"bf16"`` / ``"fp16"``) a precision flag enables, or None for fp32.

    >>> precision_key("bf16-mixed", "Trainer")
    'bf16'
    """
    if precision not in PRECISION_KEYS:
        supported = ", ".join(repr(p) for p in PRECISION_KEYS if "-" in p)
        raise ValueError(
            f"{front}(precision={precision!r}) is not supported by the ZeRO strategy, which owns "
            f"precision through its config; use one of {supported}"
        )
    keys = PRECISION_KEYS[precision]
    return next(iter(keys)).split(".")[0] if keys else None


def _accumulation(cfg: ZeroConfig, accumulate: int, world_size: int, front: str) -> int:
    """Check the config's accumulation steps (given, or implied by its batch sizes) against the
    loop's and return the value to use."""
    given = cfg.gradient_accumulation_steps
    flag = f"{front}(accumulate_grad_batches={accumulate})"
    if given not in (None, AUTO):
        if given != accumulate:
            raise ValueError(
                f"the ZeRO config sets gradient_accumulation_steps={given} but {flag}: they must "
                f"agree; set {front}(accumulate_grad_batches={given}) or remove "
                "gradient_accumulation_steps from the config"
            )
        return accumulate
    sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu)
    if all(s not in (None, AUTO) for s in sizes):
        implied = cfg.resolve(world_size).gradient_accumulation_steps
        if implied != accumulate:
            raise ValueError(
                f"the ZeRO config's batch sizes imply gradient_accumulation_steps={implied} "
                f"(train_batch_size={sizes[0]} = train_micro_batch_size_per_gpu={sizes[1]} x "
                f"{implied} x world size {world_size}) but {flag}; set "
                f"{front}(accumulate_grad_batches={implied}) or change the config's batch sizes"
            )
    return accumulate


def clipping(
    cfg: ZeroConfig, clip_val: float | None, algorithm: str | None, front: str = "Trainer"
) -> float:
    """The clipping norm the loop's ``gradient_clip_val`` asks for, checked against the
    config's ``gradient_clipping`` (clipping by value is an error)."""
    algorithm = getattr(algorithm, "value", algorithm)  # Lightning passes a str enum
    if algorithm is not None and str(algorithm).lower() == "value":
        raise ValueError(
            f"{front}(gradient_clip_algorithm='value') is not supported: ZeRO clips gradients by "
            f"their global norm (config key gradient_clipping); use "
            f"{front}(gradient_clip_algorithm='norm') or leave gradient_clip_algorithm unset"
        )
    wanted = float(clip_val or 0.0)
    given = cfg.gradient_clipping
    if given == AUTO:
        return wanted
    if wanted > 0 and given > 0 and float(given) != wanted:
        raise ValueError(
            f"the ZeRO config sets gradient_clipping={given} but {front}(gradient_clip_val="
            f"{clip_val}): they must agree; set {front}(gradient_clip_val={given}) or remove "
            "gradient_clipping from the config"
        )
    # 0 in the config is also DeepSpeed's default: it means "not set", so the flag fills it
    return wanted if wanted > 0 else float(given)


def _precision(cfg: ZeroConfig, precision: str, front: str) -> dict[str, Any]:
    key = precision_key(precision, front)
    if key is None:
        return {}  # fp32 flag: a config that enables fp16/bf16 itself is left to the engine
    other = "fp16" if key == "bf16" else "bf16"
    if getattr(cfg, other).enabled is True:
        raise ValueError(
            f"{front}(precision={precision!r}) enables {key} but the ZeRO config sets "
            f"{other}.enabled=true; set {other}.enabled to false or choose a matching precision"
        )
    return dict(PRECISION_KEYS[precision])


def apply_loop_flags(
    cfg: ZeroConfig,
    *,
    world_size: int,
    precision: str = "32-true",
    accumulate: int | None = 1,
    clip_val: float | None = None,
    clip_algorithm: str | None = None,
    front: str = "Trainer",
) -> ZeroConfig:
    """``cfg`` with the loop's precision, accumulation and clipping written in, after checking
    that the config does not contradict them (``front`` names the object in error messages).
    ``accumulate=None`` (an engine that only evaluates) leaves accumulation and clipping as
    the config has them.

    >>> cfg = apply_loop_flags(ZeroConfig(), world_size=2, accumulate=2, clip_val=1.0)
    >>> cfg.gradient_accumulation_steps, cfg.gradient_clipping
    (2, 1.0)
    """
    changes: dict[str, Any] = {}
    if accumulate is not None:
        changes["gradient_accumulation_steps"] = _accumulation(cfg, accumulate, world_size, front)
        changes["gradient_clipping"] = clipping(cfg, clip_val, clip_algorithm, front)
    changes.update(_precision(cfg, precision, front))
    return cfg.replace(**changes) if changes else cfg
