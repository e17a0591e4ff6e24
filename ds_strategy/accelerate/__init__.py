"""Accelerate front end: ``ZeroAccelerator`` in place of ``accelerate.Accelerator``.

Swap the class in a plain Accelerate loop and launch it with a standard accelerate config; the
ZeRO settings come from a :class:`ZeroPlugin` or from the environment::

    DS_STRATEGY_CONFIG=configs/zero3.yaml \\
        accelerate launch --config_file configs/accelerate/cpu_2proc.yaml train.py

Environment (read when no ``ZeroPlugin(config=...)`` is given in code):

==================================  ===========================================================
``DS_STRATEGY_CONFIG``              YAML or JSON config file, DeepSpeed key names
``DS_STRATEGY_ZERO_STAGE``          ``zero_optimization.stage``
``DS_STRATEGY_OFFLOAD_OPTIMIZER``   ``zero_optimization.offload_optimizer.device``
``DS_STRATEGY_OFFLOAD_PARAM``       ``zero_optimization.offload_param.device``
``DS_STRATEGY_<KEY>``               any key: upper case, ``__`` between sections, e.g.
                                    ``DS_STRATEGY_ZERO_OPTIMIZATION__REDUCE_BUCKET_SIZE=5e7``,
                                    ``DS_STRATEGY_GRADIENT_CLIPPING=1.0``
==================================  ===========================================================

Values are YAML scalars; an unknown key is an error naming the variable.

>>> from ds_strategy.accelerate import ZeroPlugin
>>> ZeroPlugin(overrides={"zero_optimization.stage": 3}).load({}).zero_optimization.stage
3
"""

from .accelerator import ZeroAccelerator
from .plugin import ZeroPlugin

__all__ = ["ZeroAccelerator", "ZeroPlugin"]
