"""A config from the environment: the file named by ``DS_STRATEGY_CONFIG`` and one override
per ``DS_STRATEGY_<KEY>`` variable. Launchers (``accelerate launch``, ``torchrun``, SLURM) pass
the environment to every process unchanged, so this is how a launch command sets ZeRO keys.

==================================  ===========================================================
``DS_STRATEGY_CONFIG``              YAML or JSON config file, DeepSpeed key names
``DS_STRATEGY_STRICT_CONFIG``       ``1``: every unknown key in a config file is an error
``DS_STRATEGY_ZERO_STAGE``          ``zero_optimization.stage``
``DS_STRATEGY_OFFLOAD_OPTIMIZER``   ``zero_optimization.offload_optimizer.device``
``DS_STRATEGY_OFFLOAD_PARAM``       ``zero_optimization.offload_param.device``
``DS_STRATEGY_<KEY>``               any key: upper case, ``__`` between sections, e.g.
                                    ``DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE=5e7``
==================================  ===========================================================

Values are YAML scalars; an unknown key is an error naming the variable.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from ._load import STRICT_ENV, load_config, strict_from_env
from ._schema import ConfigError, ZeroConfig

__all__ = [
    "ENV_CONFIG",
    "ENV_PREFIX",
    "ENV_SHORTCUTS",
    "apply_overrides",
    "config_from_env",
    "overrides_from_env",
]

ENV_PREFIX = "DS_STRATEGY_"
ENV_CONFIG = "DS_STRATEGY_CONFIG"
"""Path of a YAML (``.yaml``/``.yml``) or JSON config file, keyed like DeepSpeed's JSON."""

ENV_SHORTCUTS: dict[str, str] = {
    "DS_STRATEGY_ZERO_STAGE": "zero_optimization.stage",
    "DS_STRATEGY_OFFLOAD_OPTIMIZER": "zero_optimization.offload_optimizer.device",
    "DS_STRATEGY_OFFLOAD_PARAM": "zero_optimization.offload_param.device",
}
"""Short names for the keys most often changed from the command line."""

NOT_CONFIG = frozenset(
    {"DS_STRATEGY_PROGRESS", "DS_STRATEGY_PROGRESS_EVERY", "DS_STRATEGY_NVME_PATH"}
)
"""The package's variables that are not config keys: progress reporting (``core/progress.py``)
and ``ds-strategy env``'s drive check."""


def _env_key(name: str) -> str:
    """``DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE`` -> ``zero_optimization.reduce_bucket_size``."""
    if name in ENV_SHORTCUTS:
        return ENV_SHORTCUTS[name]
    return name[len(ENV_PREFIX) :].lower().replace("__", ".")


def _env_value(name: str, text: str) -> Any:
    # YAML scalars as omegaconf reads them: "3" is an int, "true" a bool, "5e7" and "1e-3"
    # floats (plain YAML 1.1 would keep those strings), "cpu" and "auto" strings; "${...}"
    # stays as written (not resolved)
    if not text.strip():
        return text
    try:
        data = OmegaConf.to_container(OmegaConf.create(f"v: {text}"))
        if not isinstance(data, dict):
            raise TypeError(f"read as a {type(data).__name__}")
        return data["v"]
    except Exception as err:  # noqa: BLE001 - the YAML parser's errors, named for the user
        raise ConfigError(f"{name}={text!r}: not a YAML scalar ({err})", key=name) from None


def overrides_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Dotted config overrides from ``DS_STRATEGY_*`` variables (``DS_STRATEGY_CONFIG``,
    ``DS_STRATEGY_STRICT_CONFIG`` and :data:`NOT_CONFIG` aside).

    ``DS_STRATEGY_<KEY>`` sets the config key ``<key>`` (lower-cased; ``__`` separates
    sections), and ``DS_STRATEGY_ZERO_STAGE``, ``DS_STRATEGY_OFFLOAD_OPTIMIZER``,
    ``DS_STRATEGY_OFFLOAD_PARAM`` are short names (see :data:`ENV_SHORTCUTS`).

    >>> overrides_from_env({"DS_STRATEGY_ZERO_STAGE": "3",
    ...                     "DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE": "5e7"})
    {'zero_optimization.reduce_bucket_size': 50000000.0, 'zero_optimization.stage': 3}
    >>> overrides_from_env({"DS_STRATEGY_PROGRESS": "0"})  # not a config key
    {}
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in (ENV_CONFIG, STRICT_ENV, *NOT_CONFIG):
            continue
        key = _env_key(name)
        if not key:
            raise ConfigError(f"{name}: names no config key", key=name)
        if key in out:  # a shortcut and the full name: which one wins would be arbitrary
            raise ConfigError(f"{named[key]} and {name} both set {key}; keep one", key=key)
        named[key] = name
        out[key] = _env_value(name, env[name])
    return out


def apply_overrides(
    cfg: ZeroConfig, overrides: Mapping[str, Any], from_env: bool, where: str = "overrides"
) -> ZeroConfig:
    """``cfg`` with dotted-key ``overrides``; an error names the variable (``from_env``) or
    ``where[key]``."""
    for key, value in overrides.items():
        try:
            cfg = cfg.replace(**{key: value})
        except ConfigError as err:
            if not from_env:
                raise ConfigError(f"{where}[{key!r}]: {err}", key=err.key) from None
            name = _env_name(key)
            close = difflib.get_close_matches(name, [*ENV_SHORTCUTS, ENV_CONFIG, STRICT_ENV], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{name}: {err}{hint}", key=err.key) from None
    return cfg


def _env_name(key: str) -> str:
    for short, target in ENV_SHORTCUTS.items():
        if target == key:
            return short
    return ENV_PREFIX + key.upper().replace(".", "__")


def config_from_env(environ: Mapping[str, str] | None = None) -> ZeroConfig:
    """The file named by ``DS_STRATEGY_CONFIG`` (all defaults when unset; loaded strictly
    when ``DS_STRATEGY_STRICT_CONFIG=1``) with every other ``DS_STRATEGY_*`` variable applied
    (see :func:`overrides_from_env`)."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_CONFIG)
    cfg = load_config(path, strict=strict_from_env(env)) if path else ZeroConfig()
    return apply_overrides(cfg, overrides_from_env(env), from_env=True)
