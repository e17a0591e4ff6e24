"""``flops_profiler``: per-module FLOPs, MACs, parameters and latency at the profile step,
in DeepSpeed's layout and as ``engine.flops_report()``.

[Note: the analytic count of the demo GPT]
Per token and layer the forward's matmuls are q/k/v (2·d·3d), the projection (2·d·d) and the
MLP (2·d·4d + 2·4d·d): 24·d² FLOPs; attention adds q·kᵀ and attn·v, 2·s·d each, whole
(a causal mask is not subtracted, as torch and Megatron count it): 4·s·d; the head 2·d·V.
For B sequences of s tokens the forward is 24·B·s·L·d² + 4·B·s²·L·d + 2·B·s·d·V and
training, backward counted as two forwards, three times that:
72·B·s·L·d²·(1 + s/(6d) + V/(12·L·d)), Megatron's formula (Narayanan et al. 2021) without
recomputation; i.e. 6 x matmul parameters x tokens plus attention's 12·L·s²·d·B.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import load_config
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss

from .distributed import run_ranks

KEYS = {
    "step", "world_size", "dp_size", "mp_size", "batch_size", "params", "fwd_flops",
    "fwd_macs", "bwd_flops", "train_flops", "recompute_fwd_factor", "fwd_latency_s",
    "bwd_latency_s", "fwd_bwd_latency_s", "step_latency_s", "iter_latency_s", "latency_step",
    "fwd_tflops", "bwd_tflops", "fwd_bwd_tflops", "achieved_tflops", "peak_tflops", "peak_source", "mfu",
    "samples_per_second", "modules",
}  # fmt: skip
GPT_SHAPE = GPTConfig(vocab=256, d=32, layers=2, heads=4, seq=16)
BATCH = 3


def test_linear_flops_are_exact_and_the_profile_is_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    out = tmp_path / "flops.txt"
    config = {"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(out)}}
    engine = ds_strategy.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), config)
    for _ in range(3):
        engine.backward(engine(torch.randn(5, 16)).sum())
        engine.step()
    r = engine.flops_report()
    assert set(r) == KEYS
    mods = r["modules"]
    assert mods["0"]["flops"] == 2 * 5 * 16 * 32 and mods["0"]["macs"] == 5 * 16 * 32
    assert mods["2"]["flops"] == 2 * 5 * 32 * 4
    assert mods["1"]["flops"] == 0  # element-wise work is not counted
    assert r["fwd_flops"] == mods[""]["flops"] == 2 * 5 * (16 * 32 + 32 * 4)
    assert r["train_flops"] == 3 * r["fwd_flops"] and r["bwd_flops"] == 2 * r["fwd_flops"]
    assert mods["0"]["params"] == 16 * 32 + 32 and r["params"] == sum(
        p.numel() for p in m.parameters()
    )
    assert (r["step"], r["latency_step"], r["batch_size"]) == (1, 0, 5)
    assert r["peak_source"].startswith("measured") and 0 < r["mfu"] < 1
    assert r["fwd_latency_s"] > 0 and r["iter_latency_s"] >= r["fwd_latency_s"]
    assert r["fwd_bwd_latency_s"] == pytest.approx(r["fwd_latency_s"] + r["bwd_latency_s"])
    text = out.read_text()
    assert "DeepSpeed Flops Profiler" in text and "Profile Summary at step 1:" in text
    assert "(0): Linear(" in text and "fwd MACs per GPU:" in text


def test_disabled_by_default() -> None:
    m = nn.Linear(4, 4)
    engine = ds_strategy.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), {})
    assert engine.flops_profiler is None and engine.flops_report() == {}


def test_the_section_is_typed_and_no_longer_unsupported() -> None:
    section = {"enabled": True, "recompute_fwd_factor": 1, "profile_step": 3, "module_depth": 2,
               "top_modules": 3, "detailed": False, "output_file": None, "peak_tflops": 989}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"flops_profiler": section}).resolve(1).flops_profiler
    assert (cfg.recompute_fwd_factor, cfg.profile_step, cfg.peak_tflops) == (1.0, 3, 989.0)


def _gpt_reports(rank: int, world: int) -> dict[int, dict[str, Any]]:
    tokens = torch.randint(0, GPT_SHAPE.vocab, (BATCH, GPT_SHAPE.seq + 1),
                           generator=torch.Generator().manual_seed(rank))  # fmt: skip
    reports = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = GPT(GPT_SHAPE)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        profiler = {"enabled": True, "profile_step": 3, "peak_tflops": 1.0, "detailed": False}
        engine = ds_strategy.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3),
            {"zero_optimization": zero, "flops_profiler": profiler},
        )  # fmt: skip
        for _ in range(5):
            engine.backward(gpt_loss(engine, tokens))
            engine.step()
        reports[stage] = engine.flops_report()
    return reports


def test_gpt_matches_the_analytic_count_and_zero3_counts_full_shapes() -> None:
    results = run_ranks(_gpt_reports, 2, timeout=180)
    c, b = GPT_SHAPE, BATCH
    L, d, s, V = c.layers, c.d, c.seq, c.vocab
    analytic = 72 * b * s * L * d * d * (1 + s / (6 * d) + V / (12 * L * d))
    for rank, reports in enumerate(results):
        base, sharded = reports[0], reports[3]
        assert base["step"] == 3
        assert base["train_flops"] == pytest.approx(analytic, rel=0.02), rank
        # ZeRO-3 with every weight sharded gathers full parameters for the forward: the
        # same counts, module by module, as unsharded
        for key in ("fwd_flops", "params", "batch_size"):
            assert sharded[key] == base[key], (rank, key)
        for name, mod in base["modules"].items():
            got = sharded["modules"][name]
            assert (got["flops"], got["params"]) == (mod["flops"], mod["params"]), name
        q = base["modules"]["blocks.0.qkv"]
        assert q["flops"] == 2 * b * s * d * 3 * d and q["params"] == d * 3 * d + 3 * d
        assert base["params"] == sum(p.numel() for p in GPT(c).parameters())
