"""Configuration for ds_strategy: DeepSpeed-compatible keys, frozen dataclasses, strict loading.

A DeepSpeed JSON loads unchanged; unknown keys are errors that name the key and suggest the
closest valid one, and DeepSpeed keys that are not implemented warn and are ignored. This
package is a leaf: it imports only the standard library and omegaconf.

>>> from ds_strategy.config import load_config
>>> cfg = load_config({"zero_optimization": {"stage": 2}, "train_batch_size": 64,
...                    "train_micro_batch_size_per_gpu": 8})
>>> cfg.resolve(world_size=4).gradient_accumulation_steps
2
"""

from . import _resolve  # noqa: F401  (registers ZeroConfig.resolve)
from ._load import config_schema, load_config
from ._schema import (
    AUTO,
    UNSUPPORTED_KEYS,
    BF16Config,
    ConfigError,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    UnsupportedConfigWarning,
    ZeroConfig,
    ZeroOptimizationConfig,
    type_pattern,
)

__all__ = [
    "AUTO",
    "UNSUPPORTED_KEYS",
    "BF16Config",
    "ConfigError",
    "FP16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "UnsupportedConfigWarning",
    "ZeroConfig",
    "ZeroOptimizationConfig",
    "config_schema",
    "load_config",
    "type_pattern",
]
