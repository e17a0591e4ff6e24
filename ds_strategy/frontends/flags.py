"""A front end's settings as a ZeRO config: arguments override it, loop flags must agree."""

from __future__ import annotations

import os
from typing import Any

from ..config import AUTO, ConfigError, ZeroConfig, load_config

__all__ = [
    "PRECISION_KEYS",
    "PRESETS",
    "apply_loop_flags",
    "apply_mixed_precision",
    "apply_precision",
    "base_config",
    "check_precision",
    "clipping",
]

ConfigSource = ZeroConfig | dict[str, Any] | str | os.PathLike | None

PRESETS: dict[str, dict[str, Any]] = {  # registered name -> constructor arguments
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero2_offload": {"stage": 2, "offload_optimizer": True},
    "zero3": {"stage": 3},
    "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
}

PRECISION_KEYS: dict[str, dict[str, Any]] = {
    # "-true": no fp32 master weights, but fp16's loss scaling needs them: 16-true is 16-mixed
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
    source: ConfigSource, stage: int | None, offload_optimizer: bool, offload_parameters: bool
) -> ZeroConfig:
    """The user's config with the strategy's explicit (more specific) arguments applied;
    ``stage=None`` keeps the config's stage, or DeepSpeed's default 2 when there is no config.

    >>> base_config(None, None, False, False).zero_optimization.stage
    2
    >>> cfg = base_config({"zero_optimization": {"stage": 1}}, 3, True, True)
    >>> cfg.zero_optimization.stage, cfg.zero_optimization.offload_param.device
    (3, 'cpu')
    """
    cfg = load_config(source)
    changes: dict[str, Any] = {}
    if stage is not None or source is None:
        changes["zero_optimization.stage"] = 2 if stage is None else stage
    if offload_optimizer:
        changes["zero_optimization.offload_optimizer.device"] = "cpu"
    if offload_parameters:
        changes["zero_optimization.offload_param.device"] = "cpu"
    return cfg.replace(**changes) if changes else cfg


def check_precision(precision: str, front: str) -> str:
    """``precision`` if the engine has a mapping for it, else an error naming the valid flags.

    >>> check_precision("bf16-mixed", "Trainer")
    'bf16-mixed'
    """
    if precision not in PRECISION_KEYS:
        supported = ", ".join(repr(p) for p in PRECISION_KEYS if "-" in p)
        raise ValueError(
            f"{front}(precision={precision!r}) is not supported by the ZeRO strategy, which owns "
            f"precision through its config; use one of {supported}"
        )
    return precision


def apply_precision(cfg: ZeroConfig, precision: str, said: str) -> ZeroConfig:
    """``cfg`` with the sections ``precision`` enables (``"auto"`` ones follow it); a flag enabling
    the *other* half-precision format is an error naming the flag (``said``)."""
    changes = dict(PRECISION_KEYS[precision])
    key = next(iter(changes)).split(".")[0] if changes else None
    for section in ("fp16", "bf16"):
        enabled = getattr(cfg, section).enabled
        if key is not None and section != key and enabled is True:
            raise ConfigError(
                f"{section}.enabled is true in the ZeRO config but {said} enables {key}; make "
                f"them agree: set {section}.enabled to false or choose a matching precision",
                key=f"{section}.enabled",
            )
        if enabled == AUTO:
            changes.setdefault(f"{section}.enabled", section == key)
    return cfg.replace(**changes) if changes else cfg


_MIXED_PRECISION = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}


def apply_mixed_precision(cfg: ZeroConfig, mixed_precision: str) -> ZeroConfig:
    """Accelerate's ``mixed_precision`` ("no"/"fp16"/"bf16") applied as :func:`apply_precision`.

    >>> apply_mixed_precision(load_config({"bf16": {"enabled": "auto"}}), "bf16").bf16.enabled
    True
    """
    mp = str(mixed_precision)
    if mp not in _MIXED_PRECISION:
        raise ValueError(
            f"mixed_precision={mp!r} is not supported by ds_strategy; use one of "
            f"{', '.join(repr(p) for p in _MIXED_PRECISION)}"
        )
    return apply_precision(cfg, _MIXED_PRECISION[mp], f"Accelerate's mixed_precision {mp!r}")


def _check_accumulation(cfg: ZeroConfig, accumulate: int, world_size: int, front: str) -> None:
    """The loop's accumulation must match the config's (given or implied by its batch sizes)."""
    given = cfg.gradient_accumulation_steps
    sizes = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu)
    flag = f"{front}(accumulate_grad_batches={accumulate})"
    if given not in (None, AUTO):
        if given != accumulate:
            raise ValueError(
                f"the ZeRO config sets gradient_accumulation_steps={given} but {flag}: they must "
                f"agree; set {front}(accumulate_grad_batches={given}) or remove "
                "gradient_accumulation_steps from the config"
            )
    elif all(s not in (None, AUTO) for s in sizes):
        implied = cfg.resolve(world_size).gradient_accumulation_steps
        if implied != accumulate:
            raise ValueError(
                f"the ZeRO config's batch sizes imply gradient_accumulation_steps={implied} "
                f"(train_batch_size={sizes[0]} = train_micro_batch_size_per_gpu={sizes[1]} x "
                f"{implied} x world size {world_size}) but {flag}; set "
                f"{front}(accumulate_grad_batches={implied}) or change the config's batch sizes"
            )


def clipping(
    cfg: ZeroConfig, clip_val: float | None, algorithm: str | None, front: str = "Trainer"
) -> float:
    """The loop's clipping norm, checked against the config's ``gradient_clipping``."""
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
    """``cfg`` with the loop's flags written in, once checked against it (``front`` names the
    loop object in errors); ``accumulate=None`` (evaluation only) leaves accumulation and clipping.

    >>> cfg = apply_loop_flags(ZeroConfig(), world_size=2, accumulate=2, clip_val=1.0)
    >>> cfg.gradient_accumulation_steps, cfg.gradient_clipping
    (2, 1.0)
    """
    if accumulate is not None:
        _check_accumulation(cfg, accumulate, world_size, front)
        clip = clipping(cfg, clip_val, clip_algorithm, front)
        cfg = cfg.replace(gradient_accumulation_steps=accumulate, gradient_clipping=clip)
    return apply_precision(
        cfg, check_precision(precision, front), f"{front}(precision={precision!r})"
    )
