"""The one line an engine logs once it is built, on its first rank: what runs (ZeRO stage,
ranks, precision, offload) and the model state each rank holds. For example::

    ds_strategy: ZeRO-3 on 2 ranks, bf16 (fp32 master weights), optimizer offload cpu;
    model state per rank 12.3 MiB now (params 2.1 MiB, grads 2.1 MiB, optimizer 8.1 MiB),
    24.6 MiB by the ZeRO-3 formula with Adam

The figures are ``memory_report()``'s (this rank's, read locally: no collective) and the
paper's formula over the engine's flat groups (``memory_timeline.zero_formula_bytes``). The
optimizer's state appears at its first step (and at stages 2 and 3 the gradient shard at the
first backward), so a freshly built engine states 0 bytes of it and says so; the formula counts Adam's two moments (and the fp32 master under mixed
precision) as if they were there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroOptimizationConfig
from .memory import human_bytes
from .precision.loss_scaler import LossScaler
from .precision.policy import PrecisionPolicy

__all__ = ["RankCounts", "start_summary"]

_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class RankCounts:
    """How many ranks the engine runs on: ``dp`` data-parallel ranks, of which ZeRO shards
    over ``shard`` (fewer under MiCS), ``tp`` tensor-parallel ranks each, in a pipeline,
    stage ``stage`` of ``stages``, and experts spread over ``ep`` ranks."""

    dp: int
    shard: int
    tp: int = 1
    stage: int | None = None
    stages: int = 1
    ep: int = 1


def start_summary(
    stage: int,
    ranks: RankCounts,
    precision: PrecisionPolicy,
    scaler: LossScaler | None,
    zero_config: ZeroOptimizationConfig,
    memory: dict[str, int],
    formula_bytes: float,
) -> str:
    """The line (see the module); ``zero_config``: the config's ``zero_optimization``."""
    what = ", ".join(
        [
            f"ZeRO-{stage} on {_ranks(ranks)}",
            _precision(precision, scaler),
            _offload(zero_config),
        ]
    )
    return f"ds_strategy: {what}; {_memory(memory, formula_bytes, stage)}"


def _ranks(r: RankCounts) -> str:
    plural = "s" if r.dp != 1 else ""
    if r.tp == 1 and r.stage is None:
        out = f"{r.dp} rank{plural}"
    else:
        out = f"{r.dp} data-parallel rank{plural}"
        if r.tp > 1:
            out += f" x {r.tp} tensor-parallel"
        if r.stage is not None:
            out += f", pipeline stage {r.stage} of {r.stages}"
    if r.shard != r.dp:
        out += f" (sharded over groups of {r.shard})"
    if r.ep > 1:
        out += f", experts over {r.ep} ranks"
    return out


def _precision(policy: PrecisionPolicy, scaler: LossScaler | None) -> str:
    name = _NAMES.get(str(policy.param_dtype).removeprefix("torch."), str(policy.param_dtype))
    if scaler is not None:
        kind = "dynamic" if scaler.dynamic else "static"
        scaled = f"{name} with {kind} loss scaling (scale {scaler.scale:g})"
        return scaled + (f", {name} master weights" if policy.low_master else "")
    parts = []
    if policy.mixed and policy.master_weights:
        parts.append("fp32 master weights")
    elif policy.low_master:
        parts.append(f"{name} master weights, stochastic rounding")
    if policy.state_dtype is not None:
        state = str(policy.state_dtype).removeprefix("torch.")
        parts.append(f"{_NAMES.get(state, state)} optimizer states")
    return f"{name} ({', '.join(parts)})" if parts else name


def _offload(zc: ZeroOptimizationConfig) -> str:
    parts = []
    for what, section in (("optimizer", zc.offload_optimizer), ("parameter", zc.offload_param)):
        device = str(section.device)
        if device == "none":
            continue
        where = f" ({section.nvme_path})" if device == "nvme" else ""
        parts.append(f"{what} offload {device}{where}")
    return ", ".join(parts) or "no offload"


def _memory(report: dict[str, int], formula_bytes: float, stage: int) -> str:
    optimizer = human_bytes(report["optimizer_state"])
    if report["optimizer_state"] == 0:
        optimizer += " until the first step"
    grads = human_bytes(report["grads"])
    if report["grads"] == 0 and stage >= 2:  # the shard comes with the first backward
        grads += " until the first backward"
    parts = [
        f"params {human_bytes(report['params'])}",
        f"grads {grads}",
        f"optimizer {optimizer}",
    ]
    if report.get("compression_state"):
        parts.append(f"compression {human_bytes(report['compression_state'])}")
    if "expert_params" in report:
        experts = report["expert_params"] + report["expert_grads"]
        experts += report["expert_optimizer_state"]
        parts.append(f"of which experts {human_bytes(experts)}")
    line = f"model state per rank {human_bytes(report['total'])} now ({', '.join(parts)})"
    if report.get("offloaded_nvme"):
        line += f", {human_bytes(report['offloaded_nvme'])} more in nvme_path"
    formula = human_bytes(round(formula_bytes))
    return f"{line}, {formula} by the ZeRO-{stage} formula with Adam"
