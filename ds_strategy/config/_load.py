"""Loading and validating a :class:`ZeroConfig` from a dict, a JSON/YAML file or omegaconf.

One generic walker (:func:`_build`) turns a nested mapping into the dataclasses of
``_schema.py``: it reads DeepSpeed's deprecated spellings, maps aliases, sorts out unknown keys
(see the note below), warns about DeepSpeed keys listed in ``UNSUPPORTED_KEYS``, coerces every
leaf against its ``LeafSpec``, checks a section's own values and runs the load-time rules of
``rules.py``. ``to_dict``, ``replace`` and ``resolve`` (in ``_resolve.py``) go through plain
dicts and that same walker, so every way of making a config validates alike.

[Note: unknown keys]
DeepSpeed ignores a top-level key it does not read (several of its examples carry a stray
``cuda_visible_devices``), so a DeepSpeed config must load here too. But an ignored typo
(``stgae``) silently trains something else. So an unknown key close to a known one
(``difflib``, against the section's fields, aliases and DeepSpeed's own keys) is an error
that suggests it; any other unknown key warns (``UnknownConfigKeyWarning``) and is ignored.
Strict loading (``strict=True`` or ``DS_STRATEGY_STRICT_CONFIG=1``) makes every unknown key an
error. Keys set from Python (``replace``, ``auto_values``, ``zero_config``, environment
overrides) are always strict: there is no DeepSpeed file to stay compatible with.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ._leaves import (
    _COERCE,
    _KIND_NAMES,
    _NUMBER,
    MAX_INT,
    _check_bounds,
    _fail,
    _is_auto,
    _join,
    _number,
    _to_bool,
)
from ._schema import (
    AUTO,
    SCHEDULER_REQUIRED_PARAMS,
    TP_STYLES,
    UNSUPPORTED_KEYS,
    Choice,
    ConfigError,
    DeprecatedConfigWarning,
    LeafSpec,
    OptimizerConfig,
    QuantizationConfig,
    SchedulerConfig,
    TensorParallelConfig,
    UnknownConfigKeyWarning,
    UnsupportedConfigWarning,
    ZeroConfig,
    ZeroOptimizationConfig,
    register_operations,
)
from .presets import preset_names, resolve_preset
from .rules import Facts, check_rules

STRICT_ENV = "DS_STRATEGY_STRICT_CONFIG"
"""Set to ``1`` (or ``true``/``yes``/``on``) to make every unknown config key an error."""


@dataclass
class Found:
    """What one parse met besides errors: warnings to emit once it succeeded, and whether an
    unknown key far from every known one is an error (``strict``) or one of those warnings."""

    strict: bool = True
    warnings: list[tuple[type[Warning], str]] = dataclasses.field(default_factory=list)

    def warn(self, category: type[Warning], key: str, text: str) -> None:
        self.warnings.append((category, f"{key}: {text}"))


# ----------------------------------------------------------------------------- schema walking


@dataclass(frozen=True)
class _Field:
    """How the loader treats one dataclass field: a leaf, a nested section or a free mapping."""

    name: str
    kind: str  # "leaf" | "section" | "mapping" | "names" (a list of strings)
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
        elif typing.get_origin(hint) is list:
            out[f.name] = _Field(f.name, "names", f)
        else:  # a schema bug, not a user error
            raise TypeError(f"{cls.__name__}.{f.name}: declare leaves with leaf(), not {hint}")
    return out


@functools.cache
def _aliases(cls: type) -> dict[str, str]:
    return {a: f.name for f in dataclasses.fields(cls) for a in f.metadata.get("aliases", ())}


# section -> DeepSpeed's deprecated keys there that _upgrade_zero reads (with the new key)
_DEPRECATED_KEYS: dict[str, dict[str, str]] = {
    "zero_optimization": {
        "cpu_offload": "offload_optimizer",
        "cpu_offload_param": "offload_param",
    },
}


def _closest_key(cls: type, key: str, prefix: str) -> str | None:
    candidates = [
        *_schema(cls),
        *_aliases(cls),
        *UNSUPPORTED_KEYS.get(prefix, {}),
        *_DEPRECATED_KEYS.get(prefix, {}),
    ]
    close = difflib.get_close_matches(key, candidates, n=1)
    return close[0] if close else None


def _unknown_key(cls: type, key: str, prefix: str) -> NoReturn:
    close = _closest_key(cls, key, prefix)
    if close is not None:
        _fail(_join(prefix, key), f"unknown key, did you mean {close!r}?")
    _fail(_join(prefix, key), f"unknown key; valid keys here are: {', '.join(_schema(cls))}")


def _skip_unknown(cls: type, key: str, prefix: str, found: Found) -> None:
    """An unknown key met while loading: an error when it is close to a known key or loading
    is strict, else a warning and the key is ignored (see the note on unknown keys above)."""
    if found.strict or _closest_key(cls, key, prefix) is not None:
        _unknown_key(cls, key, prefix)
    found.warn(
        UnknownConfigKeyWarning,
        _join(prefix, key),
        f"unknown key, ignored as DeepSpeed ignores it (load with strict=True or "
        f"{STRICT_ENV}=1 to make it an error)",
    )


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


def _parse_leaf(f: _Field, value: Any, key: str) -> Any:
    assert f.spec is not None  # _schema guarantees it for leaves
    if _is_auto(value):
        return AUTO
    if value is None:
        if f.field.default is None:
            return None
        _fail(key, f"expected {_KIND_NAMES[_plain_kind(f.spec.kind)]}, got null")
    parsed = _COERCE[_plain_kind(f.spec.kind)](value, key)
    if f.spec.normalize is not None:
        parsed = f.spec.normalize(parsed)
    _check_bounds(f.spec, parsed, key)
    if issubclass(f.spec.kind, Choice):
        return f.spec.kind(parsed)
    return parsed


def _plain_kind(kind: type) -> type:
    """The scalar type a leaf is read as (a ``Choice`` enum is read as its string)."""
    return str if issubclass(kind, Choice) else kind


# ----------------------------------------------------------------------------- deprecated forms


def _upgrade_zero(raw: Any, prefix: str, found: Found) -> Any:
    """DeepSpeed's deprecated spellings of ``zero_optimization``, read with its meaning: the
    boolean form (true is stage 1) and ``cpu_offload`` / ``cpu_offload_param: true`` (offload
    to the CPU; false is no offload)."""
    if isinstance(raw, bool):
        found.warn(
            DeprecatedConfigWarning, prefix, f"deprecated boolean form, read as stage {int(raw)}"
        )
        return {"stage": int(raw)}
    if not isinstance(raw, Mapping):
        return raw
    out = dict(raw)
    for old, new in _DEPRECATED_KEYS[prefix].items():
        if old not in out:
            continue
        key = _join(prefix, old)
        on = _to_bool(out.pop(old), key)
        if new in out:
            _fail(key, f"given together with {new!r}, which replaces it; keep only {new!r}")
        if on:
            out[new] = {"device": "cpu"}
        meaning = f"{new}.device 'cpu'" if on else f"no {new}"
        found.warn(DeprecatedConfigWarning, key, f"deprecated DeepSpeed key, read as {meaning}")
    return _ignore_param_offload_below_stage3(out, prefix, found)


def _ignore_param_offload_below_stage3(raw: dict[str, Any], prefix: str, found: Found) -> Any:
    """DeepSpeed reads ``offload_param`` in stage 3 only and ignores it below: so do we, with a
    warning (strict loading keeps it, and the check below names the key to change)."""
    stage, section = raw.get("stage", 0), raw.get("offload_param")
    device = section.get("device", "none") if isinstance(section, Mapping) else None
    known = isinstance(stage, int) and not isinstance(stage, bool)
    if found.strict or not known or stage == 3 or device in (None, "none", AUTO):
        return raw
    found.warn(
        UnsupportedConfigWarning,
        _join(prefix, "offload_param"),
        f"device {device!r} is ignored at ZeRO stage {stage}, as DeepSpeed ignores it: only "
        "stage 3 partitions (and offloads) parameters; set stage 3 to offload them",
    )
    return {k: v for k, v in raw.items() if k != "offload_param"}


# Sections without an entry are read as written.
_UPGRADES: dict[type, Callable[[Any, str, Found], Any]] = {
    ZeroOptimizationConfig: _upgrade_zero,
}


# ----------------------------------------------------------------------------- one section's values


# [Note: numbers in range]
# DeepSpeed passes optimizer and scheduler parameters to torch as given, so a typo such as
# an infinite warm-up or an empty ``betas`` fails deep inside torch (or hangs) naming no key.
# These are checked at load instead, with DeepSpeed's meaning: rates, decays and epsilons
# finite and non-negative (a learning rate above 1e6 diverges on the first step), ``betas``
# a pair in [0, 1), step counts whole numbers; each failure a ConfigError naming the key.
MAX_LR = 1e6
_RATES = ("lr", "weight_decay", "eps", "momentum", "dampening", "max_grad_norm", "alpha")
_SCHEDULE_RATES = (
    "warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate",
    "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "min_lr", "cos_min_ratio",
    "warmup_min_ratio",
)  # fmt: skip
_SCHEDULE_STEPS = (
    "warmup_num_steps", "total_num_steps", "cycle_first_step_size", "cycle_second_step_size",
    "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size",
)  # fmt: skip


def _rate(value: Any, key: str, limit: float | None = None) -> None:
    if _is_auto(value):
        return
    value = _number(value, key, float)  # (YAML 1.1 reads 1e-4, no dot, as a string)
    if not math.isfinite(value) or value < 0:
        _fail(key, f"got {value!r}, must be a finite number >= 0")
    if limit is not None and value > limit:
        _fail(key, f"got {value!r}, must be <= {limit:g}")


def _steps(value: Any, key: str) -> None:
    if _is_auto(value):
        return
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value != int(value) or not 0 <= value <= MAX_INT:
        _fail(key, f"got {value!r}, must be a whole number of steps >= 0")


def _check_optimizer(cfg: OptimizerConfig, prefix: str) -> None:
    for name, value in cfg.params.items():
        key = f"{prefix}.params.{name}"
        if name in _RATES:
            _rate(value, key, MAX_LR if name == "lr" else None)
        elif name == "betas" and not _is_auto(value):
            pair = value if isinstance(value, (list, tuple)) else None
            if (
                pair is None
                or len(pair) != 2
                or not all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                    for b in pair
                )
            ):
                _fail(key, f"got {value!r}, must be a pair of numbers in [0, 1), e.g. [0.9, 0.999]")


def _check_scheduler(cfg: SchedulerConfig, prefix: str) -> None:
    for name, value in cfg.params.items():
        key = f"{prefix}.params.{name}"
        if name in _SCHEDULE_RATES:
            _rate(value, key, MAX_LR)
        elif name in _SCHEDULE_STEPS:
            _steps(value, key)
    for name in SCHEDULER_REQUIRED_PARAMS.get(cfg.type, ()):
        if name not in cfg.params:
            _fail(
                f"{prefix}.params.{name}",
                f'required by {cfg.type}, which has no default for it; set it, or "auto" '
                "for the front end to fill in",
            )


def _check_top(cfg: ZeroConfig, prefix: str) -> None:
    check_rules(cfg, Facts(), "load")  # every rule across keys and sections: rules.py


def _check_tensor_parallel(cfg: TensorParallelConfig, prefix: str) -> None:
    for pattern, style in cfg.plan.items():
        key = f"{prefix}.plan.{pattern}"
        try:
            re.compile(pattern)
        except re.error as e:
            _fail(key, f"not a regular expression over module names ({e})")
        if style not in TP_STYLES:
            choices = ", ".join(repr(s) for s in TP_STYLES)
            _fail(key, f"{style!r} is not a tensor-parallel style; use one of {choices}")


def _check_quantization(cfg: QuantizationConfig, prefix: str) -> None:
    for i, pattern in enumerate(cfg.modules_to_not_convert):
        try:
            re.compile(pattern)
        except re.error as e:
            _fail(
                f"{prefix}.modules_to_not_convert[{i}]",
                f"{pattern!r} is not a regular expression over module names ({e})",
            )


# Checks of one section's own values that a leaf's spec cannot say (free mappings, regular
# expressions); a rule across keys or sections is a Rule in rules.py, run by _check_top.
_CHECKS: dict[type, Callable[[Any, str], None]] = {
    SchedulerConfig: _check_scheduler,
    OptimizerConfig: _check_optimizer,
    TensorParallelConfig: _check_tensor_parallel,
    QuantizationConfig: _check_quantization,
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
    if f.kind == "names":
        if (
            not isinstance(value, Sequence)
            or isinstance(value, str)
            or not all(isinstance(v, str) for v in value)
        ):
            _fail(key, f'expected a list of strings such as ["lm_head"], got {value!r}')
        return list(value)
    if value is None and f.optional:
        return None
    assert f.section is not None
    child_base = getattr(base, f.name) if base is not None else f.default()
    return _build(f.section, value, key, child_base, found)


def _build(cls: type, raw: Any, prefix: str, base: Any, found: Found) -> Any:
    """Parse ``raw`` into ``cls``; keys not given keep their value in ``base`` (the defaults)."""
    upgrade = _UPGRADES.get(cls)
    if upgrade is not None:
        raw = upgrade(raw, prefix, found)
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
            found.warn(
                UnsupportedConfigWarning,
                dotted,
                f"DeepSpeed key not implemented by ds_strategy, ignored ({unsupported[key]})",
            )
        else:
            _skip_unknown(cls, key, prefix, found)
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
    for category, message in found.warnings:
        warnings.warn(f"{where}{message}", category, stacklevel=stacklevel + 1)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def strict_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``DS_STRATEGY_STRICT_CONFIG`` asks for strict loading (unset: no).

    >>> strict_from_env({"DS_STRATEGY_STRICT_CONFIG": "1"}), strict_from_env({})
    (True, False)
    """
    env = os.environ if environ is None else environ
    text = env.get(STRICT_ENV, "").strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ConfigError(
        f"{STRICT_ENV}={env[STRICT_ENV]!r}: expected 1 (strict) or 0 (not strict)", key=STRICT_ENV
    )


