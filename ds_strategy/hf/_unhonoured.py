"""A ``DS_STRATEGY_*`` variable that asks for the ZeRO engine, set for a Trainer that would not
read it, is an error: without it a plain ``transformers.Trainer`` (TRL's trainers among them)
silently trains with DDP, the whole model on every rank.

The check runs when such a Trainer builds its Accelerator (the hook in ``_private.py``), so
only in a process that imported ``ds_strategy.hf``: a script that never imports it runs
nothing of ours. An ``accelerate launch`` config file cannot import it either (Accelerate's
launcher reads the file and starts the script; it runs no third-party code). The import is
the route: ``ds_strategy.hf.zero(TrainerClass)`` or ``ZeroTrainer``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..config._env import ENV_CONFIG, ENV_PREFIX, ENV_SHORTCUTS
from .trainer import ZeroTrainer

__all__ = ["check_trainer", "zero_variables"]

_ZERO_SECTION = ENV_PREFIX + "ZERO_OPTIMIZATION__"


def zero_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables set in ``environ`` that select the ZeRO engine or its sharding: the
    config file, the stage and offload shortcuts, and ``zero_optimization`` keys.

    >>> zero_variables({"DS_STRATEGY_ZERO_STAGE": "3", "DS_STRATEGY_PROGRESS": "0"})
    ['DS_STRATEGY_ZERO_STAGE']
    """
    env = os.environ if environ is None else environ
    chosen = {ENV_CONFIG, *ENV_SHORTCUTS}
    return sorted(n for n in env if env[n] and (n in chosen or n.startswith(_ZERO_SECTION)))


def check_trainer(trainer: Any) -> None:
    """Raise if ``trainer`` is not a ``ZeroTrainer`` and a variable asks for ZeRO."""
    if isinstance(trainer, ZeroTrainer):
        return
    names = zero_variables()
    if not names:
        return
    cls = type(trainer).__name__
    raise ValueError(
        f"{', '.join(names)} set, but {cls} is a plain transformers Trainer: it would ignore "
        "them and train with DDP (the whole model on every rank). Build it through ds_strategy: "
        f"`from ds_strategy.hf import zero; zero({cls})(...)` (or ds_strategy.hf.ZeroTrainer), "
        "which reads them; or unset them to train without ZeRO"
    )
