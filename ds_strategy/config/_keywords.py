"""A config from keyword arguments, for code that builds its config in Python rather than JSON.

The keywords are the handful a ZeRO setup usually changes (the names Lightning's
``DeepSpeedStrategy`` uses); every other key is passed by its dotted DeepSpeed name. The
result is exactly what :func:`load_config` gives for the equivalent JSON, validated alike.
"""

from __future__ import annotations

import os
from typing import Any

from ._load import replace_config
from ._schema import ConfigError, ZeroConfig

__all__ = ["zero_config"]

_PRECISIONS = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}


def _device(value: bool | str, name: str) -> str:
    if value is True:
        return "cpu"
    if value is False:
        return "none"
    if isinstance(value, str) and value in ("none", "cpu", "nvme"):
        return value
    raise ConfigError(
        f"{name}: got {value!r}, allowed True (cpu), False, 'cpu', 'nvme' or 'none'", key=name
    )


def zero_config(
    stage: int,
    *,
    offload_optimizer: bool | str = False,
    offload_parameters: bool | str = False,
    nvme_path: str | os.PathLike[str] | None = None,
    precision: str = "fp32",
    reduce_bucket_size: int | None = None,
    prefetch_bucket_size: int | None = None,
    contiguous_memory_optimization: bool = False,
    **more: Any,
) -> ZeroConfig:
    """The :class:`ZeroConfig` of a ZeRO ``stage`` (0-3), written as keywords.

    Args:
        stage: ``zero_optimization.stage``.
        offload_optimizer: ``zero_optimization.offload_optimizer.device``: ``True`` for
            ``"cpu"``, ``False`` for none, or ``"cpu"`` / ``"nvme"`` / ``"none"``.
        offload_parameters: the same for ``zero_optimization.offload_param`` (stage 3).
        nvme_path: ``nvme_path`` of each offload that is ``"nvme"`` (required by them).
        precision: ``"fp32"``, ``"bf16"`` (``bf16.enabled``) or ``"fp16"`` (``fp16.enabled``).
        reduce_bucket_size: ``zero_optimization.reduce_bucket_size`` (None: the default).
        prefetch_bucket_size: ``zero_optimization.stage3_prefetch_bucket_size``.
        contiguous_memory_optimization: ``activation_checkpointing.contiguous_memory_optimization``
            (DeepSpeed's key, accepted; it has no effect here and warns when used).
        **more: any other key by its dotted name, e.g. ``gradient_clipping=1.0`` or
            ``**{"zero_optimization.overlap_comm": False}``; a mapping sets a section's keys.

    Unknown keys are errors (never warnings: there is no DeepSpeed file to stay compatible
    with), as are bad values, each naming the key.

    >>> from ds_strategy.config import load_config
    >>> cfg = zero_config(3, offload_optimizer=True, precision="bf16",
    ...                   gradient_clipping=1.0, **{"zero_optimization.overlap_comm": False})
    >>> cfg == load_config({"zero_optimization": {"stage": 3, "overlap_comm": False,
    ...                                           "offload_optimizer": {"device": "cpu"}},
    ...                     "bf16": {"enabled": True}, "gradient_clipping": 1.0})
    True
    >>> zero_config(2, precision="fp8")
    Traceback (most recent call last):
    ...
    ds_strategy.config.ConfigError: precision: got 'fp8', allowed 'fp32', 'bf16', 'fp16'
    """
    if precision not in _PRECISIONS:
        allowed = ", ".join(repr(p) for p in _PRECISIONS)
        raise ConfigError(f"precision: got {precision!r}, allowed {allowed}", key="precision")
    changes: dict[str, Any] = {"zero_optimization.stage": stage}
    nvme_used = False
    for name, section, value in (
        ("offload_optimizer", "offload_optimizer", offload_optimizer),
        ("offload_parameters", "offload_param", offload_parameters),
    ):
        device = _device(value, name)
        if device != "none":
            changes[f"zero_optimization.{section}.device"] = device
        if device == "nvme" and nvme_path is not None:
            changes[f"zero_optimization.{section}.nvme_path"] = str(nvme_path)
            nvme_used = True
    if nvme_path is not None and not nvme_used:
        raise ConfigError(
            "nvme_path: given, but neither offload_optimizer nor offload_parameters is 'nvme'",
            key="nvme_path",
        )
    if _PRECISIONS[precision] is not None:
        changes[f"{_PRECISIONS[precision]}.enabled"] = True
    if reduce_bucket_size is not None:
        changes["zero_optimization.reduce_bucket_size"] = reduce_bucket_size
    if prefetch_bucket_size is not None:
        changes["zero_optimization.stage3_prefetch_bucket_size"] = prefetch_bucket_size
    if contiguous_memory_optimization:
        changes["activation_checkpointing.contiguous_memory_optimization"] = True
    clash = sorted(set(changes) & set(more))
    if clash:
        raise ConfigError(
            f"{clash[0]}: given twice, as a keyword and by its dotted name", key=clash[0]
        )
    return replace_config(ZeroConfig(), {**changes, **more})
