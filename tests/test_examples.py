"""Each front end's example script runs as its docstring says (2 CPU processes, a few steps)
and its loss falls below a uniform guess over the characters."""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port, run_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 5


def _uniform_loss() -> float:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from _text import CharWindows
    finally:
        sys.path.remove(str(EXAMPLES))
    return math.log(CharWindows().vocab)


def _commands() -> dict[str, list[str]]:
    py = sys.executable
    torchrun = [
        py,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
    ]
    accelerate = [
        py, "-m", "accelerate.commands.accelerate_cli", "launch",
        "--config_file", str(ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
    ]  # fmt: skip
    steps = ["--steps", str(STEPS)]
    return {
        "lightning": [py, str(EXAMPLES / "train_lightning.py"), *steps],
        "fabric": [py, str(EXAMPLES / "train_fabric.py"), *steps],
        "accelerate": [*accelerate, str(EXAMPLES / "train_accelerate.py"), *steps],
        "hf": [*torchrun, str(EXAMPLES / "train_hf.py"), *steps],
    }


@pytest.mark.launcher
@pytest.mark.parametrize("front_end", ["lightning", "fabric", "accelerate", "hf"])
def test_the_example_of_each_front_end_trains(front_end: str, tmp_path: Path) -> None:
    pytest.importorskip(
        {"hf": "transformers", "accelerate": "accelerate"}.get(front_end, "lightning")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_STRATEGY_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = run_command(_commands()[front_end], tmp_path, env, 240, f"train_{front_end}.py")
    found = re.search(r"zero3: (\d+) steps, (?:last|mean) loss ([\d.]+)", out)
    assert found, out[-3000:]
    assert int(found.group(1)) == STEPS
    assert float(found.group(2)) < _uniform_loss()


@pytest.mark.launcher
def test_the_tutorials_script_trains_saves_and_resumes_elsewhere(tmp_path: Path) -> None:
    """docs/tutorials/first-steps.md: 2 processes at ZeRO-3 save; 1 process at ZeRO-1 resumes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_STRATEGY_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1")
    script = str(EXAMPLES / "first_steps.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    first = run_command(
        [*torchrun, f"--master-port={free_port()}", script, "--stage", "3", "--steps", "10",
         "--save", "ckpt"],
        tmp_path, env, 240, "first_steps.py",
    )  # fmt: skip
    assert "ZeRO-3 on 2 rank(s)" in first and "saved ckpt at step 10" in first
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    second = run_command(
        [sys.executable, script, "--stage", "1", "--resume", "ckpt", "--steps", "10"],
        tmp_path, env, 240, "first_steps.py --resume",
    )  # fmt: skip
    assert "resumed ckpt at step 10" in second and "step 20  loss" in second
    half, whole = (
        float(re.search(rf"ZeRO-{s} on {n} rank\(s\): ([\d.]+) MiB", out).group(1))
        for s, n, out in ((3, 2, first), (1, 1, second))
    )
    assert half == pytest.approx(whole / 2, rel=0.02)  # every parameter sharded over 2 ranks
