"""Configuration for ds_strategy: DeepSpeed-compatible keys, frozen dataclasses, checked loading.

A DeepSpeed JSON loads unchanged. A key that looks like a typo of a known one is an error that
names it and suggests the closest valid key; any other unknown key warns and is ignored, as
DeepSpeed ignores it (``load_config(..., strict=True)`` or ``DS_STRATEGY_STRICT_CONFIG=1``:
an error); DeepSpeed keys that are not implemented warn and are ignored. :func:`zero_config`
writes a config as keywords. A resolved config's leaves hold their annotated types (a fixed set
of strings as a :class:`Choice` enum); ``rules`` is the table of which features combine, and
``loop`` the policy merging a training loop's settings into a config. This package is a leaf: it imports only the standard library
and omegaconf.

>>> from ds_strategy.config import load_config
>>> cfg = load_config({"zero_optimization": {"stage": 2}, "train_batch_size": 64,
...                    "train_micro_batch_size_per_gpu": 8})
>>> cfg.resolve(world_size=4).gradient_accumulation_steps
2
"""

from . import _resolve  # noqa: F401  (registers ZeroConfig.resolve)
from ._keywords import zero_config
from ._load import STRICT_ENV, config_schema, load_config
from ._schema import (
    AUTO,
    SCHEDULER_REQUIRED_PARAMS,
    UNSUPPORTED_KEYS,
    BF16Config,
    Choice,
    CommDataType,
    CompressionMethod,
    ConfigError,
    DeprecatedConfigWarning,
    DsStrategyWarning,
    FP16Config,
    Layout,
    OffloadConfig,
    OffloadDevice,
    OptimizerConfig,
    PipelineSchedule,
    QuantizationConfig,
    QuantKernel,
    SchedulerConfig,
    TensorParallelConfig,
    UnknownConfigKeyWarning,
    UnsupportedConfigWarning,
    ZeroConfig,
    ZeroOptimizationConfig,
    type_pattern,
)

__all__ = [
    "AUTO",
    "SCHEDULER_REQUIRED_PARAMS",
    "STRICT_ENV",
    "UNSUPPORTED_KEYS",
    "BF16Config",
    "Choice",
    "CommDataType",
    "CompressionMethod",
    "ConfigError",
    "DeprecatedConfigWarning",
    "DsStrategyWarning",
    "FP16Config",
    "Layout",
    "OffloadConfig",
    "OffloadDevice",
    "OptimizerConfig",
    "PipelineSchedule",
    "QuantKernel",
    "QuantizationConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "UnknownConfigKeyWarning",
    "UnsupportedConfigWarning",
    "ZeroConfig",
    "ZeroOptimizationConfig",
    "config_schema",
    "load_config",
    "type_pattern",
    "zero_config",
]
