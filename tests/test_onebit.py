"""DeepSpeed's 1-bit optimizers (``OneBitAdam``, ``OneBitLamb``) in the engine, 2 gloo ranks:
their warm-up is dense Adam / LAMB, their compressed phase sends under 1/16 of the bytes
(counted by ``comm_report()`` and around ``torch.distributed``), the demo GPT trains to within
3% of dense, an overflow skips everywhere, the public DeepSpeed configs naming them train, and
what does not combine with them is refused."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from tests.compression_common import Wire, corpus_losses
from tests.distributed import run_ranks, run_ranks_each
from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches, lm_loss

STEPS, ACCUM, CLIP = 10, 2, 0.5
CONFIGS = Path(__file__).parent / "data" / "deepspeed_configs"


def toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def _warm_up(rank: int, world: int, stage: int, data: list[torch.Tensor]) -> Any:
    config = parity_config(stage, ACCUM, CLIP)
    out = {}
    for kind in ("onebitadam", "onebitlamb"):  # frozen after STEPS: every step is a warm-up
        engine = train_engine(toy(), f"{kind}@{STEPS}", config, data, rank, world, STEPS)
        out[kind] = (engine.full_state_dict(), engine.comm_report())
    return out


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.slow
def test_the_warm_up_is_dense_adam_and_lamb(runs: dict[Any, list[Any]], stage: int) -> None:
    data = batches(STEPS, ACCUM, 8)
    expected = {
        "onebitadam": train_reference(toy(), "adamw", data, STEPS, ACCUM, CLIP),
        "onebitlamb": train_reference(toy(), "lamb", data, STEPS, ACCUM, CLIP),
    }
    for result in runs["warm up", stage]:
        for kind, (state, report) in result.items():
            worst = max((state[k] - v).abs().max().item() for k, v in expected[kind].items())
            assert worst <= 2e-5, (kind, worst)
            assert "onebit" not in report


def _stages(rank: int, world: int, kind: str, data: list[torch.Tensor]) -> Any:
    out = {}
    for stage in (1, 2):
        config = parity_config(stage, ACCUM, CLIP)
        out[stage] = train_engine(toy(), kind, config, data, rank, world, STEPS).full_state_dict()
    return out


@pytest.mark.parametrize("kind", ["onebitadam@3", "onebitlamb@3"])
@pytest.mark.slow
def test_the_compressed_phase_at_stage_2_equals_stage_1(
    runs: dict[Any, list[Any]], kind: str
) -> None:
    """The same whole-model momentum is exchanged over the same flat layout; stage 2 only
    keeps its local gradients in buckets and its reduced gradient in a shard. (Against stage
    0, whose flat groups are padded differently, the 1-bit chunks and their scales differ,
    so the weights do too: sign compression is not a reordering of a sum.)"""
    for r in runs["stages", kind]:
        worst = max((r[2][k] - r[1][k]).abs().max().item() for k in r[1])
        assert worst <= 1e-5, worst  # measured 2.5e-6 (Adam), 1.2e-7 (LAMB)


def _bytes(rank: int, world: int, stage: int, kind: str, data: list[torch.Tensor]) -> Any:
    """Two warm-up steps, then compressed ones: what each compressed step sent."""
    config = parity_config(stage, ACCUM, CLIP)
    engine = train_engine(toy(), f"{kind}@2", config, data, rank, world, 3)  # starts compressing
    engine.comm_report()
    wire = Wire()
    for step in range(3, STEPS):
        for micro in range(ACCUM):
            batch = data[step * ACCUM + micro]
            per = batch.shape[0] // world
            engine.backward(lm_loss(engine, batch[rank * per : (rank + 1) * per]))
            engine.step()
    comp = engine.compression
    return {
        "report": engine.comm_report(),
        "wire": dict(wire.sent),
        "numel": sum(g.layout.total for g in comp.groups),
        "memory": engine.memory_report()["compression_state"],
        "held": sum(
            m.numel() + e.numel() + s.numel()
            for m, e, s in zip(comp.momenta, comp.worker_errors, comp.server_errors, strict=True)
        )
        * 4,  # fmt: skip
        "skipped": engine.skipped_steps,
    }


@pytest.mark.parametrize(
    ("stage", "kind"), [(0, "onebitadam"), (1, "onebitlamb"), (2, "onebitadam"), (2, "onebitlamb")]
)
@pytest.mark.slow
def test_compressed_steps_send_under_a_sixteenth_of_fp32(
    runs: dict[Any, list[Any]], stage: int, kind: str
) -> None:
    world, steps = 2, STEPS - 3
    for r in runs["bytes", stage, kind]:
        dense = 2 * (world - 1) / world * r["numel"] * 4  # a ring all-reduce of fp32 gradients
        report = r["report"]
        assert r["skipped"] == 0
        assert "all_reduce" not in report and "reduce_scatter" not in report
        assert 0 < report["onebit"] / steps <= dense / 16
        # seen from torch.distributed: packed signs by all-to-all, scales and server signs
        # by gloo's all-gather (broadcasts); stage 1 adds its dense parameter all-gather
        wire = r["wire"]
        sent = wire.get("all_to_all_single", 0) + wire.get("broadcast", 0)
        if stage == 0:
            assert set(wire) <= {"all_to_all_single", "broadcast", "control"}
            assert 0 < sent / steps <= dense / 16
        else:
            assert wire.get("all_reduce", 0) == 0  # no dense gradient exchange either
            assert 0 < wire["all_to_all_single"] / steps <= dense / 16
        # memory_report counts the momentum and both errors (LAMB: its scales too)
        extra = 0 if kind == "onebitadam" else r["held"] * 2 // 5
        assert r["memory"] == r["held"] + extra


@pytest.mark.slow
def test_one_bit_adam_and_lamb_train_the_demo_gpt_to_within_3_percent() -> None:
    """300 steps at stage 1 on 2 ranks, compressed after a dense warm-up. 1-bit Adam with the
    public configs' gradient_clipping 1.0; 1-bit LAMB with the public 1-bit LAMB config's
    trust-ratio bounds and no clipping (in the compressed phase each rank clips its own
    gradient, which LAMB's frozen trust ratio does not make up for: measured 4.9% higher
    with clipping at 1.0). Measured: Adam 1.6% and LAMB 1.1% above dense."""
    adam = {"lr": 3e-3, "weight_decay": 0.01}
    lamb = {"lr": 1e-2, "weight_decay": 0.01, "max_coeff": 0.3, "min_coeff": 0.01}
    cases = (("OneBitAdam", adam, 50, 1.0), ("OneBitLamb", lamb, 100, 0.0))
    calls = [
        (
            corpus_losses,
            (
                {"method": "none"},
                {"type": name, "params": {**params, "freeze_step": steps}},
                1,
                clip,
            ),
        )
        for name, params, freeze, clip in cases
        for steps in (10**9, freeze)  # never frozen: dense Adam / LAMB
    ]
    runs = iter(r[0] for r in run_ranks_each(calls, 2))
    for name, *_ in cases:
        dense, compressed = sum(next(runs)) / 20, sum(next(runs)) / 20
        print(name, dense, compressed, (compressed - dense) / dense)
        assert abs(compressed - dense) / dense <= 0.03, name


def _overflow(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    config = parity_config(1, 1, 0.0, fp16={"enabled": True, "initial_scale_power": 8,
                                            "hysteresis": 1})  # fmt: skip
    model = toy()
    opt = ds_strategy.core.optim.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=3)
    engine = ds_strategy.initialize(model, opt, config)
    per = data[0].shape[0] // world
    seen: dict[str, Any] = {}
    comp = engine.compression

    def held() -> list[torch.Tensor]:
        return [t.clone() for t in [*comp.momenta, *comp.worker_errors, *comp.server_errors]]

    for step in range(7):
        if step == 5:
            seen["before"], seen["weights"] = held(), engine.full_state_dict()
        loss = lm_loss(engine, data[step][rank * per : (rank + 1) * per])
        if step == 5 and rank == 1:
            loss = loss * float("inf")  # one rank overflows in the compressed phase
        engine.backward(loss)
        engine.step()
        if step == 5:
            seen["after"], seen["weights_after"] = held(), engine.full_state_dict()
            seen["skipped"] = engine.skipped_steps
    seen["final_skipped"] = engine.skipped_steps
    seen["finite"] = all(bool(t.isfinite().all()) for t in held())
    return seen


def test_an_overflow_on_one_rank_skips_everywhere_and_keeps_momentum_and_errors() -> None:
    data = batches(7, 1, 8)
    for r in run_ranks(_overflow, 2, data):
        assert r["skipped"] == 1 and r["final_skipped"] == 1 and r["finite"]
        assert all(torch.equal(a, b) for a, b in zip(r["before"], r["after"], strict=True))
        assert all(torch.equal(r["weights"][k], v) for k, v in r["weights_after"].items())


ONEBIT_CONFIGS = [
    "dsexamples__bing_bert_onebitadam_seq128_nccl.json",
    "dsexamples__bingbertsquad_onebitadam_bsz96_nccl.json",
    "dsexamples__bing_bert_onebitlamb_seq512_nccl.json",
    "dsexamples__bing_bert_01adam_seq128_nccl.json",
]
# ZeroOneAdam's schedule, shortened (12,500 variance steps there): one dense, one 1-bit, one
# dense step, then syncs at steps 4, 5 and 7 around a local step at 6
ZERO_ONE_SHORT = {"var_freeze_step": 3, "var_update_scaler": 1, "local_step_scaler": 1}


def _public(rank: int, world: int, name: str) -> Any:
    """The config as published, but for freeze_step (thousands of steps there): 2, so the
    compressed phase starts within the steps run here (ZeroOneAdam: ``ZERO_ONE_SHORT``)."""
    raw = copy.deepcopy(json.loads((CONFIGS / name).read_text()))
    params = raw["optimizer"]["params"]
    zero_one = str(raw["optimizer"]["type"]).lower() == "zerooneadam"
    params.update(ZERO_ONE_SHORT if zero_one else {"freeze_step": 2})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    engine = ds_strategy.initialize(model, None, raw)
    before = engine.full_state_dict()
    rows = engine.config.train_micro_batch_size_per_gpu
    gen = torch.Generator().manual_seed(rank)
    losses = []
    torch.set_num_threads(1)
    while engine.global_steps - engine.skipped_steps < (7 if zero_one else 4):
        x, y = 0.1 * torch.randn(2, rows, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = engine.full_state_dict()
    return {
        "type": type(engine.optimizer).__name__,
        "finite": all(math.isfinite(v) for v in losses),
        "changed": any(not torch.equal(before[k], after[k]) for k in before),
        "report": engine.comm_report(),
        "skipped": engine.skipped_steps,
    }


@pytest.mark.parametrize("name", ONEBIT_CONFIGS)
@pytest.mark.slow
def test_public_deepspeed_configs_naming_them_train(runs: dict[Any, list[Any]], name: str) -> None:
    for r in runs["public", name]:
        assert r["type"] in ("OneBitAdam", "OneBitLamb", "ZeroOneAdam")
        assert r["finite"] and r["changed"] and r["report"]["onebit"] > 0
        assert r["skipped"] < 4  # fp16 at 2**16 may skip the first step or two, as DeepSpeed


def _resume(rank: int, world: int, root: str, data: list[torch.Tensor]) -> Any:
    """Stage 1, compressed from step 2, saved at step 4; loaded into stage 0 and trained on."""
    out = {}
    for stage, steps, save in ((1, 4, True), (0, 0, False)):
        config = parity_config(stage, 1, CLIP)
        engine = train_engine(toy(), "onebitadam@2", config, data, rank, world, steps)
        if save:
            engine.save_checkpoint(root, tag="t")
            out["saved"] = engine.full_state_dict()
            continue
        engine.load_checkpoint(root, tag="t")
        out["loaded"] = engine.full_state_dict()
        assert engine.compression.momenta is None  # taken from the loaded exp_avg below
        per = data[0].shape[0] // world
        for step in range(4, 6):
            engine.backward(lm_loss(engine, data[step][rank * per : (rank + 1) * per]))
            engine.step()
        states = [engine.optimizer.state[p] for g in engine.optimizer.param_groups
                  for p in g["params"]]  # fmt: skip
        momentum = torch.cat([st["exp_avg"].reshape(-1) for st in states if "exp_avg" in st])
        out["momentum"] = momentum
        out["report"] = engine.comm_report()
        out["final"] = engine.full_state_dict()
    return out


def test_a_checkpoint_from_the_compressed_phase_resumes_at_another_stage(tmp_path: Path) -> None:
    data = batches(6, 1, 8)
    results = run_ranks(_resume, 2, str(tmp_path / "ckpt"), data)
    for r in results:
        assert all(torch.equal(r["saved"][k], v) for k, v in r["loaded"].items())
        assert r["report"]["onebit"] > 0 and "all_reduce" not in r["report"]
        assert all(bool(v.isfinite().all()) for v in r["final"].values())
    # the exchange hands every rank the same momentum, so the replicas stay identical
    assert torch.equal(results[0]["momentum"], results[1]["momentum"])
    assert all(torch.equal(results[0]["final"][k], v) for k, v in results[1]["final"].items())


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"zero_optimization": {"stage": 3}}, "stage 3"),
        ({"gradient_compression": {"method": "topk", "ratio": 0.1}}, "one compression at a time"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "offload"),
    ],
)
def test_what_does_not_combine_with_them_is_refused(extra: dict[str, Any], fragment: str) -> None:
    model = toy()
    opt = ds_strategy.core.optim.OneBitLamb(model.parameters(), freeze_step=3)
    with pytest.raises(ValueError, match=fragment) as info:
        ds_strategy.initialize(model, opt, extra)
    assert "OneBitLamb" in str(info.value)


def _in_a_pipeline(rank: int, world: int) -> str:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    config = {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2}}}  # fmt: skip
    with pytest.raises(ValueError, match="pipeline stages") as info:
        ds_strategy.initialize(layers, None, config, loss_fn=torch.nn.functional.mse_loss)
    return str(info.value)


def test_pipelines_are_refused_on_every_rank() -> None:
    for message in run_ranks(_in_a_pipeline, 2):
        assert "OneBitAdam" in message and "remove the pipeline section" in message


BYTES_CASES = [(0, "onebitadam"), (1, "onebitlamb"), (2, "onebitadam"), (2, "onebitlamb")]


@pytest.fixture(scope="module")
def runs() -> dict[Any, list[Any]]:
    """The 2-rank runs of the parametrized tests above, in one spawn (by case, then rank)."""
    data = batches(STEPS, ACCUM, 8)
    calls: dict[Any, tuple[Any, tuple]] = {("warm up", s): (_warm_up, (s, data)) for s in (0, 1)}
    for kind in ("onebitadam@3", "onebitlamb@3"):
        calls["stages", kind] = (_stages, (kind, data))
    for stage, kind in BYTES_CASES:
        calls["bytes", stage, kind] = (_bytes, (stage, kind, data))
    for name in ONEBIT_CONFIGS:
        calls["public", name] = (_public, (name,))
    return dict(zip(calls, run_ranks_each(list(calls.values()), 2), strict=True))
