"""Loading and validating a :class:`ZeroConfig` from a dict, a JSON/YAML file or omegaconf.

One generic walker (:func:`_build`) turns a nested mapping into the dataclasses of
``_schema.py``: it maps aliases, rejects unknown keys (naming the closest valid one), warns about
DeepSpeed keys listed in ``UNSUPPORTED_KEYS``, coerces every leaf against its ``LeafSpec`` and
runs the section's cross-field check. ``to_dict``, ``replace`` and ``resolve`` (in ``_resolve.py``)
go through plain dicts and that same walker, so every way of making a config validates alike.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ._schema import (
    AUTO,
    UNSUPPORTED_KEYS,
    ConfigError,
    LeafSpec,
    OffloadConfig,
    UnsupportedConfigWarning,
    ZeroConfig,
    ZeroOptimizationConfig,
    register_operations,
)

Found = list[tuple[str, str]]  # (dotted key, reason) of unsupported keys met while parsing


def _fail(key: str, message: str) -> NoReturn:
    raise ConfigError(f"{key}: {message}", key=key)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


# ----------------------------------------------------------------------------- schema walking


@dataclass(frozen=True)
class _Field:
    """How the loader treats one dataclass field: a leaf, a nested section or a free mapping."""

    name: str
    kind: str  # "leaf" | "section" | "mapping"
    field: dataclasses.Field[Any]
    spec: LeafSpec | None = None
    section: type | None = None
    optional: bool = False

    def default(self) -> Any:
        """A fresh default value (MISSING for a required key)."""
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        return self.field.default


@functools.cache
def _schema(cls: type) -> dict[str, _Field]:
    hints = typing.get_type_hints(cls)
    out: dict[str, _Field] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if "leaf" in f.metadata:
            out[f.name] = _Field(f.name, "leaf", f, spec=f.metadata["leaf"])
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out[f.name] = _Field(f.name, "section", f, section=hint)
        elif len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
            out[f.name] = _Field(f.name, "section", f, section=args[0], optional=True)
        elif typing.get_origin(hint) is dict:
            out[f.name] = _Field(f.name, "mapping", f)
        else:  # a schema bug, not a user error
            raise TypeError(f"{cls.__name__}.{f.name}: declare leaves with leaf(), not {hint}")
    return out


@functools.cache
def _aliases(cls: type) -> dict[str, str]:
    return {a: f.name for f in dataclasses.fields(cls) for a in f.metadata.get("aliases", ())}


def _unknown_key(cls: type, key: str, prefix: str) -> NoReturn:
    valid = list(_schema(cls))
    candidates = valid + list(_aliases(cls)) + list(UNSUPPORTED_KEYS.get(prefix, {}))
    close = difflib.get_close_matches(key, candidates, n=1)
    if close:
        _fail(_join(prefix, key), f"unknown key, did you mean {close[0]!r}?")
    _fail(_join(prefix, key), f"unknown key; valid keys here are: {', '.join(valid)}")


def _canonical_items(cls: type, raw: Mapping[Any, Any], prefix: str) -> dict[str, Any]:
    """Map aliases (``bfloat16`` -> ``bf16``) to field names; both spellings at once is an error."""
    aliases = _aliases(cls)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            _fail(_join(prefix, str(key)), f"keys must be strings, got {key!r}")
        name = aliases.get(key, key)
        if name in out:
            _fail(
                _join(prefix, key),
                f"given together with {name!r}, which is the same setting; keep only {name!r}",
            )
        out[name] = value
    return out


# ----------------------------------------------------------------------------- leaf coercion

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


def _to_int(value: Any, key: str) -> int:
    number = _number(value, key, int)
    if isinstance(number, float):
        if not (math.isfinite(number) and number.is_integer()):
            _fail(key, f"expected an integer, got {value!r}")
        return int(number)
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


def _parse_leaf(f: _Field, value: Any, key: str) -> Any:
    assert f.spec is not None  # _schema guarantees it for leaves
    if _is_auto(value):
        return AUTO
    if value is None:
        if f.field.default is None:
            return None
        _fail(key, f"expected {_KIND_NAMES[f.spec.kind]}, got null")
    parsed = _COERCE[f.spec.kind](value, key)
    _check_bounds(f.spec, parsed, key)
    return parsed


# ----------------------------------------------------------------------------- cross-field rules


def _check_offload(cfg: OffloadConfig, prefix: str) -> None:
    if cfg.device == "nvme" and not cfg.nvme_path:
        _fail(
            f"{prefix}.nvme_path",
            "required when device is 'nvme'; set it to a directory on a local NVMe drive, "
            "or use device 'cpu'",
        )


def _check_zero(cfg: ZeroOptimizationConfig, prefix: str) -> None:
    stage_known = not _is_auto(cfg.stage)
    device = cfg.offload_param.device
    if device not in ("none", AUTO) and stage_known and cfg.stage != 3:
        _fail(
            f"{prefix}.offload_param",
            f"device {device!r} needs ZeRO stage 3 (only stage 3 partitions parameters), but "
            f"stage is {cfg.stage}; set {prefix}.stage to 3 or remove offload_param",
        )
    ratio = cfg.offload_optimizer.ratio
    if not _is_auto(ratio) and ratio < 1.0 and stage_known and cfg.stage != 3:
        _fail(
            f"{prefix}.offload_optimizer.ratio",
            f"partial optimizer offload (ratio {ratio}) needs ZeRO stage 3, but stage is "
            f"{cfg.stage}; set {prefix}.stage to 3 or ratio to 1.0",
        )


def _check_top(cfg: ZeroConfig, prefix: str) -> None:
    if cfg.fp16.enabled is True and cfg.bf16.enabled is True:
        _fail(
            "fp16.enabled",
            "fp16 and bf16 cannot both be enabled; set fp16.enabled or bf16.enabled to false",
        )


# Sections without an entry need no rule beyond their per-leaf specs.
_CHECKS: dict[type, Callable[[Any, str], None]] = {
    OffloadConfig: _check_offload,
    ZeroOptimizationConfig: _check_zero,
    ZeroConfig: _check_top,
}


# ----------------------------------------------------------------------------- the walker


def _parse_field(f: _Field, value: Any, key: str, base: Any, found: Found) -> Any:
    if f.kind == "leaf":
        return _parse_leaf(f, value, key)
    if f.kind == "mapping":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            _fail(key, f"expected a mapping with string keys, got {value!r}")
        return copy.deepcopy(dict(value))  # never alias the caller's dict
    if value is None and f.optional:
        return None
    assert f.section is not None
    child_base = getattr(base, f.name) if base is not None else f.default()
    return _build(f.section, value, key, child_base, found)


def _build(cls: type, raw: Any, prefix: str, base: Any, found: Found) -> Any:
    """Parse ``raw`` into ``cls``; keys not given keep their value in ``base`` (the defaults)."""
    if not isinstance(raw, Mapping):
        example = ' such as {"stage": 2}' if cls is ZeroOptimizationConfig else ""
        _fail(prefix or "config", f"expected a mapping{example}, got {raw!r}")
    fields = _schema(cls)
    unsupported = UNSUPPORTED_KEYS.get(prefix, {})
    values: dict[str, Any] = {}
    for key, value in _canonical_items(cls, raw, prefix).items():
        dotted = _join(prefix, key)
        if key in fields:
            values[key] = _parse_field(fields[key], value, dotted, base, found)
        elif key in unsupported:
            found.append((dotted, unsupported[key]))
        else:
            _unknown_key(cls, key, prefix)
    if base is not None:
        obj = dataclasses.replace(base, **values)
    else:
        for name, f in fields.items():
            if name not in values and f.default() is MISSING:
                _fail(_join(prefix, name), "required key missing")
        obj = cls(**values)
    check = _CHECKS.get(cls)
    if check is not None:
        check(obj, prefix)
    return obj


def _build_top(data: Mapping[str, Any], found: Found) -> ZeroConfig:
    cfg: ZeroConfig = _build(ZeroConfig, data, "", ZeroConfig(), found)
    return cfg


def _emit(found: Found, origin: str | None, stacklevel: int) -> None:
    where = f"{origin}: " if origin else ""
    for key, reason in found:
        warnings.warn(
            f"{where}{key}: DeepSpeed key not implemented by ds_strategy, ignored ({reason})",
            UnsupportedConfigWarning,
            stacklevel=stacklevel + 1,
        )


# ----------------------------------------------------------------------------- sources


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # json.loads would silently keep the last one
            raise ConfigError(f"duplicate key {key!r}", key=key)
        out[key] = value
    return out


def _read_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found", path=str(path))
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(path.read_text(), object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as err:
            msg = f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
            raise ConfigError(f"{path}: {msg}", path=str(path)) from None
    if suffix in (".yaml", ".yml"):
        try:
            return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except Exception as err:  # PyYAML's errors: omegaconf's parser, not imported here
            raise ConfigError(f"{path}: invalid YAML: {err}", path=str(path)) from None
    raise ConfigError(
        f"{path}: unsupported file extension {suffix!r}; use .json, .yaml or .yml", path=str(path)
    )


def _from_omegaconf(node: DictConfig) -> Any:
    try:
        return OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = str(getattr(err, "full_key", "") or "<omegaconf node>")
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}", key=key) from None


def _read_source(source: Any) -> tuple[str | None, Any]:
    """(origin for messages, plain nested data) for each kind of source load_config accepts."""
    if source is None:
        return None, {}
    if isinstance(source, DictConfig):  # before Mapping: DictConfig is one
        return None, _from_omegaconf(source)
    if isinstance(source, Mapping):
        return None, source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            return str(path), _read_file(path)
        except ConfigError as err:
            if err.path is None:  # a duplicate-key error from inside the JSON parser
                raise ConfigError(f"{path}: {err}", key=err.key, path=str(path)) from None
            raise
    raise TypeError(
        "config must be None, a dict, a path to a .json/.yaml file, an omegaconf DictConfig "
        f"or a ZeroConfig, got {type(source).__name__}"
    )


def _load(source: Any, stacklevel: int) -> ZeroConfig:
    if isinstance(source, ZeroConfig):
        return source
    origin, data = _read_source(source)
    found: Found = []
    try:
        if not isinstance(data, Mapping):
            raise ConfigError(f"the top level must be a mapping of config keys, got {data!r}")
        cfg = _build_top(data, found)
    except ConfigError as err:
        if origin is None:
            raise
        raise ConfigError(f"{origin}: {err}", key=err.key, path=origin) from None
    _emit(found, origin, stacklevel)
    return cfg


def load_config(source: Any = None) -> ZeroConfig:
    """Load and validate a config from any supported source.

    ``source`` is ``None`` (all defaults), a dict keyed like DeepSpeed's JSON, a ``str`` /
    ``os.PathLike`` path to a ``.json`` / ``.yaml`` / ``.yml`` file, an omegaconf ``DictConfig``
    or a :class:`ZeroConfig` (returned as is). Unknown keys and bad values raise
    :class:`ConfigError` naming the dotted key (and the file); DeepSpeed keys that are not
    implemented warn with :class:`UnsupportedConfigWarning` and are ignored.

    >>> cfg = load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
    ...                    "bf16": {"enabled": True}})
    >>> cfg.zero_optimization.reduce_bucket_size, cfg.bf16.enabled
    (500000000, True)
    >>> load_config({"zero_optimization": {"stgae": 2}})
    Traceback (most recent call last):
    ...
    ds_strategy.config.ConfigError: zero_optimization.stgae: unknown key, did you mean 'stage'?
    """
    return _load(source, stacklevel=3)


def config_schema() -> DictConfig:
    """``OmegaConf.structured(ZeroConfig)``, made writable so Hydra can merge overrides into it.

    Frozen dataclasses give read-only omegaconf nodes, on which every merge fails; this clears
    that flag on each node. Unknown keys are still rejected by omegaconf, and leaves accept
    ``"auto"`` (see the note in ``_schema.py``). Pass the merged node to :func:`load_config`.

    >>> node = OmegaConf.merge(config_schema(), {"zero_optimization": {"stage": 3}})
    >>> load_config(node).zero_optimization.stage
    3
    """
    node = OmegaConf.structured(ZeroConfig)
    _make_writable(node)
    return node


def _make_writable(node: DictConfig) -> None:
    OmegaConf.set_readonly(node, None)  # None: inherit, so the root's default (writable) wins
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _make_writable(child)


# ----------------------------------------------------------------------------- to_dict / replace


def config_to_dict(obj: Any) -> dict[str, Any]:
    """Nested plain dict of a config dataclass; unset optional sections are left out."""
    out: dict[str, Any] = {}
    cls: type = type(obj)
    for name, f in _schema(cls).items():
        value = getattr(obj, name)
        if f.kind == "section":
            if value is not None:
                out[name] = config_to_dict(value)
        else:
            out[name] = copy.deepcopy(value)
    return out


def _canonical_path(dotted: str) -> list[str]:
    """Field names along ``dotted`` (aliases mapped); unknown keys raise with a suggestion."""
    cls: type = ZeroConfig
    prefix = ""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        name = _aliases(cls).get(part, part)
        f = _schema(cls).get(name)
        if f is None:
            if part in UNSUPPORTED_KEYS.get(prefix, {}):
                return parts  # accepted here; loading it warns like any unsupported key
            _unknown_key(cls, part, prefix)
        rest = parts[i + 1 :]
        if f.kind == "mapping":
            return [*parts[:i], name, *rest]  # free-form below, e.g. optimizer.params.lr
        if f.kind == "leaf":
            if rest:
                _fail(dotted, f"{_join(prefix, name)} is a value, not a section")
            return [*parts[:i], name]
        assert f.section is not None
        parts[i] = name
        cls, prefix = f.section, _join(prefix, name)
    return parts


def _merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for name in path[:-1]:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = config_to_dict(value)
    if isinstance(value, Mapping) and isinstance(node.get(path[-1]), dict):
        _merge(node[path[-1]], value)
    else:
        node[path[-1]] = value


def replace_config(cfg: ZeroConfig, changes: Mapping[str, Any]) -> ZeroConfig:
    """Implementation of :meth:`ZeroConfig.replace`."""
    data = config_to_dict(cfg)
    for dotted, value in changes.items():
        _set_path(data, _canonical_path(dotted), value)
    found: Found = []
    new = _build_top(data, found)
    _emit(found, None, stacklevel=3)
    return new


register_operations(load=_load, to_dict=config_to_dict, replace=replace_config)
