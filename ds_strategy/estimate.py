"""Per-rank memory of every ZeRO stage, offload tier and precision, before buying the GPUs.

[Note: the model of memory]
Model state follows the ZeRO paper. Per trainable parameter a rank needs ``P`` bytes of
parameter, ``G`` of gradient and ``K`` of optimizer state (Adam: two moments, plus an fp32
master copy under mixed precision)::

    fp32              P=4 G=4 K=8
    bf16/fp16 mixed   P=2 G=2 K=12

and below 16 bytes (``PRECISIONS``): bf16 optimizer states K=8, bf16 masters and states
K=4, torchao's 8-bit AdamW K=2.03 (fp32) or 6.03 (bf16 with its fp32 master), 4-bit K=1.06
or 5.06, Muon K=4 (fp32) or 8 (bf16), counting every parameter as a matrix.

Stage 1 shards ``K`` over the N data-parallel ranks, stage 2 also ``G``, stage 3 also ``P``
(parameters of at most ``stage3_param_persistence_threshold`` elements stay whole on every rank,
sharded like stage 2). Offload moves a term off the accelerator: ``cpu`` the optimizer term
``K`` (to host memory), ``cpu+params`` also the stage-3 parameter shards, ``nvme`` both to
NVMe (with host staging buffers not counted). Stage 3 also holds the parameters it has
gathered: the root unit (gathered for the whole forward), the block computing and the
blocks prefetched (``stage3_prefetch_bucket_size`` elements, which the last block prefetched
may overshoot, within ``stage3_max_live_parameters``), and the last blocks of forward kept
gathered into backward (``stage3_max_reuse_distance``: half of it, plus a block, within the
room ``stage3_max_live_parameters`` leaves beside the rest); an upper bound, from the model's
units when it is known. ZeRO++'s hpZ (``hpz_partition_size`` P, between 1 and N) adds, from
a forward to the optimizer step, a secondary copy of the sharded parameters over P ranks:
``P`` bytes x sharded / P (``hpz_secondary``, counted on the device, not in model state at
rest). MiCS (``mics_shard_size`` S, dividing N) shards over groups of S ranks and
replicates across them: every ``/ N`` above becomes ``/ S`` at stages 1-3. Activations are the user's to give (``activation_bytes``): they depend on batch,
sequence length and activation checkpointing, not on the stage; for a transformers decoder
``activation_bytes`` counts them from its sizes (see [Note: activations of a decoder]).

[Note: "cheapest"]
Candidates are ranked by what they cost in speed, cheapest first: stage 0 (plain data
parallel), 1, 2 (same bytes moved as DDP), CPU optimizer offload at stages 1-2 (host memory
traffic and a CPU optimizer step), stage 3 (1.5x the bytes), stage 3 with CPU offload of the
optimizer, then of the parameters, then NVMe. The recommendation is the first that fits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from .config.loop import model_hidden_size
from .core.model_factory import build_with, import_factory, meta_device

__all__ = [
    "Estimate",
    "ModelFacts",
    "estimate",
    "estimate_all",
    "model_facts",
    "parse_bytes",
    "parse_count",
    "pipeline_facts",
    "recommend",
    "format_table",
    "format_peaks",
    "Knobs",
    "Peak",
    "TransformerShape",
    "activation_bytes",
    "step_peak",
]

# bytes per parameter: (P, G, K) with Adam. Below 16 bytes (docs: "Below sixteen bytes a
# parameter"): bf16 optimizer states (K = fp32 master + 2 x 2), bf16 masters and states
# (K = 2 x 2), torchao's 8-bit / 4-bit AdamW (each moment 1 or 0.5 byte + an fp32 scale per
# block of 256 or 128 elements).
_BIT8, _BIT4 = 2 * (1 + 4 / 256), 2 * (0.5 + 4 / 128)
PRECISIONS: dict[str, tuple[float, float, float]] = {
    "fp32": (4, 4, 8),
    "bf16": (2, 2, 12),
    "fp16": (2, 2, 12),
    "bf16-states": (2, 2, 4 + 4),
    "bf16-low": (2, 2, 4),
    "fp32-8bit": (4, 4, _BIT8),
    "bf16-8bit": (2, 2, 4 + _BIT8),
    "fp32-4bit": (4, 4, _BIT4),
    "bf16-4bit": (2, 2, 4 + _BIT4),
    # Muon: one momentum a matrix element (every parameter counted as a matrix; vectors and
    # norms, AdamW's two moments, are a small share of a transformer)
    "fp32-muon": (4, 4, 4),
    "bf16-muon": (2, 2, 4 + 4),
}
_BF16 = {"enabled": True}
# the config keys each precision stands for (config_of)
PRECISION_KEYS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16": _BF16},
    "fp16": {"fp16": _BF16},
    "bf16-states": {"bf16": {**_BF16, "bf16_optimizer_states": True}},
    "bf16-low": {
        "bf16": {**_BF16, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    },
    "fp32-8bit": {"optimizer": {"type": "AdamW8bit"}},
    "bf16-8bit": {"bf16": _BF16, "optimizer": {"type": "AdamW8bit"}},
    "fp32-4bit": {"optimizer": {"type": "AdamW4bit"}},
    "bf16-4bit": {"bf16": _BF16, "optimizer": {"type": "AdamW4bit"}},
    "fp32-muon": {"optimizer": {"type": "Muon"}},
    "bf16-muon": {"bf16": _BF16, "optimizer": {"type": "Muon"}},
}
# the rounded step's fp32 working copies: one chunk of at most 2**20 elements x 16 bytes
_ROUNDED_CHUNK_BYTES = 16 * 2**20
OFFLOADS = ("none", "cpu", "cpu+params", "nvme")
# (stage, offload) in the order of their cost in speed; see the note on "cheapest".
CANDIDATES: tuple[tuple[int, str], ...] = (
    (0, "none"),
    (1, "none"),
    (2, "none"),
    (1, "cpu"),
    (2, "cpu"),
    (3, "none"),
    (3, "cpu"),
    (3, "cpu+params"),
    (3, "nvme"),
)
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold
DEFAULT_PREFETCH = 50_000_000  # stage3_prefetch_bucket_size
DEFAULT_MAX_LIVE = 1_000_000_000  # stage3_max_live_parameters
DEFAULT_MAX_REUSE = 1_000_000_000  # stage3_max_reuse_distance


def config_name(stage: int, offload: str) -> str:
    """``(3, "cpu")`` -> ``"zero3+cpu"``; ``(2, "none")`` -> ``"zero2"``."""
    return f"zero{stage}" + ("" if offload == "none" else f"+{offload}")


@dataclass(frozen=True)
class TransformerShape:
    """The sizes that set a decoder's activation memory, as a transformers config names them
    (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``vocab_size``); ``kv_dim`` is key-value heads x head size."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_dim: int
    vocab: int

    @classmethod
    def of(cls, model: Any) -> TransformerShape | None:
        """Read from ``model.config``; None when it lacks one of the sizes."""
        c: Any = getattr(model, "config", None)
        try:
            hidden, heads = int(c.hidden_size), int(c.num_attention_heads)
            sizes = int(c.intermediate_size), int(c.num_hidden_layers), int(c.vocab_size)
        except (AttributeError, TypeError, ValueError):
            return None
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        return cls(hidden, sizes[0], sizes[1], heads, int(kv_heads) * int(head_dim), sizes[2])


