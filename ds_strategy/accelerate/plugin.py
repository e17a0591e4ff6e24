"""``ZeroPlugin``: where a :class:`~ds_strategy.accelerate.ZeroAccelerator` gets its ZeRO config.

[Note: precedence]
``ZeroPlugin(config=...)`` is the whole story: the environment is not read (a warning names the
``DS_STRATEGY_*`` variables ignored). Otherwise the file named by ``DS_STRATEGY_CONFIG`` is
read, each other ``DS_STRATEGY_*`` variable overrides one key (``ds_strategy.config._env``),
then the plugin's ``overrides`` win (``config.loop.code_or_env_config``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ZeroConfig
from ..config.loop import code_or_env_config

__all__ = ["ZeroPlugin"]


@dataclass
class ZeroPlugin:
    """The ZeRO configuration of a :class:`~ds_strategy.accelerate.ZeroAccelerator`.

    Args:
        config: a dict, a ``.json``/``.yaml`` path, a :class:`~ds_strategy.ZeroConfig` or an
            omegaconf node, keyed like DeepSpeed's JSON (``"auto"`` allowed). ``None``: from the
            environment (see the note), or all defaults (stage 0) when unset.
        gradient_clipping: the value an ``"auto"`` ``gradient_clipping`` takes (as in
            ``DeepSpeedPlugin``). ``None``: 0, the engine clips only when the loop calls
            ``accelerator.clip_grad_norm_``, as with a plain ``Accelerator``.
        overrides: dotted keys applied last, e.g. ``{"zero_optimization.stage": 3}``.
        loss_fn: ``fn(output, target) -> loss`` of one micro-batch; required with a
            ``pipeline`` section, whose last stage computes the loss in ``train_batch``.

    >>> ZeroPlugin(config={"zero_optimization": {"stage": 2}}).load().zero_optimization.stage
    2
    """

    config: Any = None
    gradient_clipping: float | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any, Any], Any] | None = None

    def load(self, environ: Mapping[str, str] | None = None) -> ZeroConfig:
        """The validated config, ``"auto"`` values kept (see the note on precedence).

        Args:
            environ: the environment variables to read. Default: ``os.environ``.

        Returns:
            The loaded config.

        Raises:
            ConfigError: a bad key, file or variable; the message names it.
        """
        env = os.environ if environ is None else environ
        return code_or_env_config(self.config, env, self.overrides, "ZeroPlugin")
