"""Which features combine: one table of rules over a config and the facts of the job it runs
in, each refusal a :class:`ConfigError` naming the key, the reason and the fix.

[Note: the rule table]
A rule is a named check of one feature (its ``key``) against the others, or of one key's
meaning against another's; it returns what it refuses (None: nothing). :func:`check_rules` runs
the rules of one point and raises the first refusal. The points, in the order they come:

- ``"load"``: the config as it is read, where ``"auto"`` values may remain (each rule skips
  what is still ``"auto"``); the walker runs them, so they run again on the resolved config.
- ``"engine"``: a ZeroEngine takes a config (before resolving: it decides the ranks).
- ``"config"``: a training engine's resolved config alone.
- ``"ranks"``: with the data-parallel ranks; ``"optimizer"``: with the optimizer;
  ``"compression"``: the top-k exchange is built (a trainable model, ranks to exchange with).
- ``"quantization"``: the layers are converted for quantization-aware training.
- ``"pipeline"``: a pipeline's resolved config; ``"stages"``: with its stages' shared weights.
- ``"inference"``: an inference engine's resolved config.

A rule may run at several points (``when`` a tuple). Engines run them inside their agreement
points, so every rank raises the same error. Checks of one key's own value (types, bounds,
regular expressions) stay with the loader (``_load._CHECKS``); what needs a model's layers or
a file (a plan, a checkpoint) stays where the model or the file is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._leaves import _is_auto
from ._schema import ConfigError, OffloadConfig, ZeroConfig

__all__ = ["Facts", "RULES", "Refusal", "Rule", "check_rules"]


@dataclass(frozen=True)
class Facts:
    """What an engine knows besides its config when a rule runs.

    Attributes:
        world_size: the data-parallel ranks ZeRO shards over.
        ranks_per_machine: from the topology, for the fixes that name it.
        in_pipeline: the engine is one pipeline stage's.
        sub_group: the engine runs on a process sub-group, not the default group.
        tensor_parallel: layers split over tensor-parallel ranks.
        offload: an offload tier is on (optimizer state or parameters).
        optimizer: the optimizer's class name (``""`` before it is known).
        sgd: the optimizer is a ``torch.optim.SGD``.
        momenta: the momentum values of the optimizer's parameter groups.
        compressed_optimizer: it exchanges compressed momenta or updates (1-bit Adam/LAMB,
            0/1 Adam).
        local_steps: it steps locally between synchronisations (0/1 Adam).
        tied_stages: the pipeline stages sharing a weight (empty: none shares one).
    """

    world_size: int = 1
    ranks_per_machine: int = 1
    in_pipeline: bool = False
    sub_group: bool = False
    tensor_parallel: bool = False
    offload: bool = False
    optimizer: str = ""
    sgd: bool = False
    momenta: tuple[float, ...] = ()
    compressed_optimizer: bool = False
    local_steps: bool = False
    tied_stages: tuple[int, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """A refusal about another key than its rule's (e.g. one of two sections the rule reads)."""

    key: str
    message: str


Check = Callable[[ZeroConfig, Facts], "str | Refusal | None"]


@dataclass(frozen=True)
class Rule:
    """``check`` returns the whole message of a refusal (reason and fix), or None."""

    name: str
    key: str
    when: str | tuple[str, ...]  # the point(s) it runs at: see the note above
    check: Check

    @property
    def points(self) -> tuple[str, ...]:
        return (self.when,) if isinstance(self.when, str) else self.when


def _known(value: object) -> bool:
    return value is not None and not _is_auto(value)


def _offloads(cfg: ZeroConfig) -> tuple[tuple[str, OffloadConfig], ...]:
    zc = cfg.zero_optimization
    prefix = "zero_optimization"
    return (
        (f"{prefix}.offload_optimizer", zc.offload_optimizer),
        (f"{prefix}.offload_param", zc.offload_param),
    )


# ----------------------------------------------------------------------------- load


def _nvme_needs_a_path(cfg: ZeroConfig, facts: Facts) -> Refusal | None:
    for prefix, section in _offloads(cfg):
        if section.device == "nvme" and not section.nvme_path:
            key = f"{prefix}.nvme_path"
            return Refusal(
                key,
                f"{key}: required when device is 'nvme'; set it to a directory on a local "
                "NVMe drive, or use device 'cpu'",
            )
    return None