# ----------------------------------------------------------------------------- sources


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # json.loads would silently keep the last one
            raise ConfigError(f"duplicate key {key!r}", key=key)
        out[key] = value
    return out


def _is_preset(name: str) -> bool:
    return name in preset_names()


def _read_file(path: Path) -> Any:
    if path.is_dir():
        raise ConfigError(f"{path}: a directory, not a config file", path=str(path))
    if not path.is_file():
        hint = f" (the preset of that name: pass {path.stem!r})" if _is_preset(path.stem) else ""
        raise ConfigError(f"{path}: config file not found{hint}", path=str(path))
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {err.start}); a JSON config is UTF-8", path=str(path)
            ) from None
        try:
            return json.loads(text, object_pairs_hook=_no_duplicates)
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
        if isinstance(source, str) and not path.exists():
            data = resolve_preset(source)  # a preset's name (config/presets.py)
            if data is not None:
                return f"preset {source!r}", data
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


def _load(source: Any, stacklevel: int, strict: bool | None = None) -> ZeroConfig:
    if isinstance(source, ZeroConfig):
        return source
    found = Found(strict=strict_from_env() if strict is None else strict)
    origin, data = _read_source(source)
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


def load_config(source: Any = None, *, strict: bool | None = None) -> ZeroConfig:
    """Load and validate a config from any supported source.

    DeepSpeed keys that are not implemented warn with :class:`UnsupportedConfigWarning` and
    are ignored. An unknown key close to a known one is a :class:`ConfigError` suggesting it.
    Any other unknown key warns (:class:`UnknownConfigKeyWarning`) and is ignored, as DeepSpeed
    ignores it.

    Args:
        source: ``None`` (all defaults), a dict keyed like DeepSpeed's JSON, or a ``str`` /
            ``os.PathLike`` path to a ``.json`` / ``.yaml`` / ``.yml`` file. Also a preset's
            name (``"zero3_offload"``, see ``config/presets.py``); an existing file of that
            name wins. Also an omegaconf ``DictConfig``, or a :class:`ZeroConfig` (returned as
            is).
        strict: ``True`` makes every unknown key an error. ``None`` (the default) reads the
            environment variable ``DS_STRATEGY_STRICT_CONFIG`` (``1``: strict).

    Returns:
        The validated config.

    Raises:
        ConfigError: a bad value or key. The message names the dotted key (and the file).

    >>> cfg = load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
    ...                    "bf16": {"enabled": True}})
    >>> cfg.zero_optimization.reduce_bucket_size, cfg.bf16.enabled
    (500000000, True)
    >>> load_config("zero3_offload").zero_optimization.offload_param.device
    'cpu'
    >>> load_config({"zero_optimization": {"stgae": 2}})
    Traceback (most recent call last):
    ...
    ds_strategy.config.ConfigError: zero_optimization.stgae: unknown key, did you mean 'stage'?
    >>> load_config({"cuda_visible_devices": "0,1"}, strict=True)
    Traceback (most recent call last):
    ...
    ds_strategy.config.ConfigError: cuda_visible_devices: unknown key; valid keys here are: ...
    """
    return _load(source, stacklevel=3, strict=strict)


