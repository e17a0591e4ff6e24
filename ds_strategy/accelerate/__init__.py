"""Accelerate front end: :class:`ZeroAccelerator` in place of ``accelerate.Accelerator``, launched
with a standard accelerate config; the ZeRO settings come from a :class:`ZeroPlugin` or from
``DS_STRATEGY_CONFIG`` and ``DS_STRATEGY_<KEY>`` variables.

>>> from ds_strategy.accelerate import ZeroPlugin
>>> ZeroPlugin(overrides={"zero_optimization.stage": 3}).load({}).zero_optimization.stage
3
"""

from .._extras import require_extra

require_extra("ds_strategy.accelerate", "accelerate", "accelerate")

from .accelerator import ZeroAccelerator  # noqa: E402
from .plugin import ZeroPlugin  # noqa: E402

__all__ = ["ZeroAccelerator", "ZeroPlugin"]