def _offload_param_stage(cfg: ZeroConfig, facts: Facts) -> str | None:
    # DeepSpeed ignores offload_param below stage 3; so does the lenient loader (with a
    # warning, _load._ignore_param_offload_below_stage3): what reaches here was asked strictly
    zc = cfg.zero_optimization
    device = zc.offload_param.device
    if device in ("none", "auto") or not _known(zc.stage) or zc.stage == 3:
        return None
    return (
        f"zero_optimization.offload_param: device {device!r} needs ZeRO stage 3 (only stage 3 "
        f"partitions parameters), but stage is {zc.stage}; set zero_optimization.stage to 3 "
        "or remove offload_param"
    )


def _partial_offload_stage(cfg: ZeroConfig, facts: Facts) -> str | None:
    zc = cfg.zero_optimization
    ratio = zc.offload_optimizer.ratio
    if not _known(ratio) or ratio >= 1.0 or not _known(zc.stage) or zc.stage == 3:
        return None
    return (
        f"zero_optimization.offload_optimizer.ratio: partial optimizer offload (ratio {ratio}) "
        f"needs ZeRO stage 3, but stage is {zc.stage}; set zero_optimization.stage to 3 or "
        "ratio to 1.0"
    )


def _dynamic_loss_scaling(cfg: ZeroConfig, facts: Facts) -> Refusal | None:
    # as DeepSpeed: the scaler's window and floor only matter with dynamic scaling, so a
    # disabled or statically scaled fp16 section may hold anything there
    fp16 = cfg.fp16
    if fp16.enabled is not True or not _known(fp16.loss_scale) or fp16.loss_scale != 0:
        return None
    why = "when fp16 is enabled with dynamic loss scaling (loss_scale 0)"
    for name, value, bound in (
        ("loss_scale_window", fp16.loss_scale_window, ">= 1"),
        ("min_loss_scale", fp16.min_loss_scale, "> 0"),
        ("hysteresis", fp16.hysteresis, ">= 1"),
    ):
        if _known(value) and (value <= 0 if bound == "> 0" else value < 1):
            key = f"fp16.{name}"
            return Refusal(
                key,
                f"{key}: got {value!r}, must be {bound} {why}; set it {bound}, or give a "
                "static fp16.loss_scale > 0",
            )
    return None


def _qat_needs_bits(cfg: ZeroConfig, facts: Facts) -> str | None:
    if cfg.quantization.qat is True and cfg.quantization.bits is None:
        return "quantization.bits: qat trains with fake-quantized weights: set bits to 8 or 4"
    return None


def _offload_optimizer_stage(cfg: ZeroConfig, facts: Facts) -> str | None:
    zc = cfg.zero_optimization
    if zc.offload_optimizer.device != "none" and zc.stage == 0:
        return (
            f"zero_optimization.offload_optimizer: device {zc.offload_optimizer.device!r} needs "
            "ZeRO stage 1, 2 or 3 (the offloaded state is this rank's shard); set "
            "zero_optimization.stage or offload_optimizer.device to 'none'"
        )
    return None


def _one_nvme_directory(cfg: ZeroConfig, facts: Facts) -> str | None:
    # (a directory each: "NVMe offload needs a directory" refused the config at load otherwise)
    paths = {c.nvme_path for _, c in _offloads(cfg) if c.device == "nvme" and c.nvme_path}
    if len(paths) > 1:
        return (
            "zero_optimization.offload_param.nvme_path and offload_optimizer.nvme_path differ "
            f"({sorted(paths)}); use one directory for both"
        )
    return None


# ----------------------------------------------------------------------------- a ZeroEngine


def _zero_engine_is_no_pipeline(cfg: ZeroConfig, facts: Facts) -> str | None:
    stages = cfg.pipeline.stages
    if _known(stages) and stages > 1:
        return (
            f"pipeline.stages={stages}: a pipeline is built by "
            "ds_strategy.initialize(model, optimizer, config, loss_fn=...) with an "
            "nn.Sequential and trained with engine.train_batch; this front end drives "
            "a ZeroEngine, so set pipeline.stages to 1 here"
        )
    return None


def _tensor_parallel_on_a_sub_group(cfg: ZeroConfig, facts: Facts) -> str | None:
    tp = cfg.tensor_parallel.autotp_size
    if facts.sub_group and not facts.in_pipeline and _known(tp) and tp > 1:
        return (
            f"tensor_parallel.autotp_size={tp} with an engine on a process sub-group is not "
            "supported; build the engine on the default group (its mesh splits the ranks)"
        )
    return None


