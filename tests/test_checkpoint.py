"""Sharded checkpoints: save at one world size and stage, load at another, and training
continues exactly as if nothing had changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ds_strategy
from tests.distributed import WorkerError, run_ranks
from tests.models import ToyLM, batches, lm_loss

GB, STEPS = 12, 3


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def _sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train(engine: ds_strategy.ZeroEngine, data: list[torch.Tensor], rank: int, world: int) -> None:
    per = GB // world
    for batch in data:
        engine.backward(lm_loss(engine, batch[rank * per : (rank + 1) * per]))
        engine.step()


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyLM()
    opt = _opt(model)
    sched = _sched(opt)
    for batch in batches(2 * STEPS, 1, GB):
        lm_loss(model, batch).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model.state_dict()


def save_worker(rank: int, world: int, stage: int, path: str) -> None:
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(
        model, _opt(model), {"zero_optimization": {"stage": stage}}, lr_scheduler=_sched
    )
    _train(engine, batches(2 * STEPS, 1, GB)[:STEPS], rank, world)
    engine.save_checkpoint(path, client_state={"epoch": 7, "rank_saved": rank})


def resume_worker(rank: int, world: int, stage: int, path: str) -> dict:
    torch.manual_seed(123)  # different initial weights: everything must come from the checkpoint
    model = ToyLM()
    engine = ds_strategy.initialize(
        model, _opt(model), {"zero_optimization": {"stage": stage}}, lr_scheduler=_sched
    )
    client = engine.load_checkpoint(path)
    steps_after_load = engine.global_steps
    _train(engine, batches(2 * STEPS, 1, GB)[STEPS:], rank, world)
    return {
        "client": client,
        "steps": steps_after_load,
        "state": engine.full_state_dict(),
        "lr": engine.get_lr(),
    }


@pytest.mark.parametrize(
    "save_at,load_at",
    [((3, 3), (2, 1)), ((2, 2), (2, 2)), ((2, 1), (3, 3)), ((2, 0), (2, 3))],
    ids=["w3s3-to-w2s1", "w2s2-to-w2s2", "w2s1-to-w3s3", "w2s0-to-w2s3"],
)
def test_resume_at_another_world_size_and_stage(
    tmp_path: Path, save_at: tuple, load_at: tuple
) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(save_worker, save_at[0], save_at[1], path)
    assert (tmp_path / "ckpt" / "ds_strategy.json").is_file()
    assert not (tmp_path / "ckpt.tmp").exists()
    results = run_ranks(resume_worker, load_at[0], load_at[1], path)
    want = reference()
    for r in results:
        assert r["client"] == {"epoch": 7, "rank_saved": 0}
        assert r["steps"] == STEPS
        assert r["lr"][0] == pytest.approx(1e-2 / (1 + 2 * STEPS))
        diff = max(float((r["state"][k] - want[k]).abs().max()) for k in want)
        assert diff <= 2e-5, f"max |w - uninterrupted| = {diff:.3g}"


def mismatch_worker(rank: int, world: int, path: str) -> None:
    model = ToyLM(d=16)  # not the model that was saved
    engine = ds_strategy.initialize(model, _opt(model), {"zero_optimization": {"stage": 2}})
    engine.load_checkpoint(path)


def test_bad_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(save_worker, 2, 2, path)
    with pytest.raises(WorkerError, match=r"Size mismatch|does not match"):
        run_ranks(mismatch_worker, 2, path, timeout=120)
    with pytest.raises(WorkerError, match="no checkpoint directory"):
        run_ranks(mismatch_worker, 2, str(tmp_path / "nowhere"), timeout=120)
    (tmp_path / "half.tmp").mkdir()
    (tmp_path / "half").mkdir()
    with pytest.raises(WorkerError, match="not a ds_strategy checkpoint"):
        run_ranks(mismatch_worker, 2, str(tmp_path / "half"), timeout=120)
    # the single-process engine reports the same way
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {})
    with pytest.raises(FileNotFoundError, match="nowhere"):
        engine.load_checkpoint(tmp_path / "nowhere")


@pytest.mark.launcher
def test_consolidated_file_loads_into_the_plain_model(tmp_path: Path) -> None:
    import subprocess
    import sys

    from safetensors.torch import load_file

    path = tmp_path / "ckpt"
    run_ranks(save_worker, 2, 3, str(path))  # written by 2 ranks under ZeRO-3
    out_st = tmp_path / "model.safetensors"
    ds_strategy.consolidate(path, out_st)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_strategy.cli",
            "consolidate",
            str(path),
            str(tmp_path / "model.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    want = resume_state_after_save(str(path))
    for weights in (load_file(out_st), torch.load(tmp_path / "model.pt")):
        model = ToyLM()
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert missing == ["head.weight"] and not unexpected  # the tied name, restored by the tie
        for k, v in want.items():
            assert torch.equal(model.state_dict()[k], v), k
        x = batches(1, 1, 4)[0]
        ref = ToyLM()
        ref.load_state_dict(want)
        assert torch.equal(model(x), ref(x))
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_strategy.cli",
            "consolidate",
            str(tmp_path / "nope"),
            "x.safetensors",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "nope" in bad.stderr


def resume_state_after_save(path: str) -> dict[str, torch.Tensor]:
    """The saved weights, read back by a one-rank engine (any world size loads)."""
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {"zero_optimization": {"stage": 0}})
    engine.load_checkpoint(path)
    return engine.full_state_dict()


def weights_only_worker(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {"zero_optimization": {"stage": 3}})
    _train(engine, batches(2, 1, GB), rank, world)
    engine.save_checkpoint(path, include_optimizer=False)
    state = engine.full_state_dict()  # collective under stage 3: every rank calls it
    if rank == 0:
        torch.save(state, path + ".expected")


def test_weights_only_checkpoint_loads_into_an_engine_with_another_optimizer(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "weights")
    run_ranks(weights_only_worker, 2, path)
    assert not any("optim" in p.name for p in (tmp_path / "weights").iterdir())
    full = tmp_path / "full"
    run_ranks(save_worker, 2, 3, str(full))
    weights_size = sum(p.stat().st_size for p in (tmp_path / "weights").iterdir())
    full_size = sum(p.stat().st_size for p in full.iterdir())
    assert weights_size < 0.5 * full_size  # AdamW's two moments are not in it
    model = ToyLM()  # one param group, plain SGD: only the weights are wanted
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    with pytest.raises(ValueError, match="load_optimizer=False"):
        engine.load_checkpoint(path)
    engine.load_checkpoint(path, load_optimizer=False)
    want = torch.load(path + ".expected")
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert engine.global_steps == 2
