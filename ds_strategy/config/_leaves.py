"""Reading one leaf value: coercion to the ``LeafSpec``'s kind and its bounds, and the small
helpers every part of the loader uses to name a key in an error.

Kept apart from the walker in ``_load.py`` because it knows nothing about sections: a value,
the spec it must meet and the dotted key to blame.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ._schema import AUTO, ConfigError, LeafSpec


def _fail(key: str, message: str) -> NoReturn:
    raise ConfigError(f"{key}: {message}", key=key)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a bool (true/false)", str: "a string"}


def _number(value: Any, key: str, kind: type) -> int | float:
    # bool is an int subclass in Python; true/false for a size is a mistake, never a number.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    # YAML 1.1 leaves "5e8" / "1e9" (no dot) as strings; DeepSpeed configs are full of them.
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        text = value.strip()
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    _fail(key, f"expected {_KIND_NAMES[kind]}, got {value!r}")


MAX_INT = 2**53  # beyond it a count or a size is no number a machine could hold


def _to_int(value: Any, key: str) -> int:
    number = _number(value, key, int)
    if isinstance(number, float):
        if not (math.isfinite(number) and number.is_integer()):
            _fail(key, f"expected an integer, got {value!r}")
        number = int(number)
    if abs(number) > MAX_INT:
        _fail(key, f"got {value!r}, out of range (at most 2**53 in magnitude)")
    return number


def _to_float(value: Any, key: str) -> float:
    number = float(_number(value, key, float))
    if not math.isfinite(number):
        _fail(key, f"expected a finite number, got {value!r}")
    return number


def _to_bool(value: Any, key: str) -> bool:
    # Strict on purpose: "false" or 0 silently becoming True/False hides typos in recipes.
    if isinstance(value, bool):
        return value
    _fail(key, f"expected a bool (true/false), got {value!r}")


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Path):  # e.g. nvme_path built in Python; stored as str for JSON/YAML
        return str(value)
    _fail(key, f"expected a string, got {value!r}")


_COERCE: dict[type, Callable[[Any, str], Any]] = {
    int: _to_int,
    float: _to_float,
    bool: _to_bool,
    str: _to_str,
}


def _check_bounds(spec: LeafSpec, value: Any, key: str) -> None:
    if spec.choices is not None and value not in spec.choices:
        allowed = ", ".join(repr(c) for c in spec.choices)
        _fail(key, f"got {value!r}, allowed {allowed}")
    if spec.ge is not None and not value >= spec.ge:
        _fail(key, f"got {value!r}, must be >= {spec.ge}")
    if spec.gt is not None and not value > spec.gt:
        _fail(key, f"got {value!r}, must be > {spec.gt}")
    if spec.le is not None and not value <= spec.le:
        _fail(key, f"got {value!r}, must be <= {spec.le}")