# [Note: activations of a decoder]
# What autograd keeps from the forward to the backward of a Llama-style decoder (RMSNorm,
# rotary positions, fused attention, SwiGLU MLP), per token, read off the saved tensors of
# transformers' Llama (``SavedTensorMeter``) and checked against it in tests/test_estimate.py:
# each layer 8 hidden + 2 key-value + 4 intermediate values in the activations' dtype, and one
# fp32 value a head (attention's log-sum-exp); outside the layers 4 hidden values, and the
# log-softmax of the logits in fp32 (a vocabulary's worth). A rank of a sequence split over S
# ranks holds 1/S of the tokens. Activation checkpointing keeps each layer's input and
# recomputes one layer at a time; tiling keeps no MLP intermediates and no logits but one
# tile's (the logits' three times over in its backward: values, log-softmax, gradient).
def activation_bytes(
    shape: TransformerShape,
    tokens: int,
    *,
    sequence_ranks: int = 1,
    dtype_bytes: int = 2,
    checkpointing: bool = False,
    tiled: bool = False,
    tile_tokens: int = 4096,
) -> float:
    """Bytes of activations one rank holds at the end of a forward (see
    [Note: activations of a decoder]).

    Args:
        shape: the decoder's sizes.
        tokens: tokens of a micro-batch (sequences x length).
        sequence_ranks: ranks each sequence is split over (sequence x context parallel).
        dtype_bytes: bytes of an activation (2 under bf16/fp16, 4 in fp32).
        checkpointing: activation checkpointing of every layer.
        tiled: the loss and the MLPs over tiles (the config's ``tiling``).
        tile_tokens: tokens a tile.

    >>> llama = TransformerShape(4096, 14336, 32, 32, 1024, 128256)
    >>> round(activation_bytes(llama, 8192) / 2**30, 1)  # Llama 3 8B, bf16, GiB
    49.2
    >>> round(activation_bytes(llama, 8192, sequence_ranks=8, tiled=True) / 2**30, 2)
    3.74
    """
    local = tokens / sequence_ranks
    h, b = shape.hidden, dtype_bytes
    mlp = 4 * shape.intermediate * b
    layer = (8 * h + 2 * shape.kv_dim) * b + 4 * shape.heads + (0 if tiled else mlp)
    logits = 4 * shape.vocab
    held = local * (4 * h * b + (0 if tiled else logits))
    if checkpointing:
        held += local * (shape.layers * h * b + layer)
    else:
        held += local * shape.layers * layer
    if tiled:
        held += min(tile_tokens, local) * (mlp + 3 * logits)
    return held


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs to know about a model (counts are elements, not bytes)."""

    params: int  # every parameter (a tied weight once)
    trainable: int | None = None  # with requires_grad; None = all
    persistent: int = 0  # stage-3 parameters within the persistence threshold (kept whole)
    largest_unit: int = 0  # elements of the largest stage-3 block unit (0 = unknown)
    root_unit: int = 0  # elements of the root unit (gathered for the whole forward)
    largest_param: int = 0  # elements of the largest trainable parameter (0 = unknown)
    hidden_size: int | None = None  # its config's (a Hugging Face model's), for "auto" buckets
    shape: TransformerShape | None = None  # its config's decoder sizes, for activations
    experts: int = 0  # elements of the mixture-of-experts layers' experts (core/moe)

    @property
    def n_trainable(self) -> int:
        return self.params if self.trainable is None else self.trainable


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank holds for one (stage, offload, precision)."""

    stage: int
    offload: str
    precision: str
    device: dict[str, float] = field(default_factory=dict)  # params/grads/optimizer/gathered/act
    cpu: float = 0.0
    nvme: float = 0.0
    experts: float = 0.0  # the experts' part of model_state (the rest is the dense layers')

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def model_state(self) -> float:
        """Parameters + gradients + optimizer state wherever they live (what
        ``engine.memory_report()['total']`` counts)."""
        d = self.device
        return d["params"] + d["grads"] + d["optimizer"] + self.cpu + self.nvme

    @property
    def name(self) -> str:
        return config_name(self.stage, self.offload)


