"""Checkpoints written by DeepSpeed through a front end resume under ours: Lightning's own
``DeepSpeedStrategy`` checkpoint (a ``.ckpt`` directory, Lightning's loop state as DeepSpeed's
client state) with ``Trainer.fit(ckpt_path=...)`` at another ZeRO stage, at one and two
processes, ending where Lightning and DeepSpeed's own continuation ended."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.lightning_scripts.launch import max_diff, run_for_results

pytest.importorskip("lightning")
pytestmark = [pytest.mark.timeout(300), pytest.mark.launcher]

DATA = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"


@pytest.mark.parametrize(("stage", "devices"), [(3, 1), (1, 2)])
def test_lightning_deepspeed_checkpoint_resumes_in_the_trainer(
    tmp_path: Path, stage: int, devices: int
) -> None:
    out = run_for_results("deepspeed_resume.py", tmp_path, args=(str(stage), str(devices)))
    reference = load_file(DATA / "lightning_s2" / "continued.safetensors")
    assert out["global_step"] == 7
    assert out["lr"] == pytest.approx(0.02)  # the LambdaLR's position came back with the loops
    diff = max_diff(out["weights"], reference)
    assert diff <= 2e-5, f"max |w - DeepSpeed's continuation| = {diff:.3g}"