def _mics_combinations(cfg: ZeroConfig, facts: Facts) -> str | None:
    zc = cfg.zero_optimization
    size = zc.mics_shard_size
    if size <= 0:
        return None
    refused = []
    if zc.stage == 0:
        refused.append("zero_optimization.stage 0, which shards nothing (use stage 1-3)")
    if cfg.topology.hierarchical:
        refused.append(
            "topology.hierarchical (MiCS's shard groups already keep ZeRO's collectives "
            "inside a machine; keep one of them)"
        )
    if zc.stage == 3 and zc.zero_hpz_partition_size > 1:
        refused.append(
            "zero_hpz_partition_size (hpZ's secondary shard inside a machine is what a "
            "MiCS shard group already is; keep one of them)"
        )
    if zc.stage == 3 and zc.zero_quantized_gradients:
        refused.append("zero_quantized_gradients (remove it, or mics_shard_size)")
    if facts.in_pipeline:
        refused.append("pipeline stages (remove mics_shard_size from a pipeline config)")
    if refused:
        return f"zero_optimization.mics_shard_size={size} does not work with " + "; ".join(refused)
    return None


def _mics_divides(cfg: ZeroConfig, facts: Facts) -> str | None:
    size, n = cfg.zero_optimization.mics_shard_size, facts.world_size
    if size > 0 and (size > n or n % size):
        return (
            f"zero_optimization.mics_shard_size={size} does not divide the {n} "
            "data-parallel ranks; use a divisor of it (usually the ranks per machine, "
            f"{facts.ranks_per_machine} here), or -1 to shard over all of them"
        )
    return None


def _hpz_divides(cfg: ZeroConfig, facts: Facts) -> str | None:
    zc = cfg.zero_optimization
    size, n = zc.zero_hpz_partition_size, facts.world_size
    if zc.stage == 3 and size > 1 and n % size:
        return (
            f"zero_optimization.zero_hpz_partition_size={size} does not divide the {n} "
            "data-parallel ranks; use a divisor (usually the ranks per machine, "
            f"{facts.ranks_per_machine} here)"
        )
    return None


def _compression_with_mics(cfg: ZeroConfig, facts: Facts) -> str | None:
    gc = cfg.gradient_compression
    compressed = gc.method != "none" or facts.compressed_optimizer
    if compressed and cfg.zero_optimization.mics_shard_size > 0:
        return (
            "zero_optimization.mics_shard_size with gradient compression "
            f"(gradient_compression.method={gc.method!r}, optimizer {facts.optimizer}): the "
            "compressed exchanges run over all data-parallel ranks and MiCS reduces in two "
            "groups; remove one of them"
        )
    return None


def _compressed_optimizer(cfg: ZeroConfig, facts: Facts) -> str | None:
    if not facts.compressed_optimizer:
        return None
    stage, method = cfg.zero_optimization.stage, cfg.gradient_compression.method
    refused = []
    if method != "none":
        refused.append(f"gradient_compression.method={method!r} (one compression at a time)")
    if facts.local_steps and stage > 0:
        refused.append(
            f"zero_optimization.stage {stage}: its local steps move each rank's "
            "weights with that rank's own momentum, which needs every parameter's "
            "optimizer state on every rank (use stage 0, as DeepSpeed runs it, or "
            "OneBitAdam, which works at stages 0-2)"
        )
    elif stage > 2:
        refused.append("zero_optimization.stage 3 (use stage 0, 1 or 2)")
    if facts.offload:
        refused.append("optimizer / parameter offload (remove the offload sections)")
    if facts.tensor_parallel:
        refused.append("tensor parallelism (set tensor_parallel.autotp_size to 1)")
    if facts.in_pipeline:
        refused.append("pipeline stages (remove the pipeline section)")
    if refused:
        return (
            f"{facts.optimizer} has the ranks exchange 1-bit compressed momenta or updates, "
            f"which does not work with {'; '.join(refused)}"
        )
    return None


def _rounded_step_combinations(cfg: ZeroConfig, facts: Facts) -> str | None:
    """Low-precision masters or optimizer states step the optimizer a chunk at a time."""
    asked = [
        key
        for key, on in (
            ("bf16.bf16_master_weights_and_grads", cfg.bf16.bf16_master_weights_and_grads),
            ("bf16.bf16_optimizer_states", cfg.bf16.bf16_optimizer_states),
        )
        if on and cfg.bf16.enabled is True
    ]
    if cfg.fp16.fp16_master_weights_and_grads and cfg.fp16.enabled is True:
        asked.append("fp16.fp16_master_weights_and_grads")
    if not asked:
        return None
    refused = []
    if any(c.device == "nvme" for _, c in _offloads(cfg)):
        refused.append("NVMe offload, which steps the state in its own buckets (offload to 'cpu')")
    if facts.compressed_optimizer:
        refused.append(f"{facts.optimizer}, whose step exchanges compressed momenta")
    if refused:
        return (
            f"{', '.join(asked)} steps the optimizer a chunk at a time in fp32 and does not "
            f"work with {'; '.join(refused)}; remove {asked[0]} or change the other"
        )
    return None