def _check_arguments(
    world_size: int,
    stage: int,
    offload: str,
    precision: str,
    hpz_partition_size: int,
    mics_shard_size: int,
) -> None:
    """:func:`estimate`'s arguments, or an error naming the one that is off."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if (stage, offload) not in CANDIDATES:
        raise ValueError(
            f"offload {offload!r} is not available at stage {stage}: optimizer offload needs "
            "stage 1-3, parameter and NVMe offload need stage 3"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if hpz_partition_size < 1 or world_size % hpz_partition_size:
        raise ValueError(
            f"hpz_partition_size={hpz_partition_size} must divide the world size {world_size}"
        )
    if mics_shard_size > 0 and world_size % mics_shard_size:
        raise ValueError(
            f"mics_shard_size={mics_shard_size} must divide the world size {world_size}"
        )
    if mics_shard_size > 0 and hpz_partition_size > 1:
        raise ValueError("mics_shard_size and hpz_partition_size: give one of them")


def estimate(
    facts: ModelFacts,
    world_size: int,
    stage: int,
    offload: str = "none",
    precision: str = "bf16",
    activation_bytes: float = 0.0,
    *,
    prefetch_numel: float = DEFAULT_PREFETCH,
    max_live_numel: float = DEFAULT_MAX_LIVE,
    max_reuse_numel: float = DEFAULT_MAX_REUSE,
    hpz_partition_size: int = 1,
    mics_shard_size: int = -1,
    ep_size: int = 1,
) -> Estimate:
    """Per-rank bytes for one configuration (see the note at the top of this module).

    With ``ep_size`` ranks sharing each layer's experts, a rank holds ``1/ep_size`` of the
    expert elements, sharded over the ``world_size / ep_size`` ranks holding the same ones.

    >>> e = estimate(ModelFacts(params=1000), world_size=4, stage=3, precision="fp32")
    >>> e.model_state  # 16 * 1000 / 4
    4000.0
    >>> estimate(ModelFacts(params=1000), 4, 3, precision="fp32",
    ...          hpz_partition_size=2).device["hpz_secondary"]  # 4 * 1000 / 2
    2000.0
    >>> estimate(ModelFacts(params=1000), 4, 3, precision="fp32",
    ...          mics_shard_size=2).model_state  # 16 * 1000 / 2
    8000.0
    >>> e = estimate(ModelFacts(params=1000, experts=800), 4, 3, precision="fp32", ep_size=2)
    >>> e.model_state, e.experts  # 16 * 200 / 4 dense + 16 * (800 / 2) / 2 experts
    (4000.0, 3200.0)
    """
    _check_arguments(world_size, stage, offload, precision, hpz_partition_size, mics_shard_size)
    if ep_size < 1 or world_size % ep_size or (ep_size > 1 and mics_shard_size > 0):
        raise ValueError(
            f"ep_size={ep_size} must divide the world size {world_size} (and go without MiCS)"
        )
    if facts.experts:  # the dense layers, then the experts over their own ranks
        dense = replace(
            facts,
            params=facts.params - facts.experts,
            trainable=facts.n_trainable - facts.experts,
            experts=0,
        )
        d = estimate(
            dense,
            world_size,
            stage,
            offload,
            precision,
            activation_bytes,
            prefetch_numel=prefetch_numel,
            max_live_numel=max_live_numel,
            max_reuse_numel=max_reuse_numel,
            hpz_partition_size=hpz_partition_size,
        )
        return _with_experts(d, facts.experts // ep_size, world_size // ep_size)
    p, g, k = PRECISIONS[precision]
    n = mics_shard_size if mics_shard_size > 0 and stage >= 1 else world_size
    psi, train = facts.params, facts.n_trainable
    persistent = facts.persistent if stage == 3 else 0
    sharded = psi - persistent
    params = {
        0: p * psi,
        1: p * psi,
        2: p * psi,
        3: p * (sharded / n + persistent),
    }[stage]
    grads = g * train / n if stage >= 2 else g * train
    optimizer = k * train / n if stage >= 1 else k * train
    live = _live_numel(facts, prefetch_numel, max_live_numel, max_reuse_numel)
    gathered = p * min(live, sharded) if stage == 3 else 0.0
    cpu = nvme = 0.0
    if offload == "cpu":
        cpu, optimizer = optimizer, 0.0
    elif offload in ("cpu+params", "nvme"):
        moved_params = p * sharded / n
        off = optimizer + moved_params
        optimizer, params = 0.0, params - moved_params
        if offload == "nvme":
            nvme = off
        else:
            cpu = off
    device = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "gathered": gathered,
        "activations": float(activation_bytes),
    }
    if stage == 3 and 1 < hpz_partition_size < n:
        device["hpz_secondary"] = p * sharded / hpz_partition_size
    return Estimate(stage, offload, precision, device, cpu, nvme)


def _live_numel(facts: ModelFacts, prefetch: float, max_live: float, max_reuse: float) -> float:
    """Stage 3's gathered elements at most: the root and the block computing, the blocks
    prefetched (up to the prefetch budget, which the last block may overshoot, and no further
    than the live-parameter bound), and the last blocks kept from forward into backward
    (``core/zero/stage3.py``, [Note: reuse distance])."""
    prefetched = min(prefetch + facts.largest_unit, max_live)
    room = max_live - facts.root_unit - prefetch - facts.largest_unit
    kept = max(0.0, min(room, max_reuse / 2 + facts.largest_unit))
    return facts.root_unit + facts.largest_unit + prefetched + kept


def _with_experts(dense: Estimate, share: int, ranks: int) -> Estimate:
    """``dense`` plus a rank's ``share`` of expert elements, sharded over ``ranks``."""
    x = estimate(ModelFacts(params=share), ranks, dense.stage, dense.offload, dense.precision)
    device = {key: v + x.device.get(key, 0.0) for key, v in dense.device.items()}
    device["gathered"] = dense.device["gathered"]  # one unit at a time, counted whole
    return replace(
        dense, device=device, cpu=dense.cpu + x.cpu, nvme=dense.nvme + x.nvme, experts=x.model_state
    )


