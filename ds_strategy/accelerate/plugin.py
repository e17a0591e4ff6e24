"""``ZeroPlugin``: where a :class:`~ds_strategy.accelerate.ZeroAccelerator` gets its ZeRO config.

Accelerate's own config file rejects keys it does not know and has no registry for third-party
engines, so the ZeRO settings live in our own file, named by an environment variable that
``accelerate launch`` passes through to every process unchanged.

[Note: precedence]
``ZeroPlugin(config=...)`` given in code is the whole story: the environment is not read (a
warning names any ``DS_STRATEGY_*`` variable that is thereby ignored). With ``config=None``
(or no plugin at all) the file named by ``DS_STRATEGY_CONFIG`` is read, then every other
``DS_STRATEGY_*`` variable overrides one key, then the plugin's ``overrides`` (code) win.
The launcher owns the settings it was given; code that names a config file owns everything.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..config import ConfigError, ZeroConfig, load_config

__all__ = ["ENV_CONFIG", "ENV_PREFIX", "ENV_SHORTCUTS", "ZeroPlugin", "overrides_from_env"]

ENV_PREFIX = "DS_STRATEGY_"
ENV_CONFIG = "DS_STRATEGY_CONFIG"
"""Path of a YAML (``.yaml``/``.yml``) or JSON config file, keyed like DeepSpeed's JSON."""

ENV_SHORTCUTS: dict[str, str] = {
    "DS_STRATEGY_ZERO_STAGE": "zero_optimization.stage",
    "DS_STRATEGY_OFFLOAD_OPTIMIZER": "zero_optimization.offload_optimizer.device",
    "DS_STRATEGY_OFFLOAD_PARAM": "zero_optimization.offload_param.device",
}
"""Short names for the keys most often changed from the command line."""


def _env_key(name: str) -> str:
    """``DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE`` -> ``zero_optimization.reduce_bucket_size``."""
    if name in ENV_SHORTCUTS:
        return ENV_SHORTCUTS[name]
    return name[len(ENV_PREFIX) :].lower().replace("__", ".")


def _env_value(name: str, text: str) -> Any:
    # YAML scalars, so "3" is an int, "true" a bool, "cpu" and "auto" strings; numbers such as
    # "5e8" stay strings under YAML 1.1 and the config loader accepts them where a number goes.
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError as err:
        raise ConfigError(f"{name}={text!r}: not a YAML scalar ({err})", key=name) from None


def overrides_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Dotted config overrides from ``DS_STRATEGY_*`` variables (``DS_STRATEGY_CONFIG`` aside).

    ``DS_STRATEGY_<KEY>`` sets the config key ``<key>`` (lower-cased; ``__`` separates
    sections), and ``DS_STRATEGY_ZERO_STAGE``, ``DS_STRATEGY_OFFLOAD_OPTIMIZER``,
    ``DS_STRATEGY_OFFLOAD_PARAM`` are short names (see :data:`ENV_SHORTCUTS`).

    >>> overrides_from_env({"DS_STRATEGY_ZERO_STAGE": "3",
    ...                     "DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE": "5e7"})
    {'zero_optimization.reduce_bucket_size': '5e7', 'zero_optimization.stage': 3}
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG:
            continue
        key = _env_key(name)
        if not key:
            raise ConfigError(f"{name}: names no config key", key=name)
        if key in out:  # a shortcut and the full name: which one wins would be arbitrary
            raise ConfigError(f"{named[key]} and {name} both set {key}; keep one", key=key)
        named[key] = name
        out[key] = _env_value(name, env[name])
    return out


def _apply(cfg: ZeroConfig, overrides: Mapping[str, Any], from_env: bool) -> ZeroConfig:
    for key, value in overrides.items():
        try:
            cfg = cfg.replace(**{key: value})
        except ConfigError as err:
            if not from_env:
                raise ConfigError(f"ZeroPlugin.overrides[{key!r}]: {err}", key=err.key) from None
            name = _env_name(key)
            close = difflib.get_close_matches(name, [*ENV_SHORTCUTS, ENV_CONFIG], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{name}: {err}{hint}", key=err.key) from None
    return cfg


def _env_name(key: str) -> str:
    for short, target in ENV_SHORTCUTS.items():
        if target == key:
            return short
    return ENV_PREFIX + key.upper().replace(".", "__")


@dataclass
class ZeroPlugin:
    """The ZeRO configuration of a :class:`~ds_strategy.accelerate.ZeroAccelerator`.

    Args:
        config: a dict, a path to a ``.json``/``.yaml`` file, a :class:`~ds_strategy.ZeroConfig`
            or an omegaconf node, keyed like DeepSpeed's JSON (``"auto"`` values allowed).
            ``None``: the file named by ``DS_STRATEGY_CONFIG`` plus ``DS_STRATEGY_*``
            overrides (see :func:`overrides_from_env`), or all defaults (stage 0) when unset.
        gradient_clipping: the value an ``"auto"`` ``gradient_clipping`` takes (as
            Accelerate's ``DeepSpeedPlugin(gradient_clipping=...)``). Left ``None``, ``"auto"``
            means 0: the engine clips only when the loop calls
            ``accelerator.clip_grad_norm_``, as with a plain ``Accelerator``.
        overrides: dotted keys applied last, e.g. ``{"zero_optimization.stage": 3}``.
        loss_fn: ``fn(output, target) -> loss`` of one micro-batch; required with a
            ``pipeline`` section (``stages > 1``), where the last stage computes the loss
            inside ``model.train_batch(inputs, targets)``.

    Example::

        from ds_strategy.accelerate import ZeroAccelerator, ZeroPlugin

        plugin = ZeroPlugin(config="configs/zero3.yaml",
                            overrides={"zero_optimization.reduce_bucket_size": 5e7})
        accelerator = ZeroAccelerator(zero_plugin=plugin, gradient_accumulation_steps=2)

    >>> ZeroPlugin(config={"zero_optimization": {"stage": 2}}).load().zero_optimization.stage
    2
    """

    config: Any = None
    gradient_clipping: float | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any, Any], Any] | None = None

    def load(self, environ: Mapping[str, str] | None = None) -> ZeroConfig:
        """The validated, not yet resolved config (``"auto"`` values kept); see the module note
        on precedence. Raises :class:`~ds_strategy.config.ConfigError` naming the key, the file
        or the environment variable at fault."""
        env = os.environ if environ is None else environ
        if self.config is not None:
            ignored = [n for n in env if n.startswith(ENV_PREFIX)]
            if ignored:
                warnings.warn(
                    f"{', '.join(sorted(ignored))} ignored: ZeroPlugin(config=...) was given in "
                    "code; pass config=None to read the config from the environment",
                    UserWarning,
                    stacklevel=2,
                )
            cfg = load_config(self.config)
        else:
            path = env.get(ENV_CONFIG)
            cfg = load_config(path) if path else ZeroConfig()
            cfg = _apply(cfg, overrides_from_env(env), from_env=True)
        return _apply(cfg, dict(self.overrides), from_env=False)
