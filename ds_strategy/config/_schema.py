"""The configuration schema: one frozen dataclass per concern, keyed like DeepSpeed's JSON.

Field names are DeepSpeed's config keys and defaults are DeepSpeed's defaults, so an existing
DeepSpeed JSON loads unchanged. The dataclasses hold data only; parsing, validation and the
"auto" / batch-size resolution live in ``_load.py``.

[Note: typed leaves, and the omegaconf mirror]
Each leaf is annotated with the type it holds once :meth:`ZeroConfig.resolve` has run: ints are
ints, floats floats, bools bools, and a string with a fixed set of values is a :class:`Choice`
enum (a ``str`` subclass, so ``device == "cpu"`` and ``{"cpu": ...}[device]`` keep working).
Before resolving, a leaf may still hold ``"auto"``: Hugging Face tools write it for almost any
value and fill it in later. :func:`leaf` records the real type, allowed values and bounds in the
field metadata; the loader enforces them and turns choices into their enum.
omegaconf 2.3 (the schema for Hydra recipes) supports neither ``Literal`` nor general ``Union``
types, so "int or 'auto'" cannot be an annotation it accepts: ``config_schema()`` therefore
builds its node from a mirror of these dataclasses whose leaves are ``Any`` (generated from
this schema by ``_load._mirror``, never written by hand). Sections stay nested dataclasses
there, so omegaconf still rejects unknown keys.

[Note: adding a section]
Add a frozen dataclass whose leaves use :func:`leaf`, add one field to :class:`ZeroConfig`
(``section(MyConfig)``), and delete its entry from :data:`UNSUPPORTED_KEYS`. The loader walks
dataclass fields recursively, so no parsing code changes; a cross-field rule, if any, is one
``Rule`` in ``rules.py`` (a check of one section's own values: ``_load._CHECKS``).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from enum import Enum
from typing import Any, NamedTuple

__all__ = [
    "AUTO",
    "SCHEDULER_REQUIRED_PARAMS",
    "TP_STYLES",
    "UNSUPPORTED_KEYS",
    "ActivationCheckpointingConfig",
    "TilingConfig",
    "MoEConfig",
    "BF16Config",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "Choice",
    "CometConfig",
    "CommDataType",
    "CommsLoggerConfig",
    "CompileConfig",
    "CompressionMethod",
    "ConfigError",
    "DeprecatedConfigWarning",
    "DsStrategyWarning",
    "FP16Config",
    "FlopsProfilerConfig",
    "GradientCompressionConfig",
    "KeyDoc",
    "Layout",
    "LeafSpec",
    "MemoryTimelineConfig",
    "OffloadConfig",
    "OffloadDevice",
    "OptimizerConfig",
    "PipelineConfig",
    "PipelineSchedule",
    "QuantKernel",
    "QuantizationConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "TensorParallelConfig",
    "TopologyConfig",
    "UnknownConfigKeyWarning",
    "UnsupportedConfigWarning",
    "WandbConfig",
    "ZeroConfig",
    "ZeroOptimizationConfig",
    "config_keys",
    "leaf",
    "register_operations",
    "section",
    "type_pattern",
]

AUTO = "auto"
"""Placeholder accepted for any leaf value, kept as is until :meth:`ZeroConfig.resolve`."""


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message names the key (and file).

    Args:
        message: what is wrong, where, and what to do.
        key: the dotted config key the error is about. ``None`` when it is about the whole file.
        path: the config file, when the config was loaded from one.

    Attributes:
        key: the dotted config key, or ``None``.
        path: the config file, or ``None``.
    """

    def __init__(self, message: str, *, key: str | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.path = path


class DsStrategyWarning(UserWarning):
    """Every ds_strategy warning: the config's below, and the kinds in
    ``ds_strategy.core.warnings`` (where it is exported; defined here, in the package's leaf
    layer, so that the config's warnings are kinds of it too)."""


class UnsupportedConfigWarning(DsStrategyWarning):
    """A DeepSpeed key that ds_strategy knows but does not implement; its value is ignored."""


class UnknownConfigKeyWarning(UnsupportedConfigWarning):
    """A key in no schema and far from every known key; ignored, as DeepSpeed ignores it.

    A key close to a known one is an error ("did you mean ...?") instead, and strict loading
    (``load_config(..., strict=True)`` or ``DS_STRATEGY_STRICT_CONFIG=1``) makes every
    unknown key an error.
    """


class DeprecatedConfigWarning(UnsupportedConfigWarning):
    """A key DeepSpeed deprecated, read with DeepSpeed's meaning (the message says how)."""


# Tracebacks and warning filters should show the public name, not this private module.
for _cls in (
    ConfigError,
    UnsupportedConfigWarning,
    UnknownConfigKeyWarning,
    DeprecatedConfigWarning,
):
    _cls.__module__ = "ds_strategy.config"
DsStrategyWarning.__module__ = "ds_strategy.core.warnings"  # where it is documented


class Choice(str, Enum):
    """A leaf with a fixed set of string values. Members equal, hash and print as their value,
    so code and messages written against the strings (``device == "cpu"``, ``f"{device!r}"``)
    read them unchanged."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    __hash__ = str.__hash__


class OffloadDevice(Choice):
    """Where an offloaded tier lives: ``offload_optimizer.device`` / ``offload_param.device``."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class PipelineSchedule(Choice):
    """``pipeline.schedule``."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class CommDataType(Choice):
    """``communication_data_type``: the dtype gradients are reduced in."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


class CompressionMethod(Choice):
    """``gradient_compression.method``."""

    NONE = "none"
    TOPK = "topk"


class QuantKernel(Choice):
    """``quantization.kernel`` (unset: ``auto``)."""

    TORCHAO = "torchao"
    TORCH = "torch"
    DEQUANTIZE = "dequantize"


@dataclass(frozen=True)
class LeafSpec:
    """What a leaf accepts, stored in field metadata (the annotation says the resolved type)."""

    kind: type  # int, float, bool, str or a Choice enum
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    # maps a value DeepSpeed accepts onto the equivalent one the engine understands (applied
    # after type coercion, before the checks above); must be idempotent, so that to_dict()
    # and load_config() round-trip
    normalize: Callable[[Any], Any] | None = None


def type_pattern(spec: str, key: str) -> re.Pattern[str] | None:
    """The compiled class-name regex of a ``"type:<regex>"`` value of ``key`` (None for any
    other value); a bad regex is a :class:`ConfigError` naming the key.

    >>> type_pattern("type:Block", "pipeline.partition_method").pattern
    'Block'
    """
    if not spec.startswith("type:"):
        return None
    try:
        return re.compile(spec[len("type:") :])
    except re.error as e:
        raise ConfigError(
            f"{key}: {spec!r} is not a valid regular expression ({e})", key=key
        ) from None


def leaf(
    kind: type,
    default: Any = MISSING,
    *,
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    normalize: Callable[[Any], Any] | None = None,
    aliases: tuple[str, ...] = (),
    doc: str = "",
) -> Any:
    """Declare a scalar field; without ``default`` the key is required (``default=None``: nullable).

    ``doc``: what the key does in this engine, in a sentence (its unit, what 0 / -1 / None
    mean, where it differs from DeepSpeed); :func:`config_keys` and the docs site read it.
    """
    if isinstance(kind, type) and issubclass(kind, Choice):
        choices = tuple(member.value for member in kind)
    spec = LeafSpec(kind, choices, ge, gt, le, normalize)
    return field(default=default, metadata={"leaf": spec, "aliases": aliases, "doc": doc})


def _zero_means_one(size: int) -> int:
    # DeepSpeed reduces its pending bucket before adding a gradient that would overflow it, so
    # a bucket size of 0 reduces every gradient on its own; the engine's smallest bucket (1)
    # does exactly that (a parameter larger than a bucket always gets one of its own).
    return 1 if size == 0 else size


def _negative_means_off(norm: float) -> float:
    # DeepSpeed clips only when gradient_clipping > 0; any value <= 0 means "no clipping".
    return max(0.0, norm)


def section(factory: Callable[[], Any], *, aliases: tuple[str, ...] = (), doc: str = "") -> Any:
    """Declare a nested section; ``factory`` builds its defaults (also what "auto" falls back to).
    ``doc``: what the section is for, in a sentence."""
    return field(default_factory=factory, metadata={"aliases": aliases, "doc": doc})


@dataclass(frozen=True)
class OffloadConfig:
    """``zero_optimization.offload_optimizer`` / ``offload_param``: where state lives off-GPU.

    ``device`` is ``"none"``, ``"cpu"`` or ``"nvme"``; ``"nvme"`` needs ``nvme_path``. The
    optimizer section defaults to ``buffer_count=4`` (DeepSpeed's default there), the parameter
    section to 5. ``ratio`` < 1 (partial optimizer offload) needs ZeRO stage 3. As in DeepSpeed,
    ``buffer_count`` and ``buffer_size`` may be 0; the NVMe step then works like 1 (one
    bucket of one element at a time at most: many small reads and writes, slow).

    >>> OffloadConfig(device="cpu", pin_memory=True).device
    'cpu'
    """

    device: OffloadDevice = leaf(
        OffloadDevice,
        OffloadDevice.NONE,
        doc="Where this tier's state lives: 'none' on the compute device, 'cpu' in host memory, "
        "'nvme' in host memory swapped to files under nvme_path. offload_optimizer needs ZeRO "
        "stage 1-3; offload_param needs stage 3 (below it is ignored with a warning, as "
        "DeepSpeed ignores it, and refused when loading strictly).",
    )
    nvme_path: str | None = leaf(
        str,
        None,
        doc="Directory (on a fast local drive) for the swap files when device is 'nvme', "
        "where it is required; both offload sections must name the same directory. None: unset.",
    )
    pin_memory: bool = leaf(
        bool,
        False,
        doc="Allocate the offloaded host tensors in page-locked memory for faster copies to and "
        "from a GPU; either section's true pins them all (never when swapped to NVMe, and "
        "without effect on a CPU-only machine).",
    )
    buffer_count: int = leaf(
        int,
        5,
        ge=0,
        le=1024,
        doc="NVMe only: at most this many buckets of the bucket-by-bucket optimizer step are in "
        "memory at once (read ahead, stepped, written behind); 0 works like 1. Taken from "
        "offload_optimizer when it is on NVMe, else from offload_param.",
    )
    buffer_size: int = leaf(
        int,
        100_000_000,
        ge=0,
        le=2**40,
        doc="NVMe only: elements per bucket of the bucket-by-bucket optimizer step; 0 works "
        "like 1 element (slow). Taken from offload_optimizer when it is on NVMe, else from "
        "offload_param (DeepSpeed has this key in offload_param only).",
    )
    max_in_cpu: int = leaf(
        int,
        1_000_000_000,
        ge=0,
        doc="DeepSpeed's count of parameter elements kept in host memory with NVMe parameter "
        "offload; accepted (any value >= 0) but not used here.",
    )
    fast_init: bool = leaf(
        bool,
        False,
        doc="DeepSpeed's faster optimizer initialisation with NVMe offload; accepted but not "
        "used here.",
    )
    ratio: float = leaf(
        float,
        1.0,
        ge=0.0,
        le=1.0,
        doc="offload_optimizer only: the share of optimizer state to offload (DeepSpeed's "
        "partial offload); below 1.0 it is refused below stage 3, and at stage 3 it warns and "
        "the whole state is offloaded. Not read in offload_param.",
    )


def _optimizer_offload_defaults() -> OffloadConfig:
    # DeepSpeed's optimizer-offload model defaults buffer_count to 4 (Adam keeps 4 tensors per
    # parameter on NVMe); its parameter-offload model uses 5. Both share one dataclass here.
    return OffloadConfig(buffer_count=4)


@dataclass(frozen=True)
class ZeroOptimizationConfig:
    """``zero_optimization``: the ZeRO stage and its bucketing, prefetch and offload knobs.

    Sizes count elements, not bytes, as in DeepSpeed. ``offload_param`` needs stage 3. The
    ``stage3_*`` keys also accept DeepSpeed's unprefixed spellings (``prefetch_bucket_size``, ...).
    Every size and threshold accepts 0, with DeepSpeed's meaning:

    - ``reduce_bucket_size: 0`` reduces every gradient on its own (DeepSpeed flushes its
      bucket before each gradient that would overflow it). It is stored as 1, the engine's
      equivalent: one flat group and one collective per parameter, i.e. many small
      collectives, slower than the default, and under stage 3 one all-gather per parameter.
    - ``stage3_prefetch_bucket_size: 0`` or ``stage3_max_live_parameters: 0``: no prefetch;
      each unit is gathered when it is reached, so communication no longer overlaps compute.
    - ``stage3_param_persistence_threshold: 0``: every parameter is sharded (none kept whole).
    - ``stage3_max_reuse_distance: 0``: every unit but the last is released after its
      forward and gathered again for its backward.
    - ``allgather_bucket_size`` is accepted with any value >= 0 but not used: updated
      parameters are gathered per flat group (sized by ``reduce_bucket_size``).

    DeepSpeed's deprecated ``cpu_offload: true`` / ``cpu_offload_param: true`` are read as
    ``offload_optimizer`` / ``offload_param`` with ``device: cpu`` (with a warning).

    >>> ZeroOptimizationConfig(stage=2).reduce_bucket_size
    500000000
    """

    stage: int = leaf(
        int,
        0,
        choices=(0, 1, 2, 3),
        doc="What is sharded over the data-parallel ranks: 0 nothing (gradients all-reduced, "
        "like DDP), 1 the optimizer state and fp32 master weights, 2 also the gradients, 3 also "
        "the parameters (gathered unit by unit for forward and backward).",
    )
    overlap_comm: bool = leaf(
        bool,
        True,
        doc="Stages 1-2: the all-gather of the updated parameters after a step runs while the "
        "next forward starts (each block waits only for its own); false waits for all of it "
        "at the step. No effect at stages 0 and 3 (gradient reductions overlap backward anyway).",
    )
    contiguous_gradients: bool = leaf(
        bool,
        True,
        doc="Accepted but not read: stages 2-3 always move each gradient into its flat bucket "
        "as backward produces it (DeepSpeed's true).",
    )
    reduce_scatter: bool = leaf(
        bool,
        True,
        doc="Accepted but not read: stages 1-3 always reduce-scatter the gradients (stage 0 "
        "all-reduces them), as DeepSpeed's true does.",
    )
    reduce_bucket_size: int = leaf(
        int,
        500_000_000,
        ge=0,
        normalize=_zero_means_one,
        doc="Elements per flat parameter group, the unit in which gradients are reduced (and, "
        "at stages 1-2, updated parameters gathered); half that at stages 1-3 on gloo, whose "
        "reduce-scatter needs a full-size receive buffer. 0: each gradient on its own (stored "
        "as 1).",
    )
    sub_group_size: int = leaf(
        int,
        1_000_000_000,
        ge=1,
        doc="Elements stepped at once where the step converts precision (bf16/fp16 masters, "
        "bf16 optimizer states; at most 2**20), and of whole matrices Muon orthogonalizes at "
        "once (at most 2**22): lower it to bound their fp32 copies.",
    )
    allgather_partitions: bool = leaf(
        bool,
        True,
        doc="Accepted but not read: updated parameters are always all-gathered (DeepSpeed's "
        "false uses a series of broadcasts instead).",
    )
    allgather_bucket_size: int = leaf(
        int,
        500_000_000,
        ge=0,
        doc="Accepted (any value >= 0) but not used: updated parameters are gathered per flat "
        "group, sized by reduce_bucket_size.",
    )
    stage3_prefetch_bucket_size: int = leaf(
        int,
        50_000_000,
        ge=0,
        aliases=("prefetch_bucket_size",),
        doc="Stage 3: parameter elements of the units gathered ahead of the one running, in "
        "the order the first step recorded; 0: no prefetch (each unit is gathered when "
        "reached, so communication no longer overlaps compute).",
    )
    stage3_max_live_parameters: int = leaf(
        int,
        1_000_000_000,
        ge=0,
        aliases=("max_live_parameters",),
        doc="Stage 3: prefetching stops where the gathered parameters would exceed this many "
        "elements (a unit needed now is gathered regardless); 0: no prefetch.",
    )
    stage3_max_reuse_distance: int = leaf(
        int,
        1_000_000_000,
        ge=0,
        aliases=("max_reuse_distance",),
        doc="Stage 3: the last units of forward stay gathered into backward while backward "
        "reuses each within this many gathered elements and they fit "
        "stage3_max_live_parameters beside the prefetch; 0: each unit but the last is "
        "released after its forward.",
    )
    stage3_param_persistence_threshold: int = leaf(
        int,
        100_000,
        ge=0,
        aliases=("param_persistence_threshold",),
        doc="Stage 3: parameters of at most this many elements are kept whole on every rank "
        "instead of sharded (gathering them costs more than it saves); 0: every parameter is "
        "sharded.",
    )
    zero_quantized_weights: bool = leaf(
        bool,
        False,
        doc="ZeRO++ qwZ: stage 3's parameter all-gathers send block-quantized int8; no effect "
        "below stage 3.",
    )
    zero_hpz_partition_size: int = leaf(
        int,
        1,
        ge=1,
        doc="ZeRO++ hpZ: stage 3 keeps a secondary shard of the parameters over groups of "
        "this many ranks (usually one machine's), which serves every gather after a step's "
        "first; 1: off. Must divide the data-parallel ranks; no effect below stage 3.",
    )
    zero_quantized_gradients: bool = leaf(
        bool,
        False,
        doc="ZeRO++ qgZ: stage 3's gradient reduce-scatters send block-quantized int8; no "
        "effect below stage 3.",
    )
    mics_shard_size: int = leaf(
        int,
        -1,
        ge=-1,
        doc="MiCS: shard over groups of this many ranks and replicate across the groups "
        "(stages 1-3; it must divide the data-parallel ranks); -1 or 0: off, shard over all.",
    )
    offload_optimizer: OffloadConfig = section(
        _optimizer_offload_defaults,
        doc="Where the optimizer state and fp32 master weights live (ZeRO-Offload / "
        "ZeRO-Infinity): on the compute device, in host memory or on NVMe.",
    )
    offload_param: OffloadConfig = section(
        OffloadConfig,
        doc="Where stage 3's parameter shards live: on the compute device, in host memory or "
        "on NVMe (stage 3 only).",
    )


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: fp16 mixed precision with a (by default dynamic) loss scale.

    ``loss_scale`` 0 means dynamic scaling starting at ``2 ** initial_scale_power`` (an
    integer in [-64, 64]: a negative power starts below 1, and beyond 64 the scale leaves what
    the scaler can represent). As in DeepSpeed, ``loss_scale_window`` must be >= 1,
    ``min_loss_scale`` > 0 and ``hysteresis`` (the overflows tolerated before the scale
    drops) >= 1 only when fp16 is enabled with dynamic scaling (unused otherwise).

    >>> FP16Config(enabled=True).loss_scale_window
    1000
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Train in fp16: fp16 parameters and gradients, fp32 master weights and a loss "
        "scale; not together with bf16.",
    )
    loss_scale: float = leaf(
        float,
        0.0,
        ge=0.0,
        le=2.0**64,
        doc="0: dynamic loss scaling starting at 2 ** initial_scale_power; > 0: this static "
        "scale for the whole run.",
    )
    initial_scale_power: int = leaf(
        int,
        16,
        ge=-64,
        le=64,
        doc="Dynamic scaling starts at a loss scale of 2 ** this (a negative power starts "
        "below 1).",
    )
    # no bound in the spec for the next three: they are checked only where dynamic scaling
    # uses them (rules._dynamic_loss_scaling), as DeepSpeed checks them
    loss_scale_window: int = leaf(
        int,
        1000,
        doc="Dynamic scaling doubles the scale after this many consecutive steps without an "
        "overflow; must be >= 1 when fp16 is enabled with dynamic scaling.",
    )
    hysteresis: int = leaf(
        int,
        2,
        doc="Overflows (each one skips its step) tolerated before dynamic scaling halves the "
        "scale; must be >= 1 when fp16 is enabled with dynamic scaling.",
    )
    consecutive_hysteresis: bool = leaf(
        bool,
        False,
        doc="true: the hysteresis allowance refills after every step without an overflow; "
        "false: only when the scale grows.",
    )
    min_loss_scale: float = leaf(
        float,
        1.0,
        doc="Floor of the dynamic scale; an overflow at it is an error (training could not "
        "progress). Must be > 0 when fp16 is enabled with dynamic scaling.",
    )
    auto_cast: bool = leaf(
        bool,
        False,
        doc="Accepted but not read: under fp16 (and bf16) the floating-point inputs of forward "
        "are always cast to the compute dtype, as DeepSpeed's true does.",
    )
    fp16_master_weights_and_grads: bool = leaf(
        bool,
        False,
        doc="true: no fp32 master; the optimizer steps the fp16 weights (2 bytes a parameter "
        "instead of 4), computing in fp32 and rounding the result stochastically.",
    )


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (DeepSpeed also reads the old name ``bfloat16``): bf16 mixed precision.

    >>> BF16Config(enabled=True).immediate_grad_update
    False
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Train in bf16: bf16 parameters and gradients, fp32 master weights (see "
        "master_weights), no loss scaling; not together with fp16.",
    )
    immediate_grad_update: bool = leaf(
        bool,
        False,
        doc="Accepted but not read: gradients are accumulated in bf16 and converted to fp32 "
        "for the step (DeepSpeed's true adds each one to an fp32 buffer as backward makes it).",
    )
    master_weights: bool = leaf(
        bool,
        True,
        doc="ds_strategy's own key: false trains the bf16 weights directly (no fp32 master "
        "copy, optimizer state in bf16), like Lightning's 'bf16-true'.",
    )
    bf16_master_weights_and_grads: bool = leaf(
        bool,
        False,
        doc="true: no fp32 master; the optimizer steps the bf16 weights with bf16 gradients "
        "(2 bytes a parameter instead of 4), computing in fp32 and rounding the result "
        "stochastically, so updates below bf16's resolution are kept on average.",
    )
    bf16_optimizer_states: bool = leaf(
        bool,
        False,
        doc="true: the optimizer's per-element state (Adam's two moments) is kept in bf16, "
        "8 bytes a parameter down to 4; each step computes in fp32 and rounds stochastically.",
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``{"type": "AdamW", "params": {...}}`` as DeepSpeed writes it.

    ``params`` is passed through as given (values may be ``"auto"``); the dict is the loader's
    own copy, but treat it as read-only like the rest of the config.

    >>> OptimizerConfig(type="AdamW", params={"lr": 1e-4}).params["lr"]
    0.0001
    """

    type: str = leaf(
        str,
        doc="The optimizer built when none is passed to the engine: a torch.optim class name "
        "(Adam, AdamW, SGD, ...) or one of DeepSpeed's implemented here (Lamb, OneBitAdam, "
        "OneBitLamb, ZeroOneAdam); required in this section.",
    )
    params: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "The optimizer's keyword arguments, checked against its signature and "
            "passed as given (Adam and AdamW decouple weight decay, as in DeepSpeed); an "
            '"auto" entry is filled by a front end or dropped for the optimizer\'s default.'
        },
    )


SCHEDULER_REQUIRED_PARAMS: dict[str, tuple[str, ...]] = {
    # DeepSpeed's schedules (runtime/lr_schedules.py) whose constructors take these without a
    # default: a config that names the type must give them (or "auto", for a front end to fill).
    # (a torch.optim.lr_scheduler class named by type is checked when the engine builds it)
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}
"""Parameters a ``scheduler.type`` cannot do without; missing ones are a :class:`ConfigError`."""


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: ``{"type": "WarmupLR", "params": {...}}`` as DeepSpeed writes it.

    A parameter the type requires (:data:`SCHEDULER_REQUIRED_PARAMS`, e.g. ``total_num_steps``
    of ``WarmupDecayLR``) must be given or ``"auto"``; an ``"auto"`` one must get a value when
    the config is resolved. Either way the error names ``scheduler.params.<name>``.

    >>> SchedulerConfig(type="WarmupLR").params
    {}
    """

    type: str = leaf(
        str,
        doc="The lr schedule, stepped after every optimizer step: one of DeepSpeed's (WarmupLR, "
        "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) or any torch.optim.lr_scheduler "
        "class; required in this section. The warm-up schedules start one step earlier than "
        "DeepSpeed's.",
    )
    params: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "The schedule's keyword arguments, passed as given; those a type cannot do "
            'without (total_num_steps of WarmupDecayLR, ...) must be given or "auto".'
        },
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: periodic checkpoints written by ``engine.step()``.

    Every ``save_interval`` optimizer steps the engine saves to ``save_dir/global_step<N>`` and
    points ``save_dir/latest`` at it; ``keep_last`` keeps only the newest k such checkpoints
    (checkpoints saved under other tags are never pruned);
    ``async_save`` writes in the background while training continues. DeepSpeed's own keys of
    this section (``tag_validation``, ``load_universal``, ...) are not implemented and warn.

    >>> CheckpointConfig(save_dir="ckpt", save_interval=100).keep_last is None
    True
    """

    save_dir: str | None = leaf(
        str,
        None,
        doc="Root directory of the periodic checkpoints (save_dir/global_step<N>, with "
        "save_dir/latest naming the newest; a pipeline stage k uses save_dir/stage_<k>); "
        "required with save_interval. None: unset.",
    )
    save_interval: int | None = leaf(
        int,
        None,
        ge=1,
        doc="engine.step() saves a checkpoint every this many optimizer steps; None: no "
        "periodic checkpoints.",
    )
    keep_last: int | None = leaf(
        int,
        None,
        ge=1,
        doc="Keep only the newest this many global_step<N> checkpoints of a root (never the "
        "one latest names, nor other tags); None: keep all.",
    )
    async_save: bool = leaf(
        bool,
        False,
        doc="Default of save_checkpoint's async_save: copy the state and write it in the "
        "background while training continues (engine.wait_for_checkpoint() waits for it).",
    )


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline``: split an ``nn.Sequential`` into ``stages`` pipeline stages, each trained
    data-parallel (any ZeRO stage) over ``world_size / stages`` ranks.

    ``partition_method`` balances ``"parameters"`` (trainable parameter counts), ``"uniform"``
    (layer counts) or ``"type:<regex>"`` (layers whose class name matches). ``schedule`` is
    ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``; ``stages_per_rank`` (ds_strategy's own
    key) is the number of model chunks each rank holds (default 2 for the interleaved
    schedule, else 1).

    >>> PipelineConfig(stages=2).schedule
    '1f1b'
    """

    stages: int = leaf(
        int,
        1,
        ge=1,
        doc="Pipeline stages the nn.Sequential is split into, each data-parallel over world "
        "size / stages ranks; 1: no pipeline. Built by ds_strategy.initialize(..., loss_fn=...) "
        "and the Lightning and Accelerate front ends; a plain ZeroEngine refuses more than 1.",
    )
    partition_method: str = leaf(
        str,
        "parameters",
        doc="How layers are balanced over the stages: 'parameters' (trainable parameter "
        "counts), 'uniform' (layer counts) or 'type:<regex>' (layers whose class name the "
        "regex finds); DeepSpeed's PipelineModule argument, a config key here.",
    )
    schedule: PipelineSchedule = leaf(
        PipelineSchedule,
        PipelineSchedule.ONE_F_ONE_B,
        doc="ds_strategy's key (DeepSpeed always runs 1F1B): torch.distributed.pipelining's "
        "'gpipe', '1f1b' or 'interleaved_1f1b' (several chunks per rank; micro-batches a "
        "multiple of stages).",
    )
    stages_per_rank: int | None = leaf(
        int,
        None,
        ge=1,
        doc="ds_strategy's key: model chunks each rank holds, more than 1 only with "
        "'interleaved_1f1b'; None: 2 for the interleaved schedule, else 1.",
    )


