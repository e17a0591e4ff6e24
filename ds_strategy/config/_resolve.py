"""Resolving a loaded config: filling in "auto" values and settling the batch sizes.

Kept apart from loading because it needs facts only known at launch (the data-parallel world
size, values a trainer derives from the model); the result is validated by the same walker.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import MISSING
from typing import Any

from ._leaves import _fail, _is_auto, _join
from ._load import Found, _build_top, _canonical_path, _Field, _schema, config_to_dict
from ._schema import (
    AUTO,
    SCHEDULER_REQUIRED_PARAMS,
    ConfigError,
    SchedulerConfig,
    ZeroConfig,
    register_operations,
)


def _auto_default(f: _Field, key: str, default_obj: Any, fills: Mapping[str, Any]) -> Any:
    if key in fills and not _is_auto(fills[key]):
        return fills[key]
    default = getattr(default_obj, f.name) if default_obj is not None else f.default()
    if default is MISSING:
        _fail(key, f"'auto' has no default here; pass auto_values={{{key!r}: ...}}")
    return default


def _required_params(cls: type, data: Mapping[str, Any]) -> tuple[str, ...]:
    if cls is not SchedulerConfig:
        return ()
    kind = data.get("type")
    return SCHEDULER_REQUIRED_PARAMS.get(kind, ()) if isinstance(kind, str) else ()


def _fill_autos(
    cls: type, data: dict[str, Any], prefix: str, default_obj: Any, fills: Mapping[str, Any]
) -> None:
    """Replace each "auto" in ``data`` (a ``config_to_dict`` of ``cls``) in place."""
    for name, f in _schema(cls).items():
        if name not in data:
            continue
        key, value = _join(prefix, name), data[name]
        if f.kind == "section" and isinstance(value, dict):
            assert f.section is not None
            child_default = getattr(default_obj, name) if default_obj is not None else None
            _fill_autos(f.section, value, key, child_default, fills)
        elif f.kind == "mapping":
            required = _required_params(cls, data)
            for entry in [k for k, v in value.items() if _is_auto(v)]:
                filled = fills.get(f"{key}.{entry}", AUTO)
                if not _is_auto(filled):
                    value[entry] = filled
                elif entry in required:
                    _fail(
                        f"{key}.{entry}",
                        f"'auto' has no value here and {data['type']} requires it; pass "
                        f"auto_values={{{f'{key}.{entry}'!r}: ...}} or set it in the config",
                    )
                else:
                    del value[entry]  # the optimizer's / scheduler's own default applies
        elif f.kind == "leaf" and _is_auto(value):
            data[name] = _auto_default(f, key, default_obj, fills)


def _exact_quotient(total_key: str, total: int, factors: list[tuple[str, int]], target: str) -> int:
    product = math.prod(v for _, v in factors)
    if total % product == 0:
        return total // product
    expr = " * ".join(f"{name} ({v})" for name, v in factors)
    if len(factors) > 1:
        expr += f" = {product}"
    raise ConfigError(
        f"{total_key} ({total}) is not divisible by {expr}, so {target} cannot be computed; "
        f"make {total_key} a multiple of {product}",
        key=total_key,
    )


_TB, _MB, _GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
_WS = "data-parallel world size"


def _batch_sizes(
    tb: int | None, mb: int | None, gas: int | None, ws: int
) -> tuple[int | None, int | None, int]:
    """DeepSpeed's rule ``tb = mb * gas * ws``: two given fix the third; see ZeroConfig.resolve."""
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * ws:
            raise ConfigError(
                f"{_TB} ({tb}) != {_MB} ({mb}) * {_GAS} ({gas}) * {_WS} ({ws}) = {mb * gas * ws}; "
                f"fix one of them or remove {_TB} to have it computed",
                key=_TB,
            )
        return tb, mb, gas
    if tb is not None and mb is not None:
        return tb, mb, _exact_quotient(_TB, tb, [(_MB, mb), (_WS, ws)], _GAS)
    if tb is not None and gas is not None:
        return tb, _exact_quotient(_TB, tb, [(_GAS, gas), (_WS, ws)], _MB), gas
    if mb is not None and gas is not None:
        return mb * gas * ws, mb, gas
    if tb is not None:
        return tb, _exact_quotient(_TB, tb, [(_WS, ws)], _MB), 1
    if mb is not None:
        return mb * ws, mb, 1
    return None, None, (1 if gas is None else gas)


def resolve_config(
    cfg: ZeroConfig, world_size: int, auto_values: Mapping[str, Any] | None
) -> ZeroConfig:
    """Implementation of :meth:`ZeroConfig.resolve`."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}", key="world_size")
    fills: dict[str, Any] = {}
    for dotted, value in (auto_values or {}).items():
        try:
            fills[".".join(_canonical_path(dotted))] = value
        except ConfigError as err:
            raise ConfigError(f"auto_values: {err}", key=err.key) from None
    data = config_to_dict(cfg)
    _fill_autos(ZeroConfig, data, "", ZeroConfig(), fills)
    filled = _build_top(data, Found())  # validates the filled-in values like any input
    tb, mb, gas = _batch_sizes(
        filled.train_batch_size,
        filled.train_micro_batch_size_per_gpu,
        filled.gradient_accumulation_steps,
        world_size,
    )
    return dataclasses.replace(
        filled,
        train_batch_size=tb,
        train_micro_batch_size_per_gpu=mb,
        gradient_accumulation_steps=gas,
    )


register_operations(resolve=resolve_config)