# torchao's low-bit optimizers, as ``Facts.optimizer`` names them (core/optim/lowbit.py)
LOWBIT_OPTIMIZERS = ("AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit", "Adam4bit", "AdamFp8")


def _lowbit_combinations(cfg: ZeroConfig, facts: Facts) -> str | None:
    """A low-bit optimizer's state is quantized codes, which neither NVMe offload nor the
    bf16 state step can hold."""
    if facts.optimizer not in LOWBIT_OPTIMIZERS:
        return None
    refused = []
    if any(c.device == "nvme" for _, c in _offloads(cfg)):
        refused.append("NVMe offload (offload to 'cpu')")
    if cfg.bf16.enabled is True and cfg.bf16.bf16_optimizer_states:
        refused.append("bf16.bf16_optimizer_states (remove it: the state is 8-bit or 4-bit)")
    if refused:
        return (
            f"{facts.optimizer} keeps quantized optimizer state, which does not work with "
            f"{'; '.join(refused)}"
        )
    return None


def _beside_a_new_dimension(cfg: ZeroConfig, facts: Facts, compression_why: str) -> list[str]:
    """What a sequence or expert dimension does not work with yet, each with its fix."""
    zc = cfg.zero_optimization
    refused = []
    if facts.tensor_parallel:
        refused.append("tensor parallelism (set tensor_parallel.autotp_size to 1)")
    if cfg.gradient_compression.method != "none" or facts.compressed_optimizer:
        refused.append(f"gradient compression or a 1-bit optimizer ({compression_why})")
    if zc.mics_shard_size > 0:
        refused.append("zero_optimization.mics_shard_size (remove it)")
    if zc.stage == 3 and zc.zero_hpz_partition_size > 1:
        refused.append("zero_optimization.zero_hpz_partition_size (remove it)")
    if cfg.topology.hierarchical:
        refused.append("topology.hierarchical (remove it)")
    return refused


def _sequence_parallel_combinations(cfg: ZeroConfig, facts: Facts) -> str | None:
    sp, cp = cfg.sequence_parallel_size, cfg.context_parallel_size
    if sp * cp == 1:
        return None
    why = "their exchanges average over every rank; the ranks of a sequence add their gradients"
    refused = _beside_a_new_dimension(cfg, facts, why)
    if refused:
        return (
            f"sequence_parallel_size={sp} x context_parallel_size={cp} does not work with "
            + "; ".join(refused)
        )
    return None


def _expert_parallel_combinations(cfg: ZeroConfig, facts: Facts) -> str | None:
    ep = cfg.moe.ep_size
    if ep == 1:
        return None
    zc = cfg.zero_optimization
    refused = []
    if cfg.sequence_parallel_size * cfg.context_parallel_size > 1:
        refused.append("sequence or context parallelism (set their sizes to 1)")
    if facts.in_pipeline:
        refused.append("pipeline stages (train without pipeline.stages)")
    if zc.stage == 3 and (zc.zero_quantized_weights or zc.zero_quantized_gradients):
        refused.append("ZeRO++'s quantized collectives (remove zero_quantized_*)")
    why = "their exchanges treat every rank's parameters as replicas; experts differ"
    refused += _beside_a_new_dimension(cfg, facts, why)
    if refused:
        return f"moe.ep_size={ep} does not work with " + "; ".join(refused)
    return None


def _fp16_and_bf16(cfg: ZeroConfig, facts: Facts) -> str | None:
    if cfg.fp16.enabled is True and cfg.bf16.enabled is True:
        return (
            "fp16.enabled: fp16 and bf16 cannot both be enabled; set fp16.enabled or "
            "bf16.enabled to false"
        )
    return None