def config_schema() -> DictConfig:
    """``OmegaConf.structured(ZeroConfig)``, made writable so Hydra can merge overrides into it.

    Frozen dataclasses give read-only omegaconf nodes, on which every merge fails; this clears
    that flag on each node. Unknown keys are still rejected by omegaconf, and leaves accept
    ``"auto"`` (see the note in ``_schema.py``). Pass the merged node to :func:`load_config`.

    >>> node = OmegaConf.merge(config_schema(), {"zero_optimization": {"stage": 3}})
    >>> load_config(node).zero_optimization.stage
    3
    """
    node = OmegaConf.structured(_mirror(ZeroConfig))
    _make_writable(node)
    return node


@functools.cache
def _mirror(cls: type) -> type:
    """``cls`` with every leaf annotated ``Any`` (and a choice's default as its plain string),
    sections mirrored likewise: the schema omegaconf gets, where a leaf may hold ``"auto"``
    (see the note in ``_schema.py``)."""
    specs: list[tuple[str, Any, dataclasses.Field[Any]]] = []
    for name, f in _schema(cls).items():
        if f.kind == "leaf":
            default = f.field.default
            plain = default.value if isinstance(default, Choice) else default
            specs.append((name, Any, dataclasses.field(default=plain)))
        elif f.kind == "section":
            assert f.section is not None
            sub = _mirror(f.section)
            if f.optional:
                # typeshed types field() as its default's type (for a class body), not a Field
                none = dataclasses.field(default=None)
                specs.append((name, sub | None, none))  # type: ignore[arg-type]
            else:
                make = functools.partial(_mirror_value, f.default)
                specs.append((name, sub, dataclasses.field(default_factory=make)))
        else:
            hint = typing.get_type_hints(cls)[name]
            specs.append((name, hint, dataclasses.field(default_factory=f.field.default_factory)))
    mirror: type = dataclasses.make_dataclass(cls.__name__, specs, frozen=True)
    mirror.__module__ = __name__
    return mirror


def _mirror_value(make: Callable[[], Any]) -> Any:
    """The mirror of the section ``make()`` builds, holding the same values."""
    return _mirror_of(make())


def _mirror_of(obj: object) -> Any:
    cls: type = type(obj)
    out: dict[str, Any] = {}
    for name, f in _schema(cls).items():
        value = getattr(obj, name)
        if f.kind == "section" and value is not None:
            out[name] = _mirror_of(value)
        elif isinstance(value, Choice):
            out[name] = value.value
        else:
            out[name] = copy.deepcopy(value)
    return _mirror(cls)(**out)


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
        elif isinstance(value, Choice):
            out[name] = value.value  # plain data: JSON, YAML and omegaconf take it as is
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
            new = _DEPRECATED_KEYS.get(prefix, {}).get(part)
            if new is not None:
                _fail(_join(prefix, part), f"deprecated by DeepSpeed; set {_join(prefix, new)}")
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
    found = Found(strict=True)  # keys from code: a typo there is never a DeepSpeed file's key
    new = _build_top(data, found)
    _emit(found, None, stacklevel=3)
    return new


register_operations(load=_load, to_dict=config_to_dict, replace=replace_config)
