"""A rank killed with SIGKILL in the middle of a save, and elastic restarts under torchrun:
the previous checkpoint still loads, and training finishes with fewer ranks exactly as the
uninterrupted run does."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import ds_strategy
from tests.distributed import WorkerError, free_port, run_command, run_ranks
from tests.models import ToyLM, batches
from tests.test_checkpoint_manage import GB, STEPS, _opt, max_diff, reference, train

# launcher: a rank killed with SIGKILL, and torchrun restarts
pytestmark = pytest.mark.launcher

REPO = Path(__file__).resolve().parents[1]


def killed_mid_save_worker(rank: int, world: int, root: str) -> None:
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {"zero_optimization": {"stage": 2}})
    data = batches(STEPS, 1, GB)
    train(engine, data[:2], rank, world)
    engine.save_checkpoint(root, tag="global_step2")
    train(engine, data[2:4], rank, world)
    if rank == 1:  # die after DCP has planned the save, before writing this rank's files
        FileSystemWriter.write_data = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    engine.save_checkpoint(root, tag="global_step4")


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    # rank 1 dies; rank 0, waiting for it inside the save, fails or is reported first
    with pytest.raises(WorkerError, match="died without a report|rank 0: .*Connection"):
        run_ranks(killed_mid_save_worker, 2, str(root), timeout=120, pg_timeout=30)
    assert (root / "latest").read_text() == "global_step2"
    assert not (root / "global_step4").exists()
    assert not (root / "global_step4.tmp").exists()  # rank 0 saw the failure and removed it
    # restart with one rank (accumulating two micro-batches: the same global batch)
    model = ToyLM()
    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2}
    engine = ds_strategy.initialize(model, _opt(model), config)
    engine.load_checkpoint(root)
    assert engine.global_steps == 2
    train(engine, batches(STEPS, 1, GB)[2:], 0, 1)
    diff = max_diff(engine.full_state_dict(), reference())
    assert diff <= 2e-5, f"max |w - uninterrupted| = {diff:.3g}"
    assert engine.save_checkpoint(root) == root / f"global_step{STEPS}"


def _example() -> object:
    spec = importlib.util.spec_from_file_location(
        "elastic_train", REPO / "examples/elastic_train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain_run(steps: int, gb: int) -> dict[str, torch.Tensor]:
    ex = _example()
    model = ex.make_model()  # type: ignore[attr-defined]
    opt = ex.make_optimizer(model)  # type: ignore[attr-defined]
    for step in range(steps):
        x, y = ex.global_batch(step, gb)  # type: ignore[attr-defined]
        ex.loss_fn(model, x, y).backward()  # type: ignore[attr-defined]
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _torchrun(tmp_path: Path, nproc: int, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(REPO / "examples/elastic_train.py"),
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return run_command(cmd, tmp_path, env, timeout=240, name="torchrun")


def test_torchrun_restarts_after_a_rank_dies_and_resumes_with_fewer_ranks(tmp_path: Path) -> None:
    root, gb = tmp_path / "ckpt", 12
    common = ["--root", str(root), "--global-batch", str(gb), "--micro-batch", "6"]
    out = _torchrun(
        tmp_path, 2, *common, "--steps", "6", "--fail-once", "1:3", "--out", str(tmp_path / "a.pt")
    )
    assert "killing myself after step 3" in out and "resumed from global_step2 on 2" in out
    assert (root / "latest").read_text() == "global_step6"
    diff = max_diff(torch.load(tmp_path / "a.pt"), _plain_run(6, gb))
    assert diff <= 2e-5, f"2 ranks with a restart: max |w - uninterrupted| = {diff:.3g}"
    # the same root, one rank now (two micro-batches per step): continue to step 8
    out = _torchrun(tmp_path, 1, *common, "--steps", "8", "--out", str(tmp_path / "b.pt"))
    assert "resumed from global_step6 on 1" in out and "finished 8 steps" in out
    diff = max_diff(torch.load(tmp_path / "b.pt"), _plain_run(8, gb))
    assert diff <= 2e-5, f"then 1 rank: max |w - uninterrupted| = {diff:.3g}"
