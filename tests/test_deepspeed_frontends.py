"""Checkpoints written by DeepSpeed through a front end resume under ours, at another ZeRO stage,
ending where the framework and DeepSpeed's own continuation ended: Lightning's own
``DeepSpeedStrategy`` checkpoint (a ``.ckpt`` directory, Lightning's loop state as DeepSpeed's
client state) with ``Trainer.fit(ckpt_path=...)`` at one and two processes; a Hugging Face
Trainer's ``checkpoint-N/global_stepN`` (a GPT-2 whose head is tied to its embedding) with
``ZeroTrainer.train(resume_from_checkpoint=...)`` in one process; Accelerate's ``save_state``
with DeepSpeed (``pytorch_model/`` and ``latest`` beside Accelerate's own files) with
``ZeroAccelerator.load_state``; Lightning Fabric's ``DeepSpeedStrategy`` checkpoint with
``fabric.load``."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from tests.lightning_scripts.launch import max_diff, run_for_results

DATA = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"


def _fixtures() -> ModuleType:
    """``make_fixtures.py``: the models, data and loops that wrote the fixtures."""
    sys.path.insert(0, str(DATA))
    try:
        return importlib.import_module("make_fixtures")
    finally:
        sys.path.remove(str(DATA))


def _config(case: str, stage: int) -> dict:
    config = json.loads((DATA / case / "config.json").read_text())
    config["zero_optimization"]["stage"] = stage
    return config


@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "devices"), [(3, 1), (1, 2)])
def test_lightning_deepspeed_checkpoint_resumes_in_the_trainer(
    tmp_path: Path, stage: int, devices: int
) -> None:
    pytest.importorskip("lightning")
    args = (str(stage), str(devices))
    out = run_for_results("deepspeed_resume.py", tmp_path, args=args, ranks=devices)
    reference = load_file(DATA / "lightning_s2" / "continued.safetensors")
    assert out["global_step"] == 7
    assert out["lr"] == pytest.approx(0.02)  # the LambdaLR's position came back with the loops
    diff = max_diff(out["weights"], reference)
    assert diff <= 2e-5, f"max |w - DeepSpeed's continuation| = {diff:.3g}"


def test_hf_trainer_deepspeed_checkpoint_resumes_in_zero_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import sys

    from ds_strategy.hf import ZeroTrainer

    sys.path.insert(0, str(DATA))
    try:
        from make_fixtures import HF_CONFIG, MICRO, hf_parts
    finally:
        sys.path.remove(str(DATA))
    config = {**HF_CONFIG, "zero_optimization": {"stage": 3}}
    net, data, args = hf_parts(str(tmp_path), resume=True)
    # one process: the fixture's two ranks each read the whole batch (see make_fixtures.py)
    arguments = args(per_device_train_batch_size=MICRO, use_cpu=True)
    trainer = ZeroTrainer(model=net, args=arguments, train_dataset=data, config=config)
    trainer.train(resume_from_checkpoint=str(DATA / "hf_s2" / "checkpoint"))
    assert trainer.state.global_step == 7
    got = trainer.accelerator.get_state_dict(trainer.model)
    reference = load_file(DATA / "hf_s2" / "continued.safetensors")
    diff = max_diff({k: got[k] for k in reference}, reference)
    assert diff <= 2e-5, f"max |w - DeepSpeed's continuation| = {diff:.3g}"


@pytest.mark.usefixtures("clean_accelerate")
@pytest.mark.parametrize("case", ["accelerate_s2", "accelerate_s2_config"])
def test_accelerate_deepspeed_state_resumes_in_zero_accelerator(case: str) -> None:
    """The loop's AdamW and LambdaLR (Accelerate saved the scheduler), or the config's AdamW
    and WarmupLR through DummyOptim/DummyScheduler (DeepSpeed saved the scheduler)."""
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    from ds_strategy.accelerate import ZeroAccelerator

    fx = _fixtures()
    # one process: Accelerate counted one on CPU, so each of the fixture's two ranks read the
    # whole global batch (see make_fixtures.py); one process on it takes the same steps
    batch = fx.WORLD * fx.MICRO
    config = {**_config(case, 3), "train_micro_batch_size_per_gpu": batch}
    accelerator = ZeroAccelerator(config=config)
    net = fx.model()
    owned = case.endswith("_config")  # DeepSpeed's optimizer and scheduler, from the config
    if owned:
        opt = DummyOptim(net.parameters())
        sched = DummyScheduler(opt)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
        sched = fx.lambda_lr(opt)
    data = load_file(DATA / "batches.safetensors")
    steps = range(fx.STEPS, fx.STEPS + fx.MORE)
    loader = torch.utils.data.DataLoader(fx.mlp_rows(data, steps), batch_size=batch)
    counter = fx.Counter()
    accelerator.register_for_checkpointing(counter)
    net, opt, loader, sched = accelerator.prepare(net, opt, loader, sched)
    accelerator.load_state(str(DATA / case / "state"))
    assert counter.seen == fx.STEPS * batch  # Accelerate's custom object came back
    # the position came back: the LambdaLR's from scheduler.bin, the WarmupLR's from DeepSpeed's
    # model state (its last_batch_iteration, n - 1 after n steps)
    assert sched.scheduler.last_epoch == fx.STEPS - owned
    for x, y in loader:
        accelerator.backward(((net(x) - y) ** 2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    assert accelerator.zero_engine.global_steps == fx.STEPS + fx.MORE
    got = accelerator.get_state_dict(net)
    reference = load_file(DATA / case / "continued.safetensors")
    diff = max_diff({k: got[k] for k in reference}, reference)
    assert diff <= 2e-5, f"max |w - DeepSpeed's continuation| = {diff:.3g}"


@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_accelerate_deepspeed_state_resumes_on_two_processes(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from tests.accelerate_scripts.launch import launch

    launch("deepspeed_resume.py", str(tmp_path / "out.pt"), "1")
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert (out["world"], out["global_steps"]) == (2, 7)
    assert out["loaded"] == {"seen": 16, "last_epoch": 4}
    reference = load_file(DATA / "accelerate_s2" / "continued.safetensors")
    diff = max_diff({k: out["weights"][k] for k in reference}, reference)
    assert diff <= 2e-5, f"max |w - DeepSpeed's continuation| = {diff:.3g}"


@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "devices"), [(3, 1), (1, 2)])
def test_fabric_deepspeed_checkpoint_resumes_with_fabric_load(
    tmp_path: Path, stage: int, devices: int
) -> None:
    pytest.importorskip("lightning")
    args = (str(stage), str(devices))
    out = run_for_results("fabric_deepspeed_resume.py", tmp_path, args=args, ranks=devices)
    assert out["loaded"] == {"step": 4, "last_epoch": 4}  # Fabric's entries, as client state
    reference = load_file(DATA / "fabric_s2" / "continued.safetensors")
    diff = max_diff(out["weights"], reference)
    assert diff <= 2e-5, f"max |w - Fabric and DeepSpeed's continuation| = {diff:.3g}"


@pytest.mark.usefixtures("clean_accelerate")
def test_accelerate_load_state_refuses_a_directory_without_the_engines_checkpoint(
    tmp_path: Path,
) -> None:
    from ds_strategy.accelerate import ZeroAccelerator

    fx = _fixtures()
    accelerator = ZeroAccelerator(config=_config("accelerate_s2", 2))
    net = fx.model()
    accelerator.prepare(net, torch.optim.AdamW(net.parameters()))
    shutil.copytree(DATA / "accelerate_s2" / "state", tmp_path / "state")
    shutil.rmtree(tmp_path / "state" / "pytorch_model")  # Accelerate's files, no engine's
    with pytest.raises(FileNotFoundError, match="no zero_checkpoint/ here, nor a DeepSpeed"):
        accelerator.load_state(str(tmp_path / "state"))


@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_hf_trainer_deepspeed_checkpoint_resumes_on_two_processes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import os
    import sys

    from tests.distributed import free_port, run_command

    script = Path(__file__).resolve().parent / "hf_scripts" / "deepspeed_resume.py"
    out = tmp_path / "result.txt"
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    cmd = [*head, f"--master-port={free_port()}", str(script), str(out), "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_STRATEGY_", "ACCELERATE_"))}
    run_command(cmd, tmp_path, {**env, "OMP_NUM_THREADS": "1"}, 240, script.name)
    steps, diff = out.read_text().split()
    assert int(steps) == 7
    assert float(diff) <= 2e-5, f"max |w - DeepSpeed's continuation| = {float(diff):.3g}"
