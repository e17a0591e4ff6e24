"""``ZeroAccelerator`` with a ``pipeline`` config: ``accelerate launch`` on 4 CPU processes
(2 stages x 2 data-parallel ranks) trains to the weights of one process on the global
batches, shards data by the data-parallel rank, resumes from ``save_state``; the errors a
pipeline config raises at construction are checked in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from torch import nn

import ds_strategy
from ds_strategy.accelerate import ZeroAccelerator, ZeroPlugin
from tests.accelerate_scripts.launch import launch

TOL = 2e-5
WORLD, STAGES, DP = 4, 2, 2
STEPS, STOP, PER_RANK = 3, 1, 4  # tests/accelerate_scripts/pipeline.py


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pipeline")
    out, ckpt = tmp / "results.pt", tmp / "ckpt"
    launch("pipeline.py", "--out", str(out), "--ckpt", str(ckpt), num_processes=WORLD, timeout=300)
    results = torch.load(out, weights_only=False)
    results["dir"] = tmp
    return results


@pytest.mark.launcher
def test_train_batch_matches_one_process_on_the_global_batches(launched: dict[str, Any]) -> None:
    run, ref = launched["uninterrupted"], launched["reference"]
    assert max_diff(ref["state"], ref["initial"]) > 1e-2  # the reference really trained
    assert max_diff(run["state"], ref["state"]) <= TOL
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert run["global_steps"] == STEPS
    assert run["skipped"] is False
    # the engine stepped the LambdaLR once per train_batch
    assert run["lrs"] == pytest.approx([0.02 / (1 + 0.5 * k) for k in range(1, STEPS + 1)])
    # "auto" sizes: the loader's 4 samples per rank = 2 accumulation steps x micro-batches of 2
    assert run["resolved"] == {
        "micro": 2,
        "accum": 2,
        "clip": 0.3,
        "stage": 1,
        "optimizer": "AdamW",
        "weight_decay": 0.01,
    }
    # eval_batch: the global batch's mean loss on every rank, without a step
    assert run["eval"] == pytest.approx(ref["eval"], abs=1e-5)
    assert run["bad_loader"] is not None and "use batch_size=4" in run["bad_loader"]


@pytest.mark.launcher
def test_mixed_precision_bf16_runs_the_stages_in_bf16(launched: dict[str, Any]) -> None:
    run, ref = launched["bf16"], launched["reference"]
    assert run["bf16"] is True and launched["uninterrupted"]["bf16"] is False
    # bf16 compute, fp32 master weights: the fp32 reference's losses within 2%
    assert run["losses"] == pytest.approx(ref["losses"], rel=0.02)
    assert run["losses"] != pytest.approx(ref["losses"], rel=1e-6)  # it really ran in bf16
    assert run["global_steps"] == STEPS and run["skipped"] is False


@pytest.mark.launcher
def test_loaders_are_sharded_by_the_data_parallel_rank(launched: dict[str, Any]) -> None:
    per_rank = launched["uninterrupted"]["per_rank"]
    layouts = [r["layout"] for r in per_rank]
    # global rank r: stage r // D, data-parallel rank r % D (the Mesh's layout)
    assert layouts == [(r // DP, r % DP, DP) for r in range(WORLD)]
    seen = [r["seen"] for r in per_rank]
    for r in range(WORLD):  # both stages of one pipeline read the same samples
        assert seen[r] == seen[r % DP]
    for step in range(STEPS):  # the data-parallel ranks split each global batch
        batch = sorted(seen[0][step] + seen[1][step])
        assert batch == list(range(step * DP * PER_RANK, (step + 1) * DP * PER_RANK))


@pytest.mark.launcher
def test_resumed_run_matches_uninterrupted(launched: dict[str, Any]) -> None:
    """The saving and resuming runs use ZeRO-2 inside each stage, the config's optimizer
    section through a DummyOptim and an engine-built scheduler from a DummyScheduler."""
    full, saved, loaded = launched["uninterrupted"], launched["save"], launched["load"]
    assert loaded["resolved"] == {**full["resolved"], "stage": 2}
    assert saved["global_steps"] == STOP
    assert max_diff(saved["state"], full["state"]) > 1e-3  # the save really was mid-training
    assert loaded["steps_after_load"] == STOP
    assert loaded["losses"] == pytest.approx(full["losses"][STOP:], rel=1e-6)
    assert loaded["lrs"] == pytest.approx(full["lrs"][STOP:], rel=1e-12)
    assert loaded["seen"] == full["seen"][STOP:]
    assert max_diff(loaded["state"], full["state"]) <= TOL
    engine_dir = launched["dir"] / "ckpt" / "zero_checkpoint"
    assert sorted(p.name for p in engine_dir.iterdir() if p.is_dir()) == ["stage_0", "stage_1"]


@pytest.mark.launcher
def test_weights_and_unwrap(launched: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    run = launched["uninterrupted"]
    saved = load_file(launched["dir"] / "model" / "model.safetensors")
    assert max_diff(dict(sorted(saved.items())), dict(sorted(run["state"].items()))) == 0.0
    # unwrap_model: this rank's stage, keyed by the layer's index in the whole Sequential
    unwrapped = [set(r["unwrapped"]) for r in launched["uninterrupted"]["per_rank"]]
    assert unwrapped[0] == unwrapped[1] and unwrapped[2] == unwrapped[3]
    assert not unwrapped[0] & unwrapped[2]
    assert unwrapped[0] | unwrapped[2] == set(run["state"])


@pytest.mark.launcher
def test_plain_accelerate_calls_name_train_batch(launched: dict[str, Any]) -> None:
    refused = launched["uninterrupted"]["refused"]
    assert "model.train_batch(inputs, targets)" in refused["backward"]
    assert "gradient_clipping" in refused["clip_grad_norm_"]
    assert "accumulate()" in refused["accumulate"]
    assert "train_batch" in refused["forward"]
    assert "same prepare() call" in refused["late_scheduler"]


# -- one process: what fails before any model is built ---------------------------------------


PIPE = {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}}


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


@pytest.mark.usefixtures("clean_accelerate")
def test_pipeline_config_errors_before_the_model() -> None:
    with pytest.raises(ValueError, match=r"ZeroPlugin\(loss_fn=fn\)"):
        ZeroAccelerator(config=PIPE, cpu=True)
    AcceleratorState._reset_state(True)
    with pytest.raises(ValueError, match="1 process.*do not divide into 2 stages"):
        ZeroAccelerator(config=ZeroPlugin(config=PIPE, loss_fn=_mse), cpu=True)
    AcceleratorState._reset_state(True)
    # stages: 1 is no pipeline: the ordinary ZeRO path, no loss_fn needed
    one = ZeroAccelerator(config={"pipeline": {"stages": 1}}, cpu=True)
    layers = nn.Sequential(nn.Linear(2, 2))
    model, _ = one.prepare(layers, torch.optim.SGD(layers.parameters(), lr=0.1))
    assert isinstance(model, ds_strategy.ZeroEngine) and one.zero_engine is model