TP_STYLES = ("colwise", "rowwise", "replicate")


@dataclass(frozen=True)
class TensorParallelConfig:
    """``tensor_parallel``: each layer's weights split across ``autotp_size`` ranks (DeepSpeed's
    AutoTP key) with torch's DTensor tensor parallelism; ZeRO then shards over the remaining
    ``world_size / autotp_size`` data-parallel ranks.

    ``plan`` (ds_strategy's key) maps a regular expression over module names to ``"colwise"``
    (output features split), ``"rowwise"`` (input features split, outputs summed) or
    ``"replicate"``; empty: the automatic plan for the models it knows (the package's demo
    GPT, Hugging Face Llama-family models).

    >>> TensorParallelConfig(autotp_size=2).plan
    {}
    """

    autotp_size: int = leaf(
        int,
        1,
        ge=1,
        aliases=("tp_size",),
        doc="Ranks each split layer's weights are divided over (DeepSpeed's AutoTP key; also "
        "read as tp_size, DeepSpeed inference's name); ZeRO shards over world size / "
        "autotp_size. 1: no tensor parallelism.",
    )
    plan: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "ds_strategy's key: regular expression matching whole module names -> "
            "'colwise', 'rowwise' or 'replicate'; empty: the automatic plan for the models it "
            "knows (the demo GPT, Hugging Face Llama-family models and GPT-2)."
        },
    )


