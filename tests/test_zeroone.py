"""DeepSpeed's 0/1 Adam (``ZeroOneAdam``) in the engine, 2 gloo ranks at ZeRO stage 0: its
schedule is DeepSpeed's, its variance steps are dense Adam, each kind of step sends what it
promises (1-bit steps under 1/16 of fp32, local steps nothing), local steps move the replicas
apart and a sync brings them together, the demo GPT trains to within 3% of dense Adam, an
overflow skips everywhere, a checkpoint taken between syncs resumes, and stages above 0 are
refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.core.optim import ZeroOneAdam
from ds_strategy.core.optim.zeroone import zero_one_kind
from tests.compression_common import corpus_losses
from tests.distributed import run_ranks, run_ranks_each
from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches, lm_loss, make_optimizer

STEPS, ACCUM, CLIP = 10, 2, 0.5


def toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def _deepspeed_kinds(n: int, freeze: int, scaler: int, local_scaler: int, clipper: int) -> list:
    """DeepSpeed's counters, step by step as its ZeroOneAdam keeps them: its step() count
    starts with one call that only allocates buffers; the variance phase lasts while the
    count before the step is at most var_freeze_step."""
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    kinds = []
    for count in range(2, n + 2):  # DeepSpeed's count of the real steps 1..n
        if count - 1 <= freeze:
            dense = count % var_interval == 0
            kinds.append("dense" if dense else "onebit")
            if dense:
                var_counter += 1
                if var_counter == scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            kinds.append("sync" if count % local_interval == 0 else "local")
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
    return kinds


@pytest.mark.parametrize(
    "schedule", [(12500, 16, 32678, 16), (300, 3, 5, 16), (40, 1, 1, 4), (0, 16, 2, 8)]
)
def test_the_schedule_is_deepspeeds(schedule: tuple[int, int, int, int]) -> None:
    n = 3000
    ours = [zero_one_kind(t, *schedule) for t in range(1, n + 1)]
    assert ours == _deepspeed_kinds(n, *schedule)
    assert set(ours) >= ({"local", "sync"} if schedule[0] < n else {"dense", "onebit"})


def _dense(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    config = parity_config(0, ACCUM, CLIP)
    engine = train_engine(toy(), "zeroone@1000,1000000,1,1", config, data, rank, world, STEPS)
    return engine.full_state_dict(), engine.comm_report()


def test_variance_steps_are_dense_adam_without_bias_correction() -> None:
    data = batches(STEPS, ACCUM, 8)
    expected = train_reference(toy(), "adamw-nobc", data, STEPS, ACCUM, CLIP)
    for state, report in run_ranks(_dense, 2, data):
        worst = max((state[k] - v).abs().max().item() for k, v in expected.items())
        assert worst <= 2e-5, worst
        assert "onebit" not in report and report["all_reduce"] > 0


SCHEDULE = "zeroone@6,2,2,4"  # variance phase with 1-bit steps, then local steps and syncs


def _steps(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    """Per step: its kind, what it sent, and this rank's weights after it."""
    model = toy()
    engine = ds_strategy.initialize(
        model, make_optimizer(SCHEDULE, model), parity_config(0, 1, 1.0)
    )
    engine.comm_report()
    per = data[0].shape[0] // world
    out = []
    for step, batch in enumerate(data):
        kind = engine.optimizer.kind_of(step + 1)
        engine.backward(lm_loss(engine, batch[rank * per : (rank + 1) * per]))
        engine.step()
        weights = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
        out.append((kind, engine.comm_report(), weights))
    numel = sum(g.layout.total for g in engine.compression.groups)
    states = engine.optimizer.state.values()
    synced = sum(st["momentum_accumulator"].numel() for st in states if "lrs" in st)
    return out, numel, (synced, engine.memory_report()["compression_state"])


