"""``engine.clip_grad_norm_`` (clip without stepping) and
``engine.set_gradient_accumulation_boundary`` (the loop decides the boundary), on 2 gloo ranks,
against plain PyTorch on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch

import ds_strategy
from tests.distributed import run_ranks
from tests.models import ToyLM, batches, lm_loss

GB = 8


def _local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _pair(stage: int, extra: dict | None = None):  # noqa: ANN202
    torch.manual_seed(0)
    model = ToyLM()
    ref = copy.deepcopy(model)
    config = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2}
    config.update(extra or {})
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    return engine, ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)


def _explicit_clip(rank: int, world: int, stage: int, extra: dict | None, clips: list) -> dict:
    """Each optimizer step: two micro-batches, then ``clip_grad_norm_`` once per value in
    ``clips``, then ``step``; the reference clips the same way with torch."""
    engine, ref, ref_opt = _pair(stage, extra)
    config_clip = float(engine.config.gradient_clipping or 0.0)
    out: dict = {"norms": [], "weights_before_step_unchanged": True}
    for i, batch in enumerate(batches(6, 1, GB, seed=11)):
        loss = lm_loss(engine, _local(batch, rank, world))
        engine.backward(loss)
        (lm_loss(ref, batch) / 2).backward()
        if i % 2 == 0:
            if engine.is_gradient_accumulation_boundary():
                raise AssertionError("boundary after the first micro-batch")
            try:
                engine.clip_grad_norm_(1.0)
            except RuntimeError as e:
                out["between_error"] = str(e)
            engine.step()
            continue
        before = engine.full_state_dict() if stage == 3 else None
        got = [engine.clip_grad_norm_(c) for c in clips]
        want = [float(torch.nn.utils.clip_grad_norm_(ref.parameters(), c)) for c in clips]
        if config_clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), config_clip)
        if before is not None and _max_diff(before, engine.full_state_dict()) != 0:
            out["weights_before_step_unchanged"] = False
        out["norms"].append((got, want))
        engine.step()
        out["global_norm"] = (engine.get_global_grad_norm(), want[0])
        ref_opt.step()
        ref_opt.zero_grad()
    out["diff"] = _max_diff(engine.full_state_dict(), ref.state_dict())
    return out


def _loop_boundary(rank: int, world: int, stage: int) -> dict:
    """Windows of 3 and 1 micro-batches chosen by the loop, whatever the config says."""
    engine, ref, ref_opt = _pair(stage)
    data = batches(8, 1, GB, seed=12)
    windows = [[0, 1, 2], [3], [4, 5, 6], [7]]
    steps = []
    for window in windows:
        for j, idx in enumerate(window):
            boundary = j == len(window) - 1
            engine.set_gradient_accumulation_boundary(boundary)
            engine.gradient_accumulation_steps = len(window)  # the loss divisor
            engine.backward(lm_loss(engine, _local(data[idx], rank, world)))
            engine.step()
            (lm_loss(ref, data[idx]) / len(window)).backward()
        steps.append(engine.global_steps)
        ref_opt.step()
        ref_opt.zero_grad()
    engine.set_gradient_accumulation_boundary(None)
    engine.gradient_accumulation_steps = 2
    return {
        "steps": steps,
        "diff": _max_diff(engine.full_state_dict(), ref.state_dict()),
        "counting_again": engine.is_gradient_accumulation_boundary(),
    }


def clip_worker(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        out[("clip", stage)] = _explicit_clip(rank, world, stage, None, [0.05])
        out[("boundary", stage)] = _loop_boundary(rank, world, stage)
    out["twice"] = _explicit_clip(rank, world, 2, None, [0.5, 0.02])
    out["with_config"] = _explicit_clip(rank, world, 1, {"gradient_clipping": 0.01}, [0.05])
    out["fp16"] = _explicit_clip(
        rank, world, 2, {"fp16": {"enabled": True, "initial_scale_power": 8}}, [0.05]
    )
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_ranks(clip_worker, 2, timeout=240)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_grad_norm_returns_torch_norm_and_clips_before_step(results: dict, stage: int) -> None:
    r = results[("clip", stage)]
    for got, want in r["norms"]:
        assert got == pytest.approx(want, rel=1e-5)
        assert want[0] > 0.05  # the clip was active
    assert r["global_norm"][0] == pytest.approx(r["global_norm"][1], rel=1e-5)
    assert r["diff"] <= 2e-5
    assert r["weights_before_step_unchanged"]  # clipping does not step
    assert "between accumulation boundaries" in r["between_error"]


def test_clipping_twice_and_on_top_of_config_clipping(results: dict) -> None:
    for key in ("twice", "with_config"):
        r = results[key]
        for got, want in r["norms"]:
            assert got == pytest.approx(want, rel=1e-5)
        assert r["diff"] <= 2e-5


def test_clip_under_fp16_removes_the_loss_scale(results: dict) -> None:
    r = results["fp16"]
    for got, want in r["norms"]:
        # fp16 compute: the norm agrees with fp32 to fp16 accuracy, not 1e-5
        assert got == pytest.approx(want, rel=2e-2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loop_decides_the_accumulation_boundary(results: dict, stage: int) -> None:
    r = results[("boundary", stage)]
    assert r["steps"] == [1, 2, 3, 4]
    assert r["diff"] <= 2e-5
    assert r["counting_again"] is False  # 8 micro-steps done, accumulation 2: next is not one
