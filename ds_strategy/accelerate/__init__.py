"""Accelerate front end: :class:`ZeroAccelerator` in place of ``accelerate.Accelerator``, launched
with a standard accelerate config; the ZeRO settings come from a :class:`ZeroPlugin` or from
``DS_STRATEGY_CONFIG`` and ``DS_STRATEGY_<KEY>`` variables.

>>> from ds_strategy.accelerate import ZeroPlugin
>>> ZeroPlugin(overrides={"zero_optimization.stage": 3}).load({}).zero_optimization.stage
3
"""

from .accelerator import ZeroAccelerator
from .plugin import ZeroPlugin

__all__ = ["ZeroAccelerator", "ZeroPlugin"]