def estimate_all(
    facts: ModelFacts,
    world_size: int,
    precisions: tuple[str, ...] = ("fp32", "bf16", "fp16"),
    activation_bytes: float = 0.0,
    hpz_partition_size: int = 1,
    mics_shard_size: int = -1,
    ep_size: int = 1,
) -> list[Estimate]:
    """Every (stage, offload) candidate for each precision, cheapest first."""
    return [
        estimate(
            facts,
            world_size,
            s,
            o,
            prec,
            activation_bytes,
            hpz_partition_size=hpz_partition_size,
            mics_shard_size=mics_shard_size,
            ep_size=ep_size,
        )
        for prec in precisions
        for s, o in CANDIDATES
    ]


def fits(e: Estimate, gpu_mem: float, cpu_mem: float | None, ranks_per_node: int) -> bool:
    """Whether ``e`` fits ``gpu_mem`` bytes per accelerator and, when given, ``cpu_mem``
    bytes of host memory shared by ``ranks_per_node`` ranks. NVMe offload does not take the
    states below 16 bytes (the config's rules refuse it), so they never fit there."""
    if e.offload == "nvme" and e.precision not in ("fp32", "bf16", "fp16"):
        return False
    if e.device_total > gpu_mem:
        return False
    return cpu_mem is None or e.cpu * ranks_per_node <= cpu_mem