def test_each_kind_of_step_sends_what_it_promises_and_syncs_the_replicas() -> None:
    data = batches(14, 1, 8)
    world = 2
    (ours, numel, held), (theirs, _, _) = run_ranks(_steps, world, data)
    dense = 2 * (world - 1) / world * numel * 4  # a ring all-reduce of the fp32 gradients
    kinds = [k for k, _, _ in ours]
    assert set(kinds) == {"dense", "onebit", "local", "sync"}, kinds
    for (kind, report, mine), (_, _, other) in zip(ours, theirs, strict=True):
        gap = (mine - other).abs().max().item()
        if kind == "dense":
            assert report["all_reduce"] >= dense / 2 and "onebit" not in report
        elif kind in ("onebit", "sync"):
            assert 0 < report["onebit"] <= dense / 16 and "all_reduce" not in report
        else:  # a local step: nothing but the finite flag
            assert set(report) <= {"control", "total", "intra_machine", "inter_machine"}, report
        if kind == "local":
            assert gap > 1e-6  # each rank moved its own weights
        else:
            assert gap <= 1e-6, (kind, gap)  # one averaged update on every rank
    # in the local phase memory_report counts the sync errors only (the gradient errors are
    # dropped): worker errors over the whole model, padded, and this rank's server chunk
    synced, held = held
    padded = -(-synced // (8 * world)) * 8 * world
    assert kinds[-1] in ("local", "sync") and held == 4 * (padded + padded // world)


@pytest.mark.slow
def test_zero_one_adam_trains_the_demo_gpt_close_to_dense_adam() -> None:
    """300 steps at stage 0 on 2 ranks, gradient_clipping 1.0 (the public config's), against
    dense Adam without bias correction (0/1 Adam applies none), from three initialisations.
    The schedule gives 77 dense variance steps, 73 1-bit gradient steps, then 72 local steps
    and 78 syncs (intervals 1, 2, 4). One initialisation alone is a noisy measure: dense Adam
    itself ends 3.0695 / 3.1444 / 3.0419 from seeds 0 / 1 / 2, and 0/1 Adam 4.5% / 1.6% / 5.0%
    above it (AMD EPYC, AVX2; seed 0 measured 2.5% on an earlier machine), mean 3.7%: the
    bound is on the mean, 5%. The variance is what 0/1 Adam trades: frozen (or updated rarely)
    too early in a run this short it costs more (measured: var_freeze_step 30, 11%;
    var_update_scaler 16, 8%; var_freeze_step 200, mean 2.8%)."""
    params = {"lr": 3e-3, "weight_decay": 0.01}
    zeroone = {"type": "ZeroOneAdam", "params": {**params, "var_freeze_step": 150,
               "var_update_scaler": 32, "local_step_scaler": 40, "local_step_clipper": 4}}  # fmt: skip
    adam = {"type": "Adam", "params": {**params, "bias_correction": False}}
    calls = [
        (corpus_losses, ({"method": "none"}, section, 0, 1.0, None, None, seed))
        for seed in (0, 1, 2)
        for section in (adam, zeroone)
    ]
    losses = [sum(r[0]) / 20 for r in run_ranks_each(calls, 2)]
    gaps = [(z - a) / a for a, z in zip(losses[0::2], losses[1::2], strict=True)]
    assert sum(gaps) / len(gaps) <= 0.05, gaps


def _overflow(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    config = parity_config(0, 1, 0.0, fp16={"enabled": True, "initial_scale_power": 8,
                                            "hysteresis": 1})  # fmt: skip
    model = toy()
    engine = ds_strategy.initialize(model, make_optimizer("zeroone@4,4,1,4", model), config)
    per = data[0].shape[0] // world
    seen: dict[str, Any] = {"kinds": []}

    def held() -> list[torch.Tensor]:
        states = engine.optimizer.state.values()
        return [t.clone() for st in states for k, t in st.items() if k != "step"]

    for step in range(len(data)):
        kind = engine.optimizer.kind_of(engine.global_steps - engine.skipped_steps + 1)
        seen["kinds"].append(kind)
        inject = kind == "local" and "before" not in seen
        if inject:
            seen["before"], seen["weights"] = held(), engine.full_state_dict()
        loss = lm_loss(engine, data[step][rank * per : (rank + 1) * per])
        if inject and rank == 1:
            loss = loss * float("inf")  # one rank overflows between two syncs
        engine.backward(loss)
        engine.step()
        if inject:
            seen["after"], seen["weights_after"] = held(), engine.full_state_dict()
    seen["skipped"] = engine.skipped_steps
    seen["finite"] = all(bool(v.isfinite().all()) for v in engine.full_state_dict().values())
    return seen


def test_an_overflow_on_one_rank_between_syncs_skips_everywhere() -> None:
    for r in run_ranks(_overflow, 2, batches(9, 1, 8)):
        assert r["skipped"] == 1 and r["finite"], r["kinds"]
        assert {"sync", "local"} <= set(r["kinds"])
        assert len(r["before"]) == len(r["after"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(r["before"], r["after"], strict=True))
        assert all(torch.equal(r["weights"][k], v) for k, v in r["weights_after"].items())


def _resume(rank: int, world: int, root: str, data: list[torch.Tensor]) -> Any:
    """Saved after step 9, between two syncs (steps 7 and 11 of zeroone@4,4,1,4), loaded into
    a new engine that trains steps 10 and 11."""
    config, kind = parity_config(0, 1, CLIP), "zeroone@4,4,1,4"
    engine = train_engine(toy(), kind, config, data, rank, world, 9)
    kinds = [engine.optimizer.kind_of(t) for t in range(7, 12)]
    assert kinds == ["sync", "local", "local", "local", "sync"], kinds
    engine.save_checkpoint(root, tag="t")
    saved = engine.full_state_dict()
    model = toy()
    fresh = ds_strategy.initialize(model, make_optimizer(kind, model), config)
    fresh.load_checkpoint(root, tag="t")
    loaded = fresh.full_state_dict()
    lrs = [float(st["lrs"]) for st in fresh.optimizer.state.values() if "lrs" in st]
    fresh.comm_report()
    per = data[0].shape[0] // world
    for step in (9, 10):
        fresh.backward(lm_loss(fresh, data[step][rank * per : (rank + 1) * per]))
        fresh.step()
    return saved, loaded, lrs, fresh.full_state_dict(), fresh.comm_report()


def test_a_checkpoint_between_two_syncs_resumes(tmp_path: Path) -> None:
    results = run_ranks(_resume, 2, str(tmp_path / "ckpt"), batches(11, 1, 8))
    (saved0, loaded0, lrs, final0, report), (saved1, loaded1, _, final1, _) = results
    # the ranks had moved apart; the checkpoint holds rank 0's whole copy, not a mix
    assert any(not torch.allclose(saved0[k], saved1[k], atol=1e-7) for k in saved0)
    assert all(torch.equal(loaded0[k], loaded1[k]) for k in loaded0)
    assert all(torch.equal(loaded0[k], saved0[k]) for k in saved0)
    assert lrs and all(v > 0 for v in lrs)  # two local steps' learning rates, kept
    assert report["onebit"] > 0  # the sync at step 11
    assert max((final0[k] - final1[k]).abs().max().item() for k in final0) <= 1e-6


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_above_zero_are_refused_naming_the_fix(stage: int) -> None:
    model = toy()
    opt = ZeroOneAdam(model.parameters(), var_freeze_step=3)
    with pytest.raises(ValueError, match=f"stage {stage}") as info:
        ds_strategy.initialize(model, opt, {"zero_optimization": {"stage": stage}})
    assert "ZeroOneAdam" in str(info.value) and "use stage 0" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"var_freeze_step": -1}, "var_freeze_step=-1 must be an integer >= 0"),
        ({"local_step_clipper": 0}, "local_step_clipper=0 must be an integer >= 1"),
        ({"var_update_scaler": 2.5}, "var_update_scaler=2.5 must be an integer"),
        ({"amsgrad": True}, "amsgrad=True is not supported"),
        ({"max_grad_norm": 1.0}, "set the config's gradient_clipping instead"),
    ],
)
def test_bad_arguments_name_the_key(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ZeroOneAdam([torch.nn.Parameter(torch.ones(2))], **kwargs)
