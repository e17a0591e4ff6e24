"""The rule table (config/rules.py): every rule refuses what it is for, at its point only, with a
ConfigError naming its key and the fix; a default config passes every point."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from ds_strategy.config import ConfigError, ZeroConfig, load_config
from ds_strategy.config.rules import RULES, Facts, Refusal, Rule, check_rules

_ZO = "zero_optimization"
_POINTS = sorted({p for rule in RULES for p in rule.points})

# rule name -> (config as written, facts, a point it runs at, key, fragment of the message)
CASES: dict[str, tuple[dict[str, Any], Facts, str, str, str]] = {
    "fp16 or bf16": (
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        Facts(), "load", "fp16.enabled", "cannot both be enabled",
    ),
    "gradient compression's layouts": (
        {_ZO: {"stage": 3}, "gradient_compression": {"method": "topk"}},
        Facts(), "load", "gradient_compression.method", "ZeRO stages 0, 1 and 2",
    ),
    "NVMe offload needs a directory": (
        {_ZO: {"stage": 3, "offload_param": {"device": "nvme"}}},
        Facts(), "load", f"{_ZO}.offload_param.nvme_path", "required when device is 'nvme'",
    ),
    "offload_param needs stage 3": (
        {_ZO: {"stage": 2, "offload_param": {"device": "cpu"}}},
        Facts(), "load", f"{_ZO}.offload_param", "set zero_optimization.stage to 3",
    ),
    "partial optimizer offload needs stage 3": (
        {_ZO: {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
        Facts(), "load", f"{_ZO}.offload_optimizer.ratio", "or ratio to 1.0",
    ),
    "dynamic loss scaling's window, floor and hysteresis": (
        {"fp16": {"enabled": True, "min_loss_scale": 0}},
        Facts(), "load", "fp16.min_loss_scale", "must be > 0 when fp16 is enabled",
    ),
    "quantization-aware training needs bits": (
        {"quantization": {"qat": True}},
        Facts(), "load", "quantization.bits", "set bits to 8 or 4",
    ),
    "a ZeroEngine is no pipeline": (
        {"pipeline": {"stages": 2}},
        Facts(), "engine", "pipeline.stages", "set pipeline.stages to 1 here",
    ),
    "tensor parallelism on the default group": (
        {"tensor_parallel": {"autotp_size": 2}},
        Facts(sub_group=True), "engine", "tensor_parallel.autotp_size", "process sub-group",
    ),
    "offload_optimizer needs a sharding stage": (
        {_ZO: {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        Facts(), "inference", f"{_ZO}.offload_optimizer", "stage 1, 2 or 3",
    ),
    "one NVMe directory": (
        {_ZO: {"stage": 3,
               "offload_param": {"device": "nvme", "nvme_path": "/a"},
               "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}},
        Facts(), "config", f"{_ZO}.offload_param.nvme_path", "use one directory for both",
    ),
    "MiCS with other features": (
        {_ZO: {"stage": 0, "mics_shard_size": 2}},
        Facts(world_size=4), "ranks", f"{_ZO}.mics_shard_size", "shards nothing",
    ),
    "MiCS shard groups divide the ranks": (
        {_ZO: {"stage": 1, "mics_shard_size": 3}},
        Facts(world_size=4), "ranks", f"{_ZO}.mics_shard_size", "does not divide the 4",
    ),
    "hpZ's secondary groups divide the ranks": (
        {_ZO: {"stage": 3, "zero_hpz_partition_size": 3}},
        Facts(world_size=4, ranks_per_machine=2), "ranks",
        f"{_ZO}.zero_hpz_partition_size", "does not divide the 4 data-parallel ranks",
    ),
    "gradient compression with MiCS": (
        {_ZO: {"stage": 1, "mics_shard_size": 2}, "gradient_compression": {"method": "topk"}},
        Facts(world_size=4), "optimizer", f"{_ZO}.mics_shard_size", "remove one of them",
    ),
    "1-bit and 0/1 optimizers with other features": (
        {_ZO: {"stage": 1}},
        Facts(optimizer="OneBitAdam", compressed_optimizer=True, in_pipeline=True),
        "optimizer", "optimizer", "pipeline stages",
    ),
    "sequence and context parallelism with other features": (
        {"sequence_parallel_size": 2, _ZO: {"stage": 2, "mics_shard_size": 2}},
        Facts(world_size=4), "optimizer", "sequence_parallel_size", "mics_shard_size",
    ),
    "expert parallelism with other features": (
        {"moe": {"ep_size": 2}, _ZO: {"stage": 2, "mics_shard_size": 2}},
        Facts(world_size=4, tensor_parallel=True), "optimizer", "moe.ep_size",
        "tensor parallelism (set tensor_parallel.autotp_size to 1); zero_optimization.mics",
    ),
    "low-precision masters and states with other features": (
        {
            "bf16": {"enabled": True, "bf16_optimizer_states": True},
            _ZO: {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
        },
        Facts(optimizer="AdamW"), "optimizer", "bf16.bf16_master_weights_and_grads",
        "bf16.bf16_optimizer_states steps the optimizer a chunk at a time in fp32 and does not "
        "work with NVMe offload",
    ),
    "low-bit optimizer states with other features": (
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
        Facts(optimizer="AdamW8bit"), "optimizer", "optimizer",
        "AdamW8bit keeps quantized optimizer state, which does not work with "
        "bf16.bf16_optimizer_states",
    ),
    "momentum correction replaces SGD's momentum": (
        {"gradient_compression": {"method": "topk", "momentum_correction": True}},
        Facts(optimizer="AdamW", momenta=(0.0,)), "compression",
        "gradient_compression.momentum_correction", "needs torch.optim.SGD with one momentum",
    ),
    "quantization-aware training without tensor parallelism": (
        {"quantization": {"bits": 8, "qat": True}},
        Facts(tensor_parallel=True), "quantization", "quantization.qat",
        "quantization.qat with tensor_parallel",
    ),
    "chunks per rank need the interleaved schedule": (
        {"pipeline": {"stages": 2, "stages_per_rank": 2, "schedule": "1f1b"}},
        Facts(), "pipeline", "pipeline.stages_per_rank", "need schedule 'interleaved_1f1b'",
    ),
    "interleaved 1F1B's micro-batches": (
        {"pipeline": {"stages": 2, "schedule": "interleaved_1f1b"},
         "gradient_accumulation_steps": 3},
        Facts(), "pipeline", "gradient_accumulation_steps", "divisible by pipeline.stages (2)",
    ),
    "weights tied across stages below stage 3": (
        {_ZO: {"stage": 3}},
        Facts(tied_stages=(0, 1)), "stages", f"{_ZO}.stage", "shared by pipeline stages [0, 1]",
    ),
    "inference shards one way": (
        {_ZO: {"stage": 3}, "tensor_parallel": {"autotp_size": 2}},
        Facts(), "inference", "tensor_parallel.autotp_size", "one way at a time",
    ),
    "inference has nothing for stages 1 and 2": (
        {_ZO: {"stage": 2}},
        Facts(), "inference", f"{_ZO}.stage", "inference has no optimizer state",
    ),
    "inference without quantization-aware training": (
        {"quantization": {"bits": 4, "qat": True}},
        Facts(), "inference", "quantization.qat", "set bits and leave qat false",
    ),
}  # fmt: skip


def _config(raw: dict[str, Any], point: str) -> ZeroConfig:
    """The config as a rule of ``point`` sees it: load rules the walker runs itself, so a
    refused one is built without it; the others see the resolved config."""
    if point == "load":
        return dataclasses.replace(ZeroConfig(), **_sections(raw))
    return load_config(raw, strict=True).resolve(world_size=1)


def _sections(raw: dict[str, Any]) -> dict[str, Any]:
    # build each section without the load-time rules, which run on the whole config only
    from ds_strategy.config._load import Found, _build, _schema

    out = {}
    for name, value in raw.items():
        f = _schema(ZeroConfig)[name]
        if f.kind == "section":
            assert f.section is not None
            out[name] = _build(f.section, value, name, f.default(), Found())
        else:
            out[name] = value
    return out


def test_every_rule_has_a_case_and_a_unique_name() -> None:
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert set(CASES) == set(names)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_a_rule_refuses_at_its_point_naming_its_key(rule: Rule) -> None:
    raw, facts, point, key, fragment = CASES[rule.name]
    assert point in rule.points
    cfg = _config(raw, point)
    refusal = rule.check(cfg, facts)
    assert refusal is not None
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        check_rules(cfg, facts, point)
    assert info.value.key == key
    message = refusal.message if isinstance(refusal, Refusal) else refusal
    assert str(info.value) == message
    # the fix is part of the message: what to set or use instead
    assert re.search(r"\b(set|use|remove|keep|make|change|leave|build|train)\b", message), message
    for other in _POINTS:
        if other not in rule.points:  # points run only their own rules
            refused = [r.name for r in RULES if other in r.points and r.check(cfg, facts)]
            assert rule.name not in refused


@pytest.mark.parametrize("point", _POINTS)
def test_a_default_config_passes_every_point(point: str) -> None:
    check_rules(ZeroConfig().resolve(world_size=4), Facts(world_size=4), point)


def test_load_rules_wait_for_auto_values() -> None:
    # "auto" is not a refusal: the rule runs again on the resolved config
    cfg = load_config(
        {
            _ZO: {"stage": "auto", "offload_param": {"device": "cpu"}},
            "fp16": {"enabled": True, "loss_scale": "auto", "hysteresis": 0},
            "gradient_compression": {"method": "auto"},
            "tensor_parallel": {"autotp_size": "auto"},
        }
    )
    assert cfg.zero_optimization.stage == "auto"
    with pytest.raises(ConfigError, match="needs ZeRO stage 3") as info:
        cfg.resolve(world_size=1)  # the default stage, 0, is then refused
    assert info.value.key == f"{_ZO}.offload_param"
    ok = cfg.resolve(1, {f"{_ZO}.stage": 3, "fp16.loss_scale": 128})
    assert ok.zero_optimization.stage == 3 and ok.fp16.hysteresis == 0  # static scale: unused


def test_the_loader_reports_a_rule_with_the_file(tmp_path: Any) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"quantization": {"qat": true}}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "quantization.bits" and info.value.path == str(path)
    assert str(info.value).startswith(f"{path}: quantization.bits: qat trains")