def recommend(
    estimates: list[Estimate],
    gpu_mem: float,
    cpu_mem: float | None = None,
    ranks_per_node: int = 1,
    precision: str | None = None,
) -> Estimate | None:
    """The cheapest estimate (in :data:`CANDIDATES` order) that fits, or None."""
    order = {c: i for i, c in enumerate(CANDIDATES)}
    pool = [e for e in estimates if precision is None or e.precision == precision]
    pool.sort(key=lambda e: order[(e.stage, e.offload)])
    return next((e for e in pool if fits(e, gpu_mem, cpu_mem, ranks_per_node)), None)


def config_of(e: Estimate) -> dict[str, Any]:
    """The config keys that select ``e``'s stage, offload and precision."""
    zo: dict[str, Any] = {"stage": e.stage}
    if e.offload != "none":
        device = "nvme" if e.offload == "nvme" else "cpu"
        zo["offload_optimizer"] = {"device": device}
        if e.offload in ("cpu+params", "nvme"):
            zo["offload_param"] = {"device": device}
    out: dict[str, Any] = {"zero_optimization": zo}
    out.update(PRECISION_KEYS[e.precision])
    return out


# -- the peak of a step, tier by tier ----------------------------------------------------------

PHASES = ("forward", "backward", "step")


@dataclass(frozen=True)
class Knobs:
    """The config values that size the buffers of a step (DeepSpeed's defaults).

    ``reduce_scratch``: the reduce-scatter needs a receive buffer as large as its input (gloo,
    which CPU ranks use; see ``group_numel`` in ``core/zero/builders.py``), unless
    ``shared_memory``: CPU ranks of one machine reduce through shared memory
    (``topology.shared_memory``, ``core/shm.py``) and need none, their groups still half a
    bucket. ``cpu_only``: the ranks compute on CPUs, so "device" memory is host memory and
    gradient shards of an NVMe-offloaded optimizer live in files between steps."""

    reduce_bucket_numel: float = 500_000_000  # zero_optimization.reduce_bucket_size
    prefetch_numel: float = DEFAULT_PREFETCH
    max_live_numel: float = DEFAULT_MAX_LIVE
    max_reuse_numel: float = DEFAULT_MAX_REUSE
    buffer_numel: float = 100_000_000  # offload_optimizer.buffer_size
    buffer_count: int = 4  # offload_optimizer.buffer_count
    reduce_scratch: bool = False
    shared_memory: bool = False
    cpu_only: bool = False

    @classmethod
    def from_config(cls, config: Any, cpu_only: bool = False) -> Knobs:
        """The knobs of a loaded config (``ds_strategy.config.load_config``)."""
        zc = config.zero_optimization
        oo = zc.offload_optimizer
        return cls(
            reduce_bucket_numel=float(zc.reduce_bucket_size),
            prefetch_numel=float(zc.stage3_prefetch_bucket_size),
            max_live_numel=float(zc.stage3_max_live_parameters),
            max_reuse_numel=float(zc.stage3_max_reuse_distance),
            buffer_numel=float(oo.buffer_size) if oo is not None else 100_000_000,
            buffer_count=int(oo.buffer_count) if oo is not None else 4,
            reduce_scratch=cpu_only,
            shared_memory=cpu_only and bool(config.topology.shared_memory),
            cpu_only=cpu_only,
        )


@dataclass(frozen=True)
class Term:
    """``nbytes`` in ``tier`` for the whole step (``phase`` None) or during one phase."""

    name: str
    tier: str
    nbytes: float
    phase: str | None = None