@dataclass(frozen=True)
class QuantizationConfig:
    """``quantization`` (ds_strategy's section): weight-only integer quantization of the
    ``nn.Linear`` and ``nn.Embedding`` weights, for ``ds_strategy.init_inference`` (weights
    quantized on load and kept quantized in memory, in ZeRO's all-gathers and on disk) or, with
    ``qat: true``, trained with fake-quantized weights by the training engine.

    ``bits``: 8 (one scale per output channel) or 4 (one scale per ``group_size`` input
    features, two values packed per byte); unset: no quantization. ``symmetric``: signed values
    and a scale (as torchao's symmetric schemes), or unsigned values with a scale and a zero
    point. ``modules_to_not_convert``: regular expressions searched in module names (so a plain
    name such as ``"lm_head"`` matches it anywhere, as in transformers); those modules keep
    their full-precision weights, as do embeddings with ``embeddings: false``. ``kernel``:
    ``auto`` (torchao's quantized tensors where they cover the bits and device, else
    dequantize-then-matmul), ``torchao``, ``torch`` (torch's int8 weight-only matmul) or
    ``dequantize``.

    >>> QuantizationConfig(bits=4).group_size
    64
    """

    bits: int | None = leaf(
        int,
        None,
        choices=(4, 8),
        doc="Bits per quantized weight: 8 (one scale per output channel) or 4 (one scale per "
        "group_size input features, two values per byte); None: no quantization.",
    )
    group_size: int = leaf(
        int,
        64,
        choices=(32, 64, 128),
        doc="4 bits only: input features that share one scale (and zero point); not used at 8 "
        "bits.",
    )
    symmetric: bool = leaf(
        bool,
        True,
        doc="true: signed values and a scale; false: unsigned values with a scale and a zero "
        "point.",
    )
    modules_to_not_convert: list[str] = field(
        default_factory=list,
        metadata={
            "doc": "Regular expressions searched in module names (so 'lm_head' matches it "
            "anywhere, as in transformers); matching modules keep full-precision weights."
        },
    )
    embeddings: bool = leaf(
        bool,
        True,
        doc="Quantize the nn.Embedding weights too; false keeps them in full precision.",
    )
    kernel: QuantKernel | None = leaf(
        QuantKernel,
        None,
        doc="How a quantized layer computes: 'torchao' (torchao's int8 tensors), 'torch' "
        "(torch's int8 weight-only matmul), both for 8-bit symmetric weights only, or "
        "'dequantize' (dequantize, then matmul); None: torchao where it can, else dequantize.",
    )
    qat: bool = leaf(
        bool,
        False,
        doc="Quantization-aware training: the training engine trains with fake-quantized "
        "weights; needs bits, refused with tensor parallelism and by inference engines.",
    )


