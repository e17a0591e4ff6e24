"""Checkpoints written by DeepSpeed through a front end resume under ours, at another ZeRO stage,
ending where the framework and DeepSpeed's own continuation ended: Lightning's own
``DeepSpeedStrategy`` checkpoint (a ``.ckpt`` directory, Lightning's loop state as DeepSpeed's
client state) with ``Trainer.fit(ckpt_path=...)`` at one and two processes; a Hugging Face
Trainer's ``checkpoint-N/global_stepN`` (a GPT-2 whose head is tied to its embedding) with
``ZeroTrainer.train(resume_from_checkpoint=...)`` in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.lightning_scripts.launch import max_diff, run_for_results

DATA = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"


@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "devices"), [(3, 1), (1, 2)])
def test_lightning_deepspeed_checkpoint_resumes_in_the_trainer(
    tmp_path: Path, stage: int, devices: int
) -> None:
    pytest.importorskip("lightning")
    out = run_for_results("deepspeed_resume.py", tmp_path, args=(str(stage), str(devices)))
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
    trainer = ZeroTrainer(model=net, args=arguments, train_dataset=data, zero_config=config)
    trainer.train(resume_from_checkpoint=str(DATA / "hf_s2" / "checkpoint"))
    assert trainer.state.global_step == 7
    got = trainer.accelerator.get_state_dict(trainer.model)
    reference = load_file(DATA / "hf_s2" / "continued.safetensors")
    diff = max_diff({k: got[k] for k in reference}, reference)
    assert diff <= 2e-5, f"max |w - DeepSpeed's continuation| = {diff:.3g}"