@dataclass(frozen=True)
class Peak:
    """Every buffer of one configuration's training step on one rank, tier by tier; see the
    note on the peak of a step."""

    stage: int
    offload: str
    precision: str
    terms: tuple[Term, ...]
    cpu_only: bool = False

    @property
    def name(self) -> str:
        return config_name(self.stage, self.offload)

    def _in(self, tiers: tuple[str, ...]) -> tuple[float, str | None]:
        always = sum(t.nbytes for t in self.terms if t.phase is None and t.tier in tiers)
        per_phase = {
            ph: sum(t.nbytes for t in self.terms if t.phase == ph and t.tier in tiers)
            for ph in PHASES
        }
        phase = max(PHASES, key=lambda ph: per_phase[ph])
        return always + per_phase[phase], phase if per_phase[phase] > 0 else None

    def peak(self, tier: str) -> float:
        """The most bytes ``tier`` holds at once (the largest phase on top of the rest)."""
        return self._in((tier,))[0]

    @property
    def _host_tiers(self) -> tuple[str, ...]:
        """The tiers in host memory: with ``cpu_only`` the device's too (the same memory)."""
        return ("device", "host") if self.cpu_only else ("host",)

    @property
    def host_peak(self) -> float:
        """The rank's peak in host memory, at the phase where its tiers hold the most."""
        return self._in(self._host_tiers)[0]

    @property
    def peak_phase(self) -> str | None:
        """The phase of the host peak (None: no phase adds to it)."""
        return self._in(self._host_tiers)[1]

    def at_peak(self) -> list[Term]:
        """The terms held at the host peak, largest first."""
        phase = self.peak_phase
        held = [t for t in self.terms if t.tier in self._host_tiers and t.phase in (None, phase)]
        return sorted((t for t in held if t.nbytes > 0), key=lambda t: -t.nbytes)


# [Note: the peak of a step]
# On top of the model state at rest (:func:`estimate`'s terms) a step holds, per phase:
#
# - forward and backward: stage 3's gathered parameters (``gathered``); with parameters
#   on NVMe, the shards of the units whose gathers are in flight (``stage3_prefetch_bucket_size``
#   worth of units, at least one), read from their files (a shard is freed once gathered).
# - backward: the gradient buckets of the reduction (``reduce_buffers``). At stages 2-3 a
#   group's full-size gradients (``reduce_bucket_size`` elements, half that where the
#   collective needs a receive buffer; at most a stage-3 block unit, or at stages 1-2 the
#   whole model, and at least the largest parameter) are held while one group fills and
#   one is reduced, plus that receive buffer (none through shared memory); at stage 1 the
#   gradients are persistent and the reduction adds the receive buffer and, where the
#   collective cannot write into its own input (off CPU ranks), its ``1/N`` output. With
#   NVMe optimizer offload on CPU ranks the gradient shard being reduced into is read in and
#   written behind (``grad_shard``).
# - step: under mixed precision the fp32 copies of the gradient shard
#   (``fp32_grads``). With the optimizer on NVMe the step reads its state bucket by
#   bucket (``swap_buffers``): the bucket stepping and the one read ahead
#   (``min(buffer_count, 2) x buffer_size`` elements, at most the rank's shard), each
#   element with its Adam moments, fp32 master, gradient (and under mixed precision the
#   low-precision shard and the fp32 gradient copy). Writes go behind; they hold more
#   only while the disk lags the step (at most ``buffer_count`` buckets).
#
# Activations (``activation_bytes``) are held from the forward to the backward.
def step_peak(
    facts: ModelFacts,
    world_size: int,
    stage: int,
    offload: str = "none",
    precision: str = "bf16",
    activation_bytes: float = 0.0,
    knobs: Knobs | None = None,
) -> Peak:
    """The buffers one rank holds during a training step, tier by tier and phase by phase
    (see [Note: the peak of a step] above)."""
    k_ = knobs or Knobs()
    base = estimate(
        facts,
        world_size,
        stage,
        offload,
        precision,
        activation_bytes,
        prefetch_numel=k_.prefetch_numel,
        max_live_numel=k_.max_live_numel,
        max_reuse_numel=k_.max_reuse_numel,
    )
    p, g, _ = PRECISIONS[precision]
    mixed = p == 2
    n = world_size
    train = facts.n_trainable
    sharded = facts.params - (facts.persistent if stage == 3 else 0)
    nvme_opt = offload == "nvme"
    host_opt = offload in ("cpu", "cpu+params")
    terms: list[Term] = []
    d = base.device
    # at rest: estimate()'s terms, in their tiers; what offload moved is off the device
    off_tier = "host" if host_opt else "nvme" if nvme_opt else "device"
    moved_params = p * sharded / n if offload in ("cpu+params", "nvme") else 0.0
    terms.append(Term("params", "device", d["params"]))
    if moved_params:
        terms.append(Term("params", off_tier, moved_params))
    grads_in_files = nvme_opt and k_.cpu_only and stage >= 2
    terms.append(Term("grads", "nvme" if grads_in_files else "device", d["grads"]))
    moved_optimizer = base.cpu + base.nvme - moved_params
    terms.append(
        Term("optimizer", off_tier, moved_optimizer if offload != "none" else d["optimizer"])
    )
    # forward and backward: gathered stage-3 units, and their shards read in from files
    in_flight = 0.0
    if nvme_opt and stage == 3:
        # a unit's shard is freed once gathered: the shards held are those of the units
        # being prefetched (gathers in flight)
        unit = max(facts.largest_unit, 1)
        ahead = max(1, math.ceil(min(k_.prefetch_numel, k_.max_live_numel) / unit))
        in_flight = p * min(ahead * unit, sharded) / n
    for phase in ("forward", "backward"):
        if d["gathered"]:
            terms.append(Term("gathered", "device", d["gathered"], phase))
        if in_flight:
            terms.append(Term("param_shards_in_flight", "host", in_flight, phase))
    if activation_bytes:
        terms.append(Term("activations", "device", float(activation_bytes), "backward"))
    terms += _reduction_terms(facts, stage, g, n, k_, grads_in_files)
    # step
    shard = train / n if stage >= 1 else train
    if nvme_opt:
        per_element = 8 + 4 + g + ((p + 4) if mixed else 0)  # moments, master, grad (+ copies)
        held = min(min(max(k_.buffer_count, 1), 2) * max(k_.buffer_numel, 1), shard)
        terms.append(Term("swap_buffers", "host", per_element * held, "step"))
    elif precision == "bf16-low" and train:  # the rounded step: one chunk in fp32
        copies = min(float(_ROUNDED_CHUNK_BYTES), 16 * shard)
        terms.append(Term("fp32_chunk", "host" if host_opt else "device", copies, "step"))
    elif mixed and train:
        terms.append(Term("fp32_grads", "host" if host_opt else "device", 4 * shard, "step"))
    return Peak(stage, offload, precision, tuple(terms), k_.cpu_only)