@dataclass(frozen=True)
class GradientCompressionConfig:
    """``gradient_compression`` (ds_strategy's section): send only part of the gradients.

    ``method: "topk"`` sends each rank's ``ratio`` largest-magnitude entries of every flat
    gradient bucket (index and value) after accumulation and keeps the rest as a residual
    added to the next step's gradients (error feedback); ZeRO stages 0, 1 and 2. The first
    ``warmup_steps`` optimizer steps are dense. ``momentum_correction`` (Deep Gradient
    Compression) accumulates a local velocity ``u = momentum * u + g`` instead of the gradient
    and clears the sent entries from it (factor masking): the optimizer must then be SGD,
    whose momentum it replaces.

    >>> GradientCompressionConfig().method
    'none'
    """

    method: CompressionMethod = leaf(
        CompressionMethod,
        CompressionMethod.NONE,
        normalize=str.lower,
        doc="'topk': each rank sends only its largest gradient entries with error feedback "
        "(ZeRO stages 0-2, without tensor or pipeline parallelism); 'none': dense reductions. "
        "Case-insensitive.",
    )
    ratio: float = leaf(
        float,
        0.01,
        gt=0.0,
        le=1.0,
        doc="With 'topk': the share of each flat gradient bucket's entries a rank sends per "
        "step; the rest is kept as a residual for the next step.",
    )
    warmup_steps: int = leaf(
        int,
        0,
        ge=0,
        doc="The first this many optimizer steps reduce dense gradients; 0: compress from the "
        "first step.",
    )
    momentum_correction: bool = leaf(
        bool,
        False,
        doc="Deep Gradient Compression: accumulate a local momentum velocity instead of the "
        "gradient and clear the sent entries; needs torch.optim.SGD with one momentum > 0, "
        "which it replaces.",
    )


