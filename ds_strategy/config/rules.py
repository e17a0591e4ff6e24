"""Which features combine: one table of rules over a resolved config and the facts of the job
it runs in, each refusal a :class:`ConfigError` naming the key, the reason and the fix.

[Note: the rule table]
A rule is a named check of one feature (its ``key``) against the others; it returns what it
refuses (empty: nothing). :func:`check_rules` runs the rules that apply at one point of
building an engine (the config as it is read; then resolved; later the data-parallel ranks,
the optimizer, whether the engine is a pipeline stage) and raises the first refusal. The engine
runs them inside its agreement points, so every rank raises the same error. Rules whose
checks need only the config run when the engine starts; the rest once their facts exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._schema import ConfigError, ZeroConfig

__all__ = ["Facts", "RULES", "Rule", "check_rules"]


@dataclass(frozen=True)
class Facts:
    """What an engine knows besides its config when a rule runs.

    Attributes:
        world_size: the data-parallel ranks ZeRO shards over.
        ranks_per_machine: from the topology, for the fixes that name it.
        in_pipeline: the engine is one pipeline stage's.
        tensor_parallel: layers split over tensor-parallel ranks.
        offload: an offload tier is on (optimizer state or parameters).
        optimizer: the optimizer's class name (``""`` before it is known).
        compressed_optimizer: it exchanges compressed momenta or updates (1-bit Adam/LAMB,
            0/1 Adam).
        local_steps: it steps locally between synchronisations (0/1 Adam).
    """

    world_size: int = 1
    ranks_per_machine: int = 1
    in_pipeline: bool = False
    tensor_parallel: bool = False
    offload: bool = False
    optimizer: str = ""
    compressed_optimizer: bool = False
    local_steps: bool = False


Check = Callable[[ZeroConfig, Facts], str | None]


@dataclass(frozen=True)
class Rule:
    """``check`` returns the whole message of a refusal (reason and fix), or None."""

    name: str
    key: str
    # "load": as the config is read ("auto" values may remain); "config": the resolved config
    # alone; "ranks": with the ranks; "optimizer": with the optimizer
    when: str
    check: Check


def _offload_optimizer_stage(cfg: ZeroConfig, facts: Facts) -> str | None:
    zc = cfg.zero_optimization
    if zc.offload_optimizer.device != "none" and zc.stage == 0:
        return (
            f"zero_optimization.offload_optimizer: device {zc.offload_optimizer.device!r} needs "
            "ZeRO stage 1, 2 or 3 (the offloaded state is this rank's shard); set "
            "zero_optimization.stage or offload_optimizer.device to 'none'"
        )
    return None


def _offload_param_stage(cfg: ZeroConfig, facts: Facts) -> str | None:
    zc = cfg.zero_optimization
    if zc.offload_param.device != "none" and zc.stage != 3:
        return (
            f"zero_optimization.offload_param: device {zc.offload_param.device!r} needs ZeRO "
            f"stage 3 (only stage 3 partitions parameters), but stage is {zc.stage}; set "
            "zero_optimization.stage to 3 or offload_param.device to 'none'"
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


def _fp16_and_bf16(cfg: ZeroConfig, facts: Facts) -> str | None:
    if cfg.fp16.enabled is True and cfg.bf16.enabled is True:
        return (
            "fp16.enabled: fp16 and bf16 cannot both be enabled; set fp16.enabled or "
            "bf16.enabled to false"
        )
    return None


def _compression_layouts(cfg: ZeroConfig, facts: Facts) -> str | None:
    if cfg.gradient_compression.method == "none":
        return None
    key = "gradient_compression.method"
    if cfg.zero_optimization.stage == 3:
        return (
            f"{key}: gradient compression runs with ZeRO stages 0, 1 and 2 (stage 3 reduces "
            "each layer's gradients as backward produces them); set zero_optimization.stage "
            "to 2 or lower, or method to 'none'"
        )
    if cfg.tensor_parallel.autotp_size != 1:
        return (
            f"{key}: gradient compression with tensor_parallel is not available yet; set "
            "tensor_parallel.autotp_size to 1 or method to 'none'"
        )
    if cfg.pipeline.stages > 1:
        return (
            f"{key}: gradient compression is not available with pipeline stages; remove the "
            "pipeline section or set method to 'none'"
        )
    return None


RULES: tuple[Rule, ...] = (
    Rule("fp16 or bf16", "fp16.enabled", "load", _fp16_and_bf16),
    Rule("gradient compression's layouts", "gradient_compression.method", "load",
         _compression_layouts),
    Rule("offload_optimizer needs a sharding stage", "zero_optimization.offload_optimizer",
         "config", _offload_optimizer_stage),
    Rule("offload_param needs stage 3", "zero_optimization.offload_param", "config",
         _offload_param_stage),
    Rule("MiCS with other features", "zero_optimization.mics_shard_size", "ranks",
         _mics_combinations),
    Rule("MiCS shard groups divide the ranks", "zero_optimization.mics_shard_size", "ranks",
         _mics_divides),
    Rule("gradient compression with MiCS", "zero_optimization.mics_shard_size", "optimizer",
         _compression_with_mics),
    Rule("1-bit and 0/1 optimizers with other features", "optimizer", "optimizer",
         _compressed_optimizer),
)  # fmt: skip


def check_rules(cfg: ZeroConfig, facts: Facts, when: str) -> None:
    """Run the rules of one point (``"load"``, then building an engine: ``"config"``,
    ``"ranks"``, ``"optimizer"``); raise the first refusal as a :class:`ConfigError` naming
    its key."""
    for rule in RULES:
        if rule.when == when:
            message = rule.check(cfg, facts)
            if message is not None:
                raise ConfigError(message, key=rule.key)