def _reduction_terms(
    facts: ModelFacts, stage: int, g: float, n: int, k_: Knobs, grads_in_files: bool
) -> list[Term]:
    """Backward's reduction buckets. A group is at most a bucket, at least one parameter;
    at stage 3 the groups that matter are a block's (the root unit reduces last, once the
    blocks' gathered parameters are gone)."""
    train = facts.n_trainable
    bucket = k_.reduce_bucket_numel / 2 if k_.reduce_scratch else k_.reduce_bucket_numel
    if stage == 3:
        group = max(1.0, min(bucket, facts.largest_unit or train))
        groups = 2
    else:
        group = max(1.0, min(bucket, train), facts.largest_param)
        groups = 1 if train <= group else 2
    scratch = group if k_.reduce_scratch and not k_.shared_memory else 0.0
    if stage >= 2 and train:
        reduce = g * (groups * group + scratch)
    elif stage == 1 and train:  # CPU ranks reduce into the buffer's own slice (reduces_into_input)
        reduce = g * (scratch + (0.0 if k_.reduce_scratch else group / n))
    else:
        reduce = 0.0
    terms = [Term("reduce_buffers", "device", reduce, "backward")] if reduce else []
    if grads_in_files:
        terms.append(Term("grad_shard", "host", g * 2 * group / n, "backward"))
    return terms


