"""Mixed precision: bf16 and fp16 with fp32 master weights in every stage, the fp16 loss
scaler, overflow handling across ranks, and the K=12 memory formulas."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import ds_strategy
from ds_strategy.config import FP16Config
from ds_strategy.core.memory import live_tensor_bytes
from ds_strategy.core.precision.loss_scaler import LossScaleAtMinimumError, LossScaler
from tests.distributed import run_ranks
from tests.models import ToyLM, batches, lm_loss
from tests.test_memory_comm import THRESHOLD, mlp

GB = 8
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
BF16 = {"bf16": {"enabled": True}}


# -- the loss-scale state machine, in one process ------------------------------------------------


def test_dynamic_scale_halves_on_overflow_and_grows_after_a_clean_window() -> None:
    s = LossScaler.from_config(
        FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=1)
    )
    assert s.scale == 16 and s.dynamic
    s.update(overflow=True)
    assert s.scale == 8
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 8
    s.update(overflow=False)  # the clean step after a window of 3 clean steps, as DeepSpeed
    assert s.scale == 16
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 16
    s.update(overflow=False)  # then every third clean step
    assert s.scale == 32


def test_hysteresis_delays_the_decrease() -> None:
    s = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2))
    s.update(overflow=True)
    assert s.scale == 16  # first overflow only spends the allowance
    s.update(overflow=True)
    assert s.scale == 8


def test_stuck_at_min_scale_is_an_error_not_an_endless_skip() -> None:
    s = LossScaler.from_config(
        FP16Config(enabled=True, initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    )
    s.update(overflow=True)
    assert s.scale == 1.0
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        s.update(overflow=True)


def test_static_scale_never_changes() -> None:
    s = LossScaler.from_config(FP16Config(enabled=True, loss_scale=128.0))
    for overflow in (True, False, True):
        s.update(overflow=overflow)
    assert s.scale == 128.0 and not s.dynamic


# -- overflow on one rank skips the step on every rank ------------------------------------------


def overflow_worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        {"zero_optimization": {"stage": stage}, **FP16},
    )
    per = GB // world
    data = batches(3, 1, GB)
    for batch in data[:2]:
        engine.backward(lm_loss(engine, batch[rank * per : (rank + 1) * per]))
        engine.step()
    before = engine.full_state_dict()
    opt_before = {
        id(t): {k: v.clone() for k, v in st.items()} for t, st in engine.optimizer.state.items()
    }
    scale = engine.loss_scale
    loss = lm_loss(engine, data[2][rank * per : (rank + 1) * per])
    if rank == 1:
        loss = loss * float("inf")  # only this rank overflows
    engine.backward(loss)
    engine.step()
    after = engine.full_state_dict()
    same_opt = all(
        torch.equal(v, opt_before[id(t)][k])
        for t, st in engine.optimizer.state.items()
        for k, v in st.items()
    )
    return {
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "same_opt": same_opt,
        "scales": (scale, engine.loss_scale),
        "skipped": engine.skipped_steps,
        "steps": engine.global_steps,
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_inf_on_one_rank_skips_the_step_everywhere(stage: int) -> None:
    for r in run_ranks(overflow_worker, 2, stage):
        assert r["unchanged"], "weights changed on an overflowed step"
        assert r["same_opt"], "optimizer state changed on an overflowed step"
        assert r["scales"][1] == r["scales"][0] / 2  # hysteresis 1: halved at once
        assert r["skipped"] == 1 and r["steps"] == 3


# -- bf16 / fp16 track the fp32 loss curve ---------------------------------------------------------


def curve_worker(rank: int, world: int) -> dict:
    data = batches(1, 1, GB, seed=4) * 8  # one batch, memorised: the loss must fall
    per = GB // world
    curves = {}
    for name, extra in (("fp32", {}), ("bf16", BF16), ("fp16", FP16)):
        for stage in (1, 2, 3):
            if name == "fp32" and stage != 1:
                continue
            torch.manual_seed(0)
            model = ToyLM()
            model.embed.weight.data.mul_(0.05)  # GPT-like init: logits of order one
            config = {"zero_optimization": {"stage": stage}, "gradient_clipping": 1.0, **extra}
            engine = ds_strategy.initialize(
                model, torch.optim.AdamW(model.parameters(), lr=3e-3), config
            )
            losses = []
            for batch in data:
                loss = lm_loss(engine, batch[rank * per : (rank + 1) * per])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            curves[(name, stage)] = (
                losses,
                engine.skipped_steps,
                str(next(iter(engine.full_state_dict().values())).dtype),
            )
    return curves


def test_bf16_and_fp16_track_the_fp32_loss_curve() -> None:
    curves = run_ranks(curve_worker, 2)[0]
    ref = torch.tensor(curves[("fp32", 1)][0])
    assert ref[-1] < ref[0] - 0.2  # it learned something
    for (name, stage), (losses, skipped, dtype) in curves.items():
        got = torch.tensor(losses)
        # stated tolerance: every step's loss within 2% of fp32's (bf16 keeps 8 mantissa bits)
        rel = float(((got - ref) / ref).abs().max())
        assert rel <= 0.02, f"{name} stage {stage}: loss curve differs from fp32 by {rel:.2%}"
        assert skipped == 0 and dtype == "torch.float32"  # consolidated weights come back in fp32


# -- memory with mixed precision: K = 12 ---------------------------------------------------------------


def bf16_memory_worker(rank: int, world: int, stage: int, master: bool) -> dict:
    baseline = live_tensor_bytes()
    model = mlp()
    config = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": THRESHOLD},
        "bf16": {"enabled": True, "master_weights": master},
    }
    engine = ds_strategy.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.backward(engine(torch.randn(8, 256, generator=g)).square().mean())
        engine.step()
    return {
        "measured": live_tensor_bytes() - baseline,
        "psi": sum(p.numel() for p in mlp().parameters()),
        "persistent": sum(p.numel() for p in mlp().parameters() if p.numel() < THRESHOLD),
    }


def k12_formula(stage: int, psi: int, n: int, persistent: int) -> float:
    if stage == 1:
        return 2 * psi + 2 * psi + 12 * psi / n
    if stage == 2:
        return 2 * psi + 14 * psi / n
    sharded = psi - persistent
    return 16 * sharded / n + 2 * persistent + 14 * persistent / n


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_model_state_matches_k12_formula(stage: int) -> None:
    for r in run_ranks(bf16_memory_worker, 2, stage, True):
        expected = k12_formula(stage, r["psi"], 2, r["persistent"])
        assert 0.95 <= r["measured"] / expected <= 1.05, (r["measured"], expected)


def test_bf16_without_master_weights_holds_less() -> None:
    with_master = run_ranks(bf16_memory_worker, 2, 3, True)[0]["measured"]
    without = run_ranks(bf16_memory_worker, 2, 3, False)[0]["measured"]
    # stage 3 without a master: 2 (params) + 2 (grads) + 4 (bf16 Adam moments) bytes per element
    assert without < 0.6 * with_master


# -- the loss scaler's state is part of checkpoints ---------------------------------------------------


def scaler_ckpt_worker(rank: int, world: int, path: str) -> tuple:
    torch.manual_seed(0)
    model = ToyLM()
    config = {"zero_optimization": {"stage": 2}, **FP16}
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    engine.backward(lm_loss(engine, batches(1, 1, GB)[0]) * float("inf"))  # overflow: scale halves
    engine.step()
    engine.save_checkpoint(path)
    fresh_model = copy.deepcopy(ToyLM())
    fresh = ds_strategy.initialize(
        fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-2), config
    )
    fresh.load_checkpoint(path)
    return engine.loss_scale, fresh.loss_scale, fresh.skipped_steps


def test_loss_scaler_state_survives_save_and_load(tmp_path: Path) -> None:
    saved, loaded, skipped = run_ranks(scaler_ckpt_worker, 2, str(tmp_path / "ckpt"))[0]
    assert saved == 2.0**7 and loaded == saved and skipped == 1


# -- gradient_predivide_factor / prescale_gradients -------------------------------------------------


def predivide_worker(rank: int, world: int) -> dict:
    per = GB // world
    data = batches(3, 1, GB, seed=9)
    out = {}
    for name, extra in (
        ("post", {}),
        ("prescale", {"prescale_gradients": True}),
        ("predivide", {"gradient_predivide_factor": 4.0}),
    ):
        torch.manual_seed(0)
        model = ToyLM()
        ref = copy.deepcopy(model)
        engine = ds_strategy.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            {"zero_optimization": {"stage": 2}, **extra},
        )
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        for batch in data:
            engine.backward(lm_loss(engine, batch[rank * per : (rank + 1) * per]))
            engine.step()
            lm_loss(ref, batch).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        got, want = engine.full_state_dict(), ref.state_dict()
        out[name] = max(float((got[k] - want[k]).abs().max()) for k in want)
    return out


def test_gradient_predivide_and_prescale_average_exactly() -> None:
    r = run_ranks(predivide_worker, 2)[0]
    assert all(v <= 2e-5 for v in r.values()), r


def comm_dtype_worker(rank: int, world: int) -> dict:
    out = {}
    for name, extra in (("bf16", {}), ("fp32", {"communication_data_type": "fp32"})):
        torch.manual_seed(0)
        model = ToyLM()
        config = {"zero_optimization": {"stage": 2}, **BF16, **extra}
        engine = ds_strategy.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), config
        )
        engine.backward(lm_loss(engine, batches(1, 1, GB)[0]))
        engine.step()
        report = engine.comm_report()
        out[name] = (report["reduce_scatter"], report["all_gather"])
    return out


def test_communication_data_type_sets_the_reduction_dtype() -> None:
    r = run_ranks(comm_dtype_worker, 2)[0]
    assert r["fp32"][0] == 2 * r["bf16"][0]  # gradients reduced in fp32: twice the bytes
    assert r["fp32"][1] == r["bf16"][1]  # parameters still gathered in bf16


def test_one_log_line_per_overflow(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), FP16)
    with caplog.at_level("WARNING", logger="ds_strategy"):
        engine.backward(engine(torch.randn(2, 4)).sum() * float("inf"))
        engine.step()
    lines = [r for r in caplog.records if "overflow" in r.getMessage()]
    assert len(lines) == 1 and "loss scale 256 -> 128" in lines[0].getMessage()