def _compression_layouts(cfg: ZeroConfig, facts: Facts) -> str | None:
    if cfg.gradient_compression.method in ("none", "auto"):
        return None
    key = "gradient_compression.method"
    if cfg.zero_optimization.stage == 3:
        return (
            f"{key}: gradient compression runs with ZeRO stages 0, 1 and 2 (stage 3 reduces "
            "each layer's gradients as backward produces them); set zero_optimization.stage "
            "to 2 or lower, or method to 'none'"
        )
    if cfg.tensor_parallel.autotp_size not in (1, "auto"):
        return (
            f"{key}: gradient compression with tensor_parallel is not available yet; set "
            "tensor_parallel.autotp_size to 1 or method to 'none'"
        )
    if _known(cfg.pipeline.stages) and cfg.pipeline.stages > 1:
        return (
            f"{key}: gradient compression is not available with pipeline stages; remove the "
            "pipeline section or set method to 'none'"
        )
    return None


def _momentum_correction_needs_sgd(cfg: ZeroConfig, facts: Facts) -> str | None:
    if not cfg.gradient_compression.momentum_correction:
        return None
    momenta = sorted(set(facts.momenta))
    if facts.sgd and len(momenta) == 1 and momenta[0] > 0:
        return None
    return (
        "gradient_compression.momentum_correction: the correction accumulates SGD's "
        "momentum locally before compression (Deep Gradient Compression), so it needs "
        f"torch.optim.SGD with one momentum > 0 for all groups (got {facts.optimizer}, "
        f"momentum {momenta}); use SGD(momentum=...) or set momentum_correction to false"
    )


def _qat_with_tensor_parallel(cfg: ZeroConfig, facts: Facts) -> str | None:
    if facts.tensor_parallel:
        return (
            "quantization.qat with tensor_parallel.autotp_size > 1 is not supported: the fake "
            "quantization rounds whole rows of each weight, which tensor parallelism splits; "
            "train with qat at autotp_size 1"
        )
    return None


def _chunks_need_interleaving(cfg: ZeroConfig, facts: Facts) -> str | None:
    pc = cfg.pipeline
    chunks = pc.stages_per_rank
    if chunks is not None and chunks > 1 and pc.schedule != "interleaved_1f1b":
        return (
            f"pipeline.stages_per_rank: {chunks} chunks per rank need schedule "
            "'interleaved_1f1b'; set stages_per_rank to 1 or change the schedule"
        )
    return None


def _interleaved_micro_batches(cfg: ZeroConfig, facts: Facts) -> str | None:
    pp_size, micro_batches = cfg.pipeline.stages, cfg.gradient_accumulation_steps
    interleaved = cfg.pipeline.schedule == "interleaved_1f1b"
    if interleaved and micro_batches is not None and micro_batches % pp_size:
        return (
            f"gradient_accumulation_steps: the interleaved 1F1B schedule needs a number "
            f"of micro-batches divisible by pipeline.stages ({pp_size}), got "
            f"{micro_batches}; change gradient_accumulation_steps or use schedule '1f1b'"
        )
    return None


def _tied_weights_below_stage_3(cfg: ZeroConfig, facts: Facts) -> str | None:
    if facts.tied_stages and cfg.zero_optimization.stage == 3:
        return (
            f"zero_optimization.stage 3: a weight is shared by pipeline stages "
            f"{list(facts.tied_stages)} (tied across stages, e.g. an embedding and its output "
            "head); under ZeRO-3 each stage reduce-scatters its gradients as backward runs, so "
            "the copies cannot be summed. Use stage 1 or 2, or keep the layers that share it "
            "on one stage (pipeline.partition_method)"
        )
    return None


def _inference_shards_one_way(cfg: ZeroConfig, facts: Facts) -> str | None:
    tp = cfg.tensor_parallel.autotp_size
    if tp > 1 and cfg.zero_optimization.stage == 3:
        return (
            f"tensor_parallel.autotp_size={tp} with zero_optimization.stage 3: inference "
            "shards the weights one way at a time; keep tensor parallelism (each rank holds "
            "1/T of every split layer) or ZeRO-Inference (each rank 1/N of every layer, "
            "gathered per layer)"
        )
    return None


def _inference_stage(cfg: ZeroConfig, facts: Facts) -> str | None:
    stage = cfg.zero_optimization.stage
    if stage in (1, 2):
        return (
            f"zero_optimization.stage {stage}: inference has no optimizer state or "
            "gradients to shard; use stage 3 (ZeRO-Inference: sharded weights) or 0"
        )
    return None


def _inference_without_qat(cfg: ZeroConfig, facts: Facts) -> str | None:
    if cfg.quantization.qat:
        return (
            "quantization.qat trains with fake-quantized weights (a training config); for "
            "inference, set bits and leave qat false: the weights are quantized on load"
        )
    return None