def format_peaks(peaks: list[Peak]) -> str:
    """One row per configuration: the peak of each tier, the host peak and what makes it."""
    gb = gigabytes
    header = ["config", "device peak", "host peak", "nvme", "at the host peak"]
    rows = []
    for pk in peaks:
        held = pk.at_peak()
        where = ", ".join(
            f"{t.name}{'' if t.tier == 'device' else f' ({t.tier})'} {gb(t.nbytes)}"
            for t in held[:4]
        )
        if len(held) > 4:
            where += ", ..."
        phase = f"[{pk.peak_phase}] " if pk.peak_phase else ""
        rows.append(
            [
                pk.name,
                "-" if pk.cpu_only else gb(pk.peak("device")),
                gb(pk.host_peak),
                gb(pk.peak("nvme")),
                phase + where,
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in [header, *rows]
    ]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


# -- counting a model without allocating it ---------------------------------------------------


def model_facts(
    model: nn.Module | str | Callable[..., Any],
    kwargs: dict[str, Any] | None = None,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
) -> ModelFacts:
    """Count a model's parameters and its stage-3 units. ``model`` is a module, a callable
    returning one, or ``'package.module:factory'``; factories are called on the meta device,
    so a 70B-parameter model costs no memory to count."""
    from .core.zero.units import plan_units

    if isinstance(model, str):
        model = import_factory(model)
    if not isinstance(model, nn.Module):
        model = build_with(model, dict(kwargs or {}), meta_device)
    params = list(model.parameters())
    plan = plan_units(model, persistence_threshold)
    units = [sum(p.numel() for p in plan.params[id(u)]) for u in plan.units]  # root last
    return ModelFacts(
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        persistent=sum(p.numel() for p in plan.persistent),
        largest_unit=max(units[:-1], default=0),
        root_unit=units[-1],
        largest_param=max((p.numel() for p in params if p.requires_grad), default=0),
        hidden_size=model_hidden_size(model),
        shape=TransformerShape.of(model),
        experts=expert_elements(model),
    )


def expert_elements(model: nn.Module) -> int:
    """Elements of the model's experts, all ranks' (``core/moe``: transformers' fused experts
    and ``MoE`` layers, a layer built with ``ep_size`` counted for every rank).

    Args:
        model: the model (on the meta device is fine).
    """
    from .core.moe.layer import MoE
    from .core.moe.parallel import expert_layers

    total = 0
    for _, layer in expert_layers(model):
        if isinstance(layer, MoE):
            experts = layer.deepspeed_moe.experts
            total += sum(p.numel() for p in experts.parameters()) * layer.ep_size
        else:
            total += sum(p.numel() for p in layer.parameters(recurse=False))
    return total


@dataclass(frozen=True)
class StageFacts:
    """One pipeline rank's part of a model: its layers' indices (its chunks' under the
    interleaved schedule) and their counts."""

    stage: int
    layers: list[int]
    facts: ModelFacts


def pipeline_facts(
    model: nn.Module | str | Callable[..., Any] | list[nn.Module],
    stages: int,
    partition_method: str = "parameters",
    chunks: int = 1,
    kwargs: dict[str, Any] | None = None,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
) -> list[StageFacts]:
    """Count each pipeline rank's layers as :class:`~ds_strategy.core.pipeline.PipelineEngine`
    partitions them (a weight tied across stages counts on each stage holding it, as each
    keeps a copy). ``model``: an ``nn.Sequential`` or list of layers, or a factory of one,
    called on the meta device."""
    from .core.pipeline.partition import partition_layers
    from .core.pipeline.schedules import stage_layers

    if isinstance(model, str):
        model = import_factory(model)
    if not isinstance(model, (nn.Module, list, tuple)):
        model = build_with(model, dict(kwargs or {}), meta_device)
    if not isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        raise ValueError(
            f"a pipeline estimate needs the model as an nn.Sequential or a list of layers, got "
            f"{type(model).__name__}"
        )
    layers = list(model)
    bounds = partition_layers(layers, stages * chunks, partition_method)
    out = []
    for stage in range(stages):
        own = stage_layers(bounds, stage, stages, chunks)
        part = nn.Sequential(*[layers[i] for i in own])
        out.append(StageFacts(stage, own, model_facts(part, None, persistence_threshold)))
    return out


def worst_per_candidate(per_stage: list[list[Estimate]]) -> list[Estimate]:
    """For each (stage, offload, precision), the pipeline stage needing the most device
    memory: one config serves every stage, so it must fit the largest."""
    return [max(row, key=lambda e: e.device_total) for row in zip(*per_stage, strict=True)]


# -- parsing and printing ---------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_bytes(text: str | float) -> float:
    """``'80GB'`` -> 8e10 (decimal units), ``'24GiB'`` -> 24 * 2**30, ``1e9`` -> 1e9."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; write e.g. 80GB, 24GiB, 512MB or 8e10"
        )
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(value):
        raise ValueError(f"a memory size must be finite, got {text!r}")
    return value


def parse_count(text: str | float) -> int:
    """``'7e9'`` / ``'7B'`` / ``'350M'`` -> a parameter count."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m:
        raise ValueError(f"cannot read {text!r} as a parameter count; write e.g. 7e9, 7B or 350M")
    value = float(m.group(1)) * _COUNT_SUFFIX[m.group(2)]
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"a parameter count must be at least 1, got {text!r}")
    return int(value)


def gigabytes(x: float) -> str:
    return f"{x / 1e9:.2f}"


def format_table(
    estimates: list[Estimate],
    gpu_mem: float | None = None,
    cpu_mem: float | None = None,
    ranks_per_node: int = 1,
) -> str:
    """A table, one row per (stage, offload), one column group per precision, in GB."""
    precisions = list(dict.fromkeys(e.precision for e in estimates))
    by_key = {(e.stage, e.offload, e.precision): e for e in estimates}
    header = ["config"] + [f"{p} device | cpu | nvme" for p in precisions]
    rows = []
    for s, o in CANDIDATES:
        cells = [config_name(s, o)]
        for p in precisions:
            e = by_key.get((s, o, p))
            if e is None:
                cells.append("-")
                continue
            mark = ""
            if gpu_mem is not None:
                mark = " ok" if fits(e, gpu_mem, cpu_mem, ranks_per_node) else " --"
            cells.append(
                f"{gigabytes(e.device_total)} | {gigabytes(e.cpu)} | {gigabytes(e.nvme)}{mark}"
            )
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