@dataclass(frozen=True)
class CompileConfig:
    """``compile`` (DeepSpeed's section): ``torch.compile`` the model one unit at a time at
    ``initialize`` (each block ZeRO-3 gathers as one, or the whole model when it has no
    blocks), as ``engine.compile()`` does when called. ``backend``: torch.compile's backend
    (a name from ``torch._dynamo.list_backends()`` or ``"package.module.function"``);
    ``kwargs``: torch.compile's other keyword arguments (``mode``, ``dynamic``,
    ``fullgraph``, ``options``).

    >>> CompileConfig().backend
    'inductor'
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="torch.compile the model one unit at a time at initialize (each block ZeRO-3 "
        "gathers as one, or the whole model without blocks), as engine.compile() does.",
    )
    backend: str = leaf(
        str,
        "inductor",
        doc="torch.compile's backend: a name from torch._dynamo.list_backends() or "
        "'package.module.function', imported.",
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "torch.compile's other keyword arguments (mode, dynamic, fullgraph, "
            "options), passed as given."
        },
    )


@dataclass(frozen=True)
class TopologyConfig:
    """``topology`` (ds_strategy's section): how many ranks share a machine.

    ``ranks_per_machine`` overrides what the launcher says (``LOCAL_WORLD_SIZE``, SLURM's
    tasks per node); ``None`` takes the launcher's word, or one machine without one. Setting
    it on one machine simulates several: collectives among ranks of different "machines"
    are then counted as inter-machine (``comm_report()``'s ``inter_machine``).
    ``hierarchical`` runs ZeRO's reduce-scatters, all-gathers and all-reduces in two levels,
    inside each machine first, then across machines among ranks with the same local rank.
    ``shared_memory`` lets CPU ranks of one machine exchange ZeRO's reduce-scatters and
    all-gathers through shared memory (``core/shm.py``).

    >>> TopologyConfig().ranks_per_machine is None
    True
    """

    ranks_per_machine: int | None = leaf(
        int,
        None,
        ge=1,
        doc="Ranks per machine, overriding the launcher's (LOCAL_WORLD_SIZE, SLURM's tasks per "
        "node); it must divide the world size. None: the launcher's, or one machine without "
        "one.",
    )
    hierarchical: bool = leaf(
        bool,
        False,
        doc="Run ZeRO's reduce-scatters, all-gathers and all-reduces in two levels: inside each "
        "machine, then across machines among ranks with the same local rank; not with MiCS.",
    )
    shared_memory: bool = leaf(
        bool,
        True,
        doc="CPU ranks on one machine (gloo) run ZeRO's reduce-scatters and all-gathers through "
        "files in /dev/shm instead of loopback TCP: one copy instead of four. Falls back to gloo "
        "by itself where a rank cannot map the others' files.",
    )


@dataclass(frozen=True)
class TensorBoardConfig:
    """``tensorboard`` (DeepSpeed's monitor section): rank 0 writes the training events
    (``Train/Samples/...``, see ``core/monitor``) to TensorBoard event files in
    ``output_path/job_name/`` (``output_path`` empty: relative to the working directory).
    Needs the ``tensorboard`` package (the ``monitor`` extra).

    >>> TensorBoardConfig(enabled=True).job_name
    'DeepSpeedJobName'
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Rank 0 writes the training events every steps_per_print steps to TensorBoard event "
        "files (needs the tensorboard package).",
    )
    output_path: str = leaf(
        str,
        "",
        doc="Directory the files go under (output_path/job_name/); empty: relative to the "
        "working directory.",
    )
    job_name: str = leaf(
        str,
        "DeepSpeedJobName",
        doc="Subdirectory of output_path for this run's files.",
    )


@dataclass(frozen=True)
class CSVMonitorConfig:
    """``csv_monitor`` (DeepSpeed's monitor section): rank 0 writes one CSV file per event
    (``Train_Samples_train_loss.csv``, columns ``step`` and the event's last name part) in
    ``output_path/job_name/``, as DeepSpeed's CSV monitor does.

    >>> CSVMonitorConfig().output_path
    ''
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Rank 0 writes each training event to its own CSV file every steps_per_print "
        "steps; with memory_timeline on, every rank also writes its timeline there.",
    )
    output_path: str = leaf(
        str,
        "",
        doc="Directory the files go under (output_path/job_name/); empty: relative to the "
        "working directory.",
    )
    job_name: str = leaf(
        str,
        "DeepSpeedJobName",
        doc="Subdirectory of output_path for this run's files.",
    )


@dataclass(frozen=True)
class WandbConfig:
    """``wandb`` (DeepSpeed's monitor section): rank 0 logs the training events to a W&B run
    (``project``, ``group``, ``team`` as W&B's entity), or to the run already started in this
    process (a training framework's logger). Needs the ``wandb`` package.

    >>> WandbConfig().project
    'deepspeed'
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Rank 0 logs the training events to a W&B run, or to the one already started in "
        "this process (needs the wandb package).",
    )
    group: str | None = leaf(str, None, doc="The W&B run's group; None: no group.")
    team: str | None = leaf(
        str, None, doc="The W&B entity (team or user) of the run; None: W&B's default."
    )
    project: str = leaf(str, "deepspeed", doc="The W&B project of the run.")


@dataclass(frozen=True)
class CometConfig:
    """``comet`` (DeepSpeed's monitor section): rank 0 logs the training events to a Comet
    experiment (``comet_ml.start`` with these keys; unset ones come from Comet's own config
    file or environment), each event at most once per ``samples_log_interval`` samples.
    Needs the ``comet_ml`` package.

    >>> CometConfig().samples_log_interval
    100
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Rank 0 logs the training events to a Comet experiment (needs the comet_ml package).",
    )
    samples_log_interval: int = leaf(
        int,
        100,
        ge=1,
        doc="Each event is logged at most once per this many training samples.",
    )
    project: str | None = leaf(
        str, None, doc="Comet project, passed to comet_ml.start; None: Comet's own setting."
    )
    workspace: str | None = leaf(
        str, None, doc="Comet workspace, passed to comet_ml.start; None: Comet's own setting."
    )
    api_key: str | None = leaf(
        str, None, doc="Comet API key, passed to comet_ml.start; None: Comet's own setting."
    )
    experiment_name: str | None = leaf(
        str, None, doc="Name given to the experiment; None: Comet's default name."
    )
    experiment_key: str | None = leaf(
        str,
        None,
        doc="Key of the experiment to resume or create, passed to comet_ml.start; None: a new one.",
    )
    online: bool | None = leaf(
        bool,
        None,
        doc="false: log offline (to a local archive); None: Comet's own setting.",
    )
    mode: str | None = leaf(
        str,
        None,
        choices=("get", "create", "get_or_create"),
        doc="comet_ml.start's mode: resume the experiment (experiment_key), create one, or "
        "either; None: Comet's default.",
    )


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """``flops_profiler`` (DeepSpeed's section): at optimizer step ``profile_step`` (counted as
    DeepSpeed counts it: the steps finished before it) every module's parameters, forward
    FLOPs / MACs and latency are measured, with the totals, the achieved TFLOPS and the MFU;
    rank 0 prints them in DeepSpeed's layout (to ``output_file`` when set) and
    ``engine.flops_report()`` returns them (``core/profiling``). The backward counts
    ``2 + recompute_fwd_factor`` forwards (``recompute_fwd_factor``: the share of the forward
    that activation checkpointing runs again). ``module_depth`` (-1: all) and ``top_modules``
    shape the printed profile; ``detailed`` adds the per-module tree. ``peak_tflops``
    (ds_strategy's key) is the device's peak for the MFU; unset, it is measured once with a
    timed matmul in the compute dtype, and the report says so.

    >>> FlopsProfilerConfig(enabled=True).profile_step
    1
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Profile one optimizer step: per-module parameters, forward FLOPs / MACs and "
        "latency, the totals, achieved TFLOPS and MFU, printed by rank 0 and returned by "
        "engine.flops_report().",
    )
    recompute_fwd_factor: float = leaf(
        float,
        0.0,
        ge=0.0,
        doc="The share of the forward that activation checkpointing runs again: the backward "
        "counts as 2 + this many forwards; 0: no recomputation.",
    )
    profile_step: int = leaf(
        int,
        1,
        ge=0,
        doc="The optimizer step profiled, counted as DeepSpeed counts (the steps finished "
        "before it); its latencies come from the step before, except at 0.",
    )
    module_depth: int = leaf(
        int,
        -1,
        ge=-1,
        doc="Deepest module level shown in the printed profile; -1: all levels.",
    )
    top_modules: int = leaf(
        int,
        1,
        ge=1,
        doc="Module types listed per depth in the printed profile's top list.",
    )
    detailed: bool = leaf(
        bool,
        True,
        doc="Print the per-module tree after the summary.",
    )
    output_file: str | None = leaf(
        str,
        None,
        doc="File rank 0 writes the profile to (a pipeline stage k > 0 adds _stage<k> before "
        "the suffix); None: printed to standard output.",
    )
    peak_tflops: float | None = leaf(
        float,
        None,
        gt=0.0,
        doc="ds_strategy's key: the device's peak TFLOPS the MFU is computed against; None: "
        "measured once with a timed matmul in the compute dtype (the report says so).",
    )


@dataclass(frozen=True)
class CommsLoggerConfig:
    """``comms_logger`` (DeepSpeed's section): per collective kind, the count, message sizes,
    bytes sent, time, algorithmic and bus bandwidth and the straggler gap between ranks,
    returned by ``engine.comms_report()`` and printed by ``engine.log_summary()`` in
    DeepSpeed's table (``core/profiling/comms.py``). ``prof_all`` logs every kind; else only
    the kinds or ops named in ``prof_ops`` (such as ``"all_gather"``). ``verbose``: rank 0
    prints each collective as it completes; ``debug``: kinds are split by calling function.

    >>> CommsLoggerConfig(enabled=True).prof_all
    True
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Record each collective kind's count, message sizes, bytes, time, bandwidths and "
        "straggler gap; engine.comms_report() returns them, engine.log_summary() prints them.",
    )
    verbose: bool = leaf(
        bool,
        False,
        doc="Rank 0 prints each collective as it completes.",
    )
    prof_all: bool = leaf(
        bool,
        True,
        doc="Record every collective kind; false: only the kinds or ops named in prof_ops.",
    )
    prof_ops: list[str] = field(
        default_factory=list,
        metadata={
            "doc": "Kinds (such as 'all_gather', 'control') or ops (such as 'all_reduce') "
            "recorded when prof_all is false."
        },
    )
    debug: bool = leaf(
        bool,
        False,
        doc="Split each kind by the function that issued the collective.",
    )


@dataclass(frozen=True)
class MemoryTimelineConfig:
    """``memory_timeline`` (ds_strategy's section): the engine's model-state meter records every
    allocation and free (sequence number, time, phase, bytes held by kind after it) of the
    latest optimizer step, at most ``max_events`` of them per step; ``engine.memory_timeline()``
    returns them, and with ``csv_monitor`` on every rank writes them to
    ``memory_timeline_<rank>.csv`` beside the monitor's files (``ds-strategy plot`` draws them).

    >>> MemoryTimelineConfig().max_events
    100000
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="Record every model-state allocation and free of the latest optimizer step for "
        "engine.memory_timeline() (and, with csv_monitor, memory_timeline_<rank>.csv).",
    )
    max_events: int = leaf(
        int,
        100_000,
        ge=1,
        doc="Events kept per step at most; later ones are only counted (as dropped).",
    )


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: recompute chosen modules' activations in backward
    (non-reentrant ``torch.utils.checkpoint``) instead of keeping them.

    ds_strategy's own keys: ``enabled``; ``modules`` is ``"blocks"`` (every element of the
    model's ``nn.ModuleList`` / ``nn.Sequential`` containers; under a pipeline every layer)
    or ``"type:<regex>"`` (modules whose class name matches); ``every`` checkpoints one
    chosen module in ``every``. Of DeepSpeed's keys, ``cpu_checkpointing`` keeps the
    checkpointed inputs on the CPU; the others are accepted and warn.

    >>> ActivationCheckpointingConfig(enabled=True).modules
    'blocks'
    """

    enabled: bool = leaf(
        bool,
        False,
        doc="ds_strategy's key: checkpoint the modules that modules and every choose (DeepSpeed "
        "checkpoints what the model code wraps instead).",
    )
    modules: str = leaf(
        str,
        "blocks",
        doc="ds_strategy's key: 'blocks' (every element of the model's nn.ModuleList / "
        "nn.Sequential containers) or 'type:<regex>' (modules whose class name it fully "
        "matches); choosing no module is an error.",
    )
    every: int = leaf(
        int,
        1,
        ge=1,
        doc="ds_strategy's key: checkpoint one chosen module in this many (1: all of them).",
    )
    cpu_checkpointing: bool = leaf(
        bool,
        False,
        doc="Keep the checkpointed modules' inputs as CPU copies between forward and backward "
        "(moved back for the recompute); no effect on a CPU-only run.",
    )
    partition_activations: bool = leaf(
        bool,
        False,
        doc="DeepSpeed's key, not implemented: true warns (when enabled) and activations are not partitioned "
        "across ranks.",
    )
    contiguous_memory_optimization: bool = leaf(
        bool,
        False,
        doc="DeepSpeed's key, not implemented: true warns (when enabled) and checkpointed inputs are not "
        "copied to one buffer.",
    )
    number_checkpoints: int | None = leaf(
        int,
        None,
        doc="DeepSpeed's key, not implemented: a value warns (when enabled); modules and every choose what is "
        "checkpointed.",
    )
    synchronize_checkpoint_boundary: bool = leaf(
        bool,
        False,
        doc="DeepSpeed's key, not implemented: true warns (when enabled); no device synchronisation is done "
        "at checkpoint boundaries.",
    )
    profile: bool = leaf(
        bool,
        False,
        doc="DeepSpeed's key, not implemented: true warns (when enabled); checkpointed forwards are not timed.",
    )


@dataclass(frozen=True)
class TilingConfig:
    """``tiling``: ds_strategy's section. Memory tools for long sequences, in the spirit of
    Arctic Long Sequence Training. Each runs a computation over tiles of ``tokens`` tokens
    and recomputes a tile's intermediates in backward, so only one tile's are alive at a
    time. A sequence-parallel rank tiles its own block.

    >>> TilingConfig(loss=True).tokens
    4096
    """

    loss: bool = leaf(
        bool,
        False,
        doc="A transformers causal LM's loss from its logits one tile at a time: never the "
        "whole sequence x vocabulary logits at once. The output then carries no logits.",
    )
    mlp: bool = leaf(
        bool,
        False,
        doc="Run the MLP modules mlp_modules chooses over tiles of tokens, recomputing each "
        "tile's activations in backward.",
    )
    mlp_modules: str = leaf(
        str,
        "mlp",
        doc="'mlp': the modules a model names mlp or feed_forward (not a mixture of "
        "experts); 'type:<regex>': modules "
        "whose class name it fully matches. Each must map tokens to tokens one by one.",
    )
    tokens: int = leaf(
        int,
        4096,
        ge=1,
        le=2**31,
        doc="Tokens per tile.",
    )


@dataclass(frozen=True)
class MoEConfig:
    """``moe``: ds_strategy's section. Expert parallelism: each rank of an expert group
    holds ``num_experts / ep_size`` experts of every mixture-of-experts layer, and tokens
    travel to their experts' ranks and back. It takes transformers' MoE models (Mixtral,
    Qwen-MoE, OLMoE...) and ``ds_strategy.moe.MoE`` layers.

    >>> MoEConfig(ep_size=2).ep_size
    2
    """

    ep_size: int = leaf(
        int,
        1,
        ge=1,
        le=2**20,
        doc="Ranks each layer's experts are spread over: consecutive data-parallel ranks; it "
        "divides them and every layer's number of experts. Expert parameters are ZeRO-sharded "
        "over the ranks holding the same experts, the rest over all. 1 with ds_strategy.moe.MoE "
        "layers: their own ep_size.",
    )


class Layout(NamedTuple):
    """How a config lays a job out: its ZeRO stage, pipeline stages, and the tensor-,
    sequence- and context-parallel ranks (see :attr:`ZeroConfig.layout`)."""

    stage: int
    stages: int
    tp: int
    sp: int = 1
    cp: int = 1

    @property
    def ranks_per_batch(self) -> int:
        """Ranks that read the same batches: those splitting each layer and those splitting
        each sequence. The data-parallel ranks of a stage are its ranks over this."""
        return self.tp * self.sp * self.cp


@dataclass(frozen=True)
class ZeroConfig:
    """The whole configuration: top-level DeepSpeed keys plus one field per section.

    Build it with :func:`load_config` or :meth:`from_any`, which validate. From keywords, use
    :func:`zero_config`. Avoid the constructor. As in DeepSpeed, ``gradient_clipping`` <= 0
    means no clipping; a negative value is stored as 0.0. ``communication_data_type`` is
    case-insensitive, as in DeepSpeed. Values may be ``"auto"`` until :meth:`resolve` fills
    them in. It also settles the batch sizes for a data-parallel world size.

    >>> cfg = ZeroConfig.from_any({"zero_optimization": {"stage": 3},
    ...                            "train_micro_batch_size_per_gpu": 4})
    >>> cfg.zero_optimization.stage
    3
    >>> cfg.resolve(world_size=2).train_batch_size
    8
    """

    train_batch_size: int | None = leaf(
        int,
        None,
        ge=1,
        le=2**40,
        doc="Samples per optimizer step over all data-parallel ranks: micro-batch x "
        "accumulation steps x ranks; None: derived from the other two when the config is "
        "resolved.",
    )
    train_micro_batch_size_per_gpu: int | None = leaf(
        int,
        None,
        ge=1,
        le=2**31,
        doc="Samples each rank feeds to one forward and backward; None: derived from "
        "train_batch_size and gradient_accumulation_steps when the config is resolved.",
    )
    gradient_accumulation_steps: int | None = leaf(
        int,
        None,
        ge=1,
        le=2**31,
        doc="Micro-batches per optimizer step (a pipeline's micro-batches per train_batch); "
        "None: derived from the batch sizes, 1 when only one of them is given.",
    )
    gradient_clipping: float = leaf(
        float,
        0.0,
        normalize=_negative_means_off,
        doc="Scale the gradients so that their global L2 norm (over all ranks) is at most this "
        "before each step; <= 0: no clipping (a negative value is stored as 0.0).",
    )
    steps_per_print: int | None = leaf(
        int,
        None,
        ge=1,
        doc="Every this many optimizer steps rank 0 prints DeepSpeed's progress line (step, "
        "skipped steps, lr, momentum), the monitors write the training events, and "
        "wall_clock_breakdown and the memory timeline report; None (DeepSpeed's default): no "
        "progress line, and the others every 10 steps.",
    )
    max_consecutive_skipped_steps: int = leaf(
        int,
        20,
        ge=1,
        doc="ds_strategy's key: without fp16 loss scaling a non-finite gradient norm skips the "
        "step, and this many skips in a row are an error (fp16 stops at fp16.min_loss_scale "
        "instead).",
    )
    wall_clock_breakdown: bool = leaf(
        bool,
        False,
        doc="Time forward, backward, gradient reductions, gathers and the step, and count bytes "
        "per collective; every steps_per_print steps the per-step means go to the log (rank 0), "
        "the monitors, the front end's loggers and engine.timing_report().",
    )
    gradient_predivide_factor: float = leaf(
        float,
        1.0,
        gt=0.0,
        doc="Divide gradients by this before the reduction and by ranks / this after it "
        "(together: the mean over ranks), against fp16 overflow in the sum; unused with "
        "prescale_gradients.",
    )
    prescale_gradients: bool = leaf(
        bool,
        False,
        doc="Divide gradients by the number of data-parallel ranks before the reduction "
        "instead of after it.",
    )
    communication_data_type: CommDataType | None = leaf(
        CommDataType,
        None,
        normalize=str.lower,
        doc="The dtype gradients are reduced in ('fp32', 'fp16' or 'bf16', case-insensitive); "
        "None: the parameters' dtype, as in DeepSpeed.",
    )
    sequence_parallel_size: int = leaf(
        int,
        1,
        ge=1,
        le=2**20,
        doc="Ranks each sequence is split across with Ulysses: every rank of the group gets "
        "the same batch and keeps its block of tokens, attention exchanges heads for tokens "
        "by all-to-all; the model's head counts must divide by it. ZeRO shards over these "
        "ranks too.",
    )
    seq_parallel_communication_data_type: CommDataType | None = leaf(
        CommDataType,
        None,
        normalize=str.lower,
        aliases=("seq_parallel_comm_data_type",),
        doc="The dtype of the Ulysses all-to-all ('fp32', 'fp16' or 'bf16'); None: the "
        "activations' dtype.",
    )
    context_parallel_size: int = leaf(
        int,
        1,
        ge=1,
        le=2**20,
        doc="ds_strategy's key: ranks each sequence is split across with ring attention "
        "(causal or full), for models whose head count limits sequence_parallel_size; "
        "combines with it (context_parallel_size x sequence_parallel_size ranks per "
        "sequence).",
    )
    seed: int | None = leaf(
        int,
        None,
        doc="Accepted and kept in the config, but the engine seeds nothing from it (DeepSpeed "
        "has no such key); seed the job yourself (torch.manual_seed, Lightning's "
        "seed_everything).",
    )
    zero_optimization: ZeroOptimizationConfig = section(
        ZeroOptimizationConfig,
        doc="ZeRO: the stage, its buckets, stage-3 prefetching, ZeRO++ / MiCS and the offload "
        "tiers.",
    )
    fp16: FP16Config = section(FP16Config, doc="fp16 mixed precision with loss scaling.")
    bf16: BF16Config = section(
        BF16Config,
        aliases=("bfloat16",),
        doc="bf16 mixed precision (also read under DeepSpeed's old name bfloat16).",
    )
    pipeline: PipelineConfig = section(
        PipelineConfig,
        doc="Pipeline parallelism: an nn.Sequential split into stages, each data-parallel.",
    )
    tensor_parallel: TensorParallelConfig = section(
        TensorParallelConfig,
        doc="Tensor parallelism: layers' weights split across ranks with torch's DTensor.",
    )
    activation_checkpointing: ActivationCheckpointingConfig = section(
        ActivationCheckpointingConfig,
        doc="Recompute chosen modules' activations in backward instead of keeping them.",
    )
    tiling: TilingConfig = section(
        TilingConfig,
        doc="ds_strategy's section: the loss and the MLPs computed over tiles of tokens, for "
        "long sequences.",
    )
    moe: MoEConfig = section(
        MoEConfig,
        doc="ds_strategy's section: expert parallelism for mixture-of-experts models.",
    )
    gradient_compression: GradientCompressionConfig = section(
        GradientCompressionConfig,
        doc="ds_strategy's section: top-k gradient compression with error feedback.",
    )
    quantization: QuantizationConfig = section(
        QuantizationConfig,
        doc="ds_strategy's section: weight-only integer quantization, for inference or "
        "quantization-aware training.",
    )
    topology: TopologyConfig = section(
        TopologyConfig,
        doc="ds_strategy's section: ranks per machine and two-level collectives.",
    )
    compile: CompileConfig = section(
        CompileConfig, doc="torch.compile of the model, one unit at a time."
    )
    optimizer: OptimizerConfig | None = field(
        default=None,
        metadata={
            "doc": "The optimizer the engine builds when none is passed to it; None: the "
            "caller passes one."
        },
    )
    scheduler: SchedulerConfig | None = field(
        default=None,
        metadata={
            "doc": "The lr schedule the engine builds and steps after every optimizer step (an "
            "lr_scheduler passed as well is an error); None: none, or the one passed."
        },
    )
    checkpoint: CheckpointConfig = section(
        CheckpointConfig,
        doc="Periodic checkpoints written by engine.step(), and save defaults.",
    )
    tensorboard: TensorBoardConfig = section(
        TensorBoardConfig, doc="The training events to TensorBoard (rank 0)."
    )
    csv_monitor: CSVMonitorConfig = section(
        CSVMonitorConfig, doc="The training events to CSV files (rank 0)."
    )
    wandb: WandbConfig = section(
        WandbConfig, doc="The training events to Weights & Biases (rank 0)."
    )
    comet: CometConfig = section(CometConfig, doc="The training events to Comet (rank 0).")
    flops_profiler: FlopsProfilerConfig = section(
        FlopsProfilerConfig,
        doc="DeepSpeed's flops profiler: FLOPs, latency, TFLOPS and MFU of one step.",
    )
    comms_logger: CommsLoggerConfig = section(
        CommsLoggerConfig,
        doc="Per-collective counts, sizes, times and bandwidths (DeepSpeed's comms logger).",
    )
    memory_timeline: MemoryTimelineConfig = section(
        MemoryTimelineConfig,
        doc="ds_strategy's section: every model-state allocation and free of the latest step.",
    )

    @classmethod
    def from_any(cls, source: Any = None, *, strict: bool | None = None) -> ZeroConfig:
        """Same as :func:`load_config`: a dict, a .json/.yaml path, an omegaconf node or a config.

        Args:
            source: what to load; ``None`` gives the defaults.
            strict: make every unknown key an error. ``None`` reads ``DS_STRATEGY_STRICT_CONFIG``.

        Returns:
            The validated config.

        >>> ZeroConfig.from_any({"bf16": {"enabled": True}}).bf16.enabled
        True
        """
        return _OPERATIONS["load"](source, stacklevel=3, strict=strict)

    def to_dict(self) -> dict[str, Any]:
        """A DeepSpeed-shaped nested dict that :func:`load_config` turns back into ``self``.

        >>> ZeroConfig().to_dict()["zero_optimization"]["stage"]
        0
        """
        return _OPERATIONS["to_dict"](self)

    @property
    def report_every(self) -> int:
        """How many optimizer steps apart the monitors and reports write.

        The reports are the breakdown and the memory timeline. It is ``steps_per_print``, or
        10 when the config does not give it.

        >>> (ZeroConfig().report_every, ZeroConfig.from_any({"steps_per_print": 5}).report_every)
        (10, 5)
        """
        return self.steps_per_print if self.steps_per_print is not None else 10

    @property
    def layout(self) -> Layout:
        """The ZeRO stage, pipeline stages and tensor-, sequence- and context-parallel ranks,
        read before resolving.

        They read as :meth:`resolve` settles them: an ``"auto"`` is the field's default, since
        no loop fact fills these. A loop needs them before the engine exists, to count its
        data-parallel ranks.

        >>> cfg = {"pipeline": {"stages": 2}, "tensor_parallel": {"tp_size": "auto"}}
        >>> ZeroConfig.from_any(cfg).layout
        Layout(stage=0, stages=2, tp=1, sp=1, cp=1)
        """
        read = (
            (self.zero_optimization, "stage"),
            (self.pipeline, "stages"),
            (self.tensor_parallel, "autotp_size"),
        )
        settled = []
        for section, key in read:
            value = getattr(section, key)
            if value == AUTO:  # the field's declared default, as resolve() fills it
                (f,) = [f for f in dataclasses.fields(section) if f.name == key]
                value = _field_default(f)
            settled.append(value)
        stage, stages, tp = settled
        return Layout(stage, stages, tp, self.sequence_parallel_size, self.context_parallel_size)

    def replace(self, **changes: Any) -> ZeroConfig:
        """A new, validated config with dotted keys changed; a mapping merges into a section.

        >>> cfg = ZeroConfig().replace(**{"zero_optimization.stage": 3, "fp16": {"enabled": True}})
        >>> (cfg.zero_optimization.stage, cfg.fp16.enabled, cfg.fp16.loss_scale_window)
        (3, True, 1000)
        """
        return _OPERATIONS["replace"](self, changes)

    def resolve(self, world_size: int, auto_values: Mapping[str, Any] | None = None) -> ZeroConfig:
        """Fill every ``"auto"`` and settle the batch sizes for ``world_size`` data-parallel ranks.

        Each ``"auto"`` takes ``auto_values[dotted_key]`` when given, else the field's default.
        An ``"auto"`` entry of ``optimizer.params`` / ``scheduler.params`` without a value is
        dropped, so the optimizer's own default applies. Then the batch sizes settle as in
        DeepSpeed. ``train_batch_size = train_micro_batch_size_per_gpu *
        gradient_accumulation_steps * world_size``: any two given determine the third. One
        batch size alone implies ``gradient_accumulation_steps = 1``.

        Args:
            world_size: the number of data-parallel ranks.
            auto_values: a value for each ``"auto"`` key, by dotted key.

        Returns:
            A new config with no ``"auto"`` left.

        Raises:
            ConfigError: the given batch sizes disagree or do not divide. The message shows the
                arithmetic.

        >>> cfg = ZeroConfig.from_any({"train_batch_size": 32, "gradient_clipping": "auto"})
        >>> r = cfg.resolve(4, {"gradient_clipping": 1.0})
        >>> (r.train_micro_batch_size_per_gpu, r.gradient_accumulation_steps, r.gradient_clipping)
        (8, 1, 1.0)
        """
        return _OPERATIONS["resolve"](self, world_size, auto_values)


# [Note: operations registered by the modules that implement them]
# Loading, replacing and resolving walk this schema, so their modules (_load.py, _resolve.py)
# import this one; ZeroConfig's methods reach them through this table, which those modules
# fill when imported (ds_strategy.config imports both), so no module imports back.
_OPERATIONS: dict[str, Callable[..., Any]] = {}


def register_operations(**operations: Callable[..., Any]) -> None:
    _OPERATIONS.update(operations)


def _ignored(reason: str, keys: str) -> dict[str, str]:
    return dict.fromkeys(keys.split(), reason)


UNSUPPORTED_KEYS: dict[str, dict[str, str]] = {
    # section path ("" = top level) -> {DeepSpeed key: why it is ignored / what to use instead}.
    # Names taken from DeepSpeed's runtime/config.py, runtime/constants.py, runtime/zero/config.py,
    # runtime/zero/offload_config.py, runtime/precision_config.py and monitor/config.py.
    # A key listed here warns (UnsupportedConfigWarning) and is skipped with its whole value; a
    # key in neither the schema nor this table is unknown: an error when it is close to a known
    # key (a typo) or when loading strictly, else a warning (UnknownConfigKeyWarning), ignored.
    # Listing DeepSpeed's keys here keeps them from being taken for typos of ours.
    # Remove an entry once it is built.
    "": {
        **_ignored(
            "monitoring is left to the training framework's loggers",
            "trackio timers memory_breakdown dump_state",
        ),
        **_ignored(
            "not implemented yet",
            "data_types autotuning elasticity",
        ),
        **_ignored(
            "a DeepSpeed runtime setting with no equivalent here",
            "eigenvalue log_level managed_gradient_accumulation datastates_ckpt",
        ),
        "allgather_size": "the bucket size of the deprecated boolean zero_optimization; "
        "updated parameters are gathered per flat group here",
        **_ignored(
            "DeepSpeed does not read it either (the name of one of its config objects, which "
            "some projects write as a key)",
            "comms_config monitor_config",
        ),
        **_ignored(
            "a DeepSpeed-specific feature with no equivalent here",
            "data_efficiency curriculum_learning compression_training quantize_training "
            "sparse_attention progressive_layer_drop hybrid_engine weight_quantization "
            "expert_parallel use_data_before_expert_parallelism "
            "graph_harvesting nebula vocabulary_size dataloader_drop_last sparse_gradients",
        ),
        **_ignored("use fp16 or bf16 instead", "amp torch_autocast"),
        "aio": "DeepSpeed's native async-I/O library is not used",
        "zero_allow_untested_optimizer": "any torch.optim optimizer is accepted already",
        "zero_force_ds_cpu_optimizer": "offloaded steps run the given torch optimizer on CPU",
        "disable_allgather": "stages 1-2 always all-gather the updated parameters",
        "gradient_allreduce_op": "gradients are always averaged (mean)",
    },
    "zero_optimization": {
        **_ignored(
            "a ZeRO-Infinity / ZeRO++ / MiCS tuning knob not implemented here",
            "round_robin_gradients "
            "zero_quantized_nontrainable_weights "
            "zeropp_loco_param "
            "mics_hierarchical_params_gather zenflow use_multi_rank_bucket_allreduce "
            "stage3_model_persistence_threshold model_persistence_threshold "
            "stage3_module_granularity_threshold module_granularity_threshold "
            "stage3_use_all_reduce_for_fetch_params use_all_reduce_for_fetch_params "
            "stage3_allgather_sequential allgather_sequential "
            "stage3_partition_stream_chunk_size partition_stream_chunk_size",
        ),
        **_ignored(
            "use engine.full_state_dict() to gather the full weights",
            "stage3_gather_16bit_weights_on_model_save gather_16bit_weights_on_model_save "
            "stage3_gather_fp16_weights_on_model_save",
        ),
        **_ignored(
            "checkpoints always keep the fp32 master weights and reshard on load",
            "load_from_fp32_weights elastic_checkpoint pipeline_loading_checkpoint",
        ),
        **_ignored(
            "a DeepSpeed implementation detail with no equivalent here",
            "ignore_unused_parameters memory_efficient_linear override_module_apply "
            "log_trace_cache_warnings enable_sanity_checks leaf_module legacy_stage1 "
            "save_muon_momentum_buffer_in_memory",
        ),
        # cpu_offload / cpu_offload_param are read with DeepSpeed's meaning (see _load.py)
        "cpu_offload_use_pin_memory": "deprecated in DeepSpeed, which ignores it too; use "
        "offload_optimizer.pin_memory / offload_param.pin_memory",
    },
    "zero_optimization.offload_optimizer": _ignored(
        "a DeepSpeed CPU-Adam / NVMe pipelining option not implemented here",
        "pipeline_read pipeline_write super_offload convert_grad_on_cpu cpuadam_cores_perc",
    ),
    "fp16": {"fused_mode": "there is no fused fp16 optimizer here"},
    "bf16": {"check_grad_overflow": "bf16 has fp32's range; no overflow check is done"},
    "optimizer": {"legacy_fusion": "there are no fused DeepSpeed optimizers here"},
    "tensor_parallel": _ignored(
        "DeepSpeed's AutoTP options; layers are split here by torch's DTensor tensor "
        "parallelism (autotp_size, plan)",
        "dtype tp_overlap_comm tensor_parallel injection_policy_tuple keep_module_on_host "
        "tp_grain_size partition_config",
    ),
    "compile": _ignored(
        "DeepCompile's options; units are compiled with torch.compile (enabled, backend, kwargs)",
        "deepcompile free_activation free_activation_threshold offload_activation "
        "offload_opt_states double_buffer symmetric_memory dump_graphs debug_log "
        "offload_parameters sync_before_reduce sync_after_reduce sync_before_allgather "
        "sync_after_allgather keep_int_input_tensors keep_all_input_tensors disable",
    ),
    "pipeline": {
        **_ignored(
            "DeepSpeed's PipelineEngine options; stages are placed and sent here by "
            "torch.distributed.pipelining",
            "seed_layers pipe_partitioned grad_partitioned use_reentrant",
        ),
        "partition": "DeepSpeed does not read it either; use partition_method",
        "activation_checkpoint_interval": "use the activation_checkpointing section",
    },
    "checkpoint": {
        "tag_validation": "tags are not compared across ranks; every rank gets the same tag",
        "load_universal": "every checkpoint reshards on load; there is no universal format",
        "use_node_local_storage": "every rank writes to the shared save directory",
        "parallel_write": "every rank always writes its own shards in parallel",
        **_ignored(
            "checkpoints are written with torch.distributed.checkpoint",
            "checkpoint_serialization writer",
        ),
    },
}
"""DeepSpeed keys known but not implemented, per section; loading one warns and ignores it."""


# ----------------------------------------------------------------------------- the key reference


@dataclass(frozen=True)
class KeyDoc:
    """One config key as the reference documents it (see :func:`config_keys`).

    Attributes:
        path: the dotted key, as DeepSpeed spells it (``"zero_optimization.offload_param.device"``).
        aliases: the other dotted spellings the loader accepts for it (``"bfloat16.enabled"``).
        type: the value's type once read: ``"int"``, ``"float"``, ``"bool"``, ``"str"`` (a
            choice's too), ``" | None"`` added where null is accepted, ``"dict"`` or
            ``"list[str]"``.
        default: the default as a DeepSpeed JSON writes it (a choice as its string, null as
            None, ``{}``); ``"MISSING"`` for a key its section requires.
        choices: the allowed values, or None where any value of the type is.
        bounds: the numeric bounds, readable (``">= 0, <= 1024"``), or ``""``.
        doc: what the key does in this engine.
        section_doc: the first paragraph of the enclosing section's docstring.
    """

    path: str
    aliases: tuple[str, ...]
    type: str
    default: Any
    choices: tuple[Any, ...] | None
    bounds: str
    doc: str
    section_doc: str


def config_keys() -> list[KeyDoc]:
    """Every key of the schema (the leaves, free mappings and lists, not the sections), walking
    :class:`ZeroConfig`'s sections recursively in declaration order: what the docs site's
    reference of configuration keys is generated from.

    >>> keys = {k.path: k for k in config_keys()}
    >>> keys["zero_optimization.stage"].choices
    (0, 1, 2, 3)
    >>> keys["zero_optimization.offload_optimizer.buffer_count"].default  # its section's default
    4
    >>> keys["bf16.enabled"].aliases
    ('bfloat16.enabled',)
    >>> keys["optimizer.type"].default
    'MISSING'
    """
    return list(_key_docs(ZeroConfig, ZeroConfig(), ("",)))


def _key_docs(cls: type, defaults: Any, prefixes: tuple[str, ...]) -> Iterator[KeyDoc]:
    """The keys of section ``cls``; ``defaults``: its default instance (None for a section that
    is absent by default, whose fields' own defaults then apply); ``prefixes``: the section's
    dotted spellings, DeepSpeed's first."""
    hints = typing.get_type_hints(cls)
    section_doc = _first_paragraph(cls.__doc__ or "")
    for f in dataclasses.fields(cls):
        names = (f.name, *f.metadata.get("aliases", ()))
        paths = tuple(f"{p}.{n}" if p else n for p in prefixes for n in names)
        value = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        nested = _section_of(hints[f.name])
        if nested is not None and "leaf" not in f.metadata:
            yield from _key_docs(nested, value, paths)
            continue
        spec: LeafSpec | None = f.metadata.get("leaf")
        yield KeyDoc(
            path=paths[0],
            aliases=paths[1:],
            type=_type_name(spec, hints[f.name], nullable=f.default is None),
            default=_as_json(value),
            choices=spec.choices if spec is not None else None,
            bounds=_bounds(spec) if spec is not None else "",
            doc=f.metadata.get("doc", ""),
            section_doc=section_doc,
        )


def _section_of(hint: Any) -> type | None:
    """The section dataclass a field's annotation names (``X`` or ``X | None``), else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def _type_name(spec: LeafSpec | None, hint: Any, *, nullable: bool) -> str:
    if spec is None:  # a free mapping or a list of names
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is list and args and isinstance(args[0], type):
            return f"list[{args[0].__name__}]"
        return getattr(origin, "__name__", str(hint))
    name = "str" if issubclass(spec.kind, Choice) else spec.kind.__name__
    return f"{name} | None" if nullable else name


def _as_json(value: Any) -> Any:
    if value is MISSING:
        return "MISSING"
    if isinstance(value, Choice):
        return value.value
    return value


def _bounds(spec: LeafSpec) -> str:
    parts = [
        f"{op} {_number(bound)}"
        for op, bound in ((">=", spec.ge), (">", spec.gt), ("<=", spec.le))
        if bound is not None
    ]
    return ", ".join(parts)


def _number(x: float) -> str:
    """A bound as written: a large power of two as ``2**n``, else as Python writes it."""
    if float(x).is_integer() and x >= 2**20 and int(x) & (int(x) - 1) == 0:
        return f"2**{int(x).bit_length() - 1}"
    return repr(x)


def _first_paragraph(doc: str) -> str:
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