_ZO = "zero_optimization"
_ANY_ENGINE = ("config", "inference")  # the resolved config of a training or inference engine

RULES: tuple[Rule, ...] = (
    # load
    Rule("fp16 or bf16", "fp16.enabled", "load", _fp16_and_bf16),
    Rule("gradient compression's layouts", "gradient_compression.method", "load",
         _compression_layouts),
    Rule("NVMe offload needs a directory", f"{_ZO}.offload_optimizer.nvme_path", "load",
         _nvme_needs_a_path),
    Rule("offload_param needs stage 3", f"{_ZO}.offload_param", "load", _offload_param_stage),
    Rule("partial optimizer offload needs stage 3", f"{_ZO}.offload_optimizer.ratio", "load",
         _partial_offload_stage),
    Rule("dynamic loss scaling's window, floor and hysteresis", "fp16.loss_scale_window",
         "load", _dynamic_loss_scaling),
    Rule("quantization-aware training needs bits", "quantization.bits", "load",
         _qat_needs_bits),
    # a ZeroEngine takes the config
    Rule("a ZeroEngine is no pipeline", "pipeline.stages", "engine",
         _zero_engine_is_no_pipeline),
    Rule("tensor parallelism on the default group", "tensor_parallel.autotp_size", "engine",
         _tensor_parallel_on_a_sub_group),
    # an engine's resolved config
    Rule("offload_optimizer needs a sharding stage", f"{_ZO}.offload_optimizer", _ANY_ENGINE,
         _offload_optimizer_stage),
    Rule("one NVMe directory", f"{_ZO}.offload_param.nvme_path", _ANY_ENGINE,
         _one_nvme_directory),
    # with the ranks, then the optimizer
    Rule("MiCS with other features", f"{_ZO}.mics_shard_size", "ranks", _mics_combinations),
    Rule("MiCS shard groups divide the ranks", f"{_ZO}.mics_shard_size", "ranks",
         _mics_divides),
    Rule("hpZ's secondary groups divide the ranks", f"{_ZO}.zero_hpz_partition_size", "ranks",
         _hpz_divides),
    Rule("gradient compression with MiCS", f"{_ZO}.mics_shard_size", "optimizer",
         _compression_with_mics),
    Rule("1-bit and 0/1 optimizers with other features", "optimizer", "optimizer",
         _compressed_optimizer),
    Rule("sequence and context parallelism with other features", "sequence_parallel_size",
         "optimizer", _sequence_parallel_combinations),
    Rule("expert parallelism with other features", "moe.ep_size", "optimizer",
         _expert_parallel_combinations),
    Rule("low-precision masters and states with other features",
         "bf16.bf16_master_weights_and_grads", "optimizer", _rounded_step_combinations),
    Rule("low-bit optimizer states with other features", "optimizer", "optimizer",
         _lowbit_combinations),
    Rule("momentum correction replaces SGD's momentum", "gradient_compression.momentum_correction",
         "compression", _momentum_correction_needs_sgd),
    Rule("quantization-aware training without tensor parallelism", "quantization.qat",
         "quantization", _qat_with_tensor_parallel),
    # a pipeline
    Rule("chunks per rank need the interleaved schedule", "pipeline.stages_per_rank",
         "pipeline", _chunks_need_interleaving),
    Rule("interleaved 1F1B's micro-batches", "gradient_accumulation_steps", "pipeline",
         _interleaved_micro_batches),
    Rule("weights tied across stages below stage 3", f"{_ZO}.stage", "stages",
         _tied_weights_below_stage_3),
    # an inference engine
    Rule("inference shards one way", "tensor_parallel.autotp_size", "inference",
         _inference_shards_one_way),
    Rule("inference has nothing for stages 1 and 2", f"{_ZO}.stage", "inference",
         _inference_stage),
    Rule("inference without quantization-aware training", "quantization.qat", "inference",
         _inference_without_qat),
)  # fmt: skip


def check_rules(cfg: ZeroConfig, facts: Facts, when: str) -> None:
    """Run the rules of one point (see the note above) in the table's order; raise the first
    refusal as a :class:`ConfigError` naming its key."""
    for rule in RULES:
        if when in rule.points:
            refusal = rule.check(cfg, facts)
            if isinstance(refusal, Refusal):
                raise ConfigError(refusal.message, key=refusal.key)
            if refusal is not None:
                raise ConfigError(refusal, key=rule.key)
