"""Back to DeepSpeed: ``ds-strategy convert SRC DST --to deepspeed`` writes one of our
checkpoints in DeepSpeed's layout for a world size and ZeRO stage. DeepSpeed itself resumes
from it and ends where our uninterrupted run ends (where DeepSpeed is installed: in this
Python, or the one ``DEEPSPEED_PYTHON`` names); everywhere, the export reads back exactly and
resumes here through DeepSpeed's layout."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ds_strategy
from ds_strategy.cli import main as cli
from ds_strategy.core.checkpoint.deepspeed.layout import find_deepspeed
from ds_strategy.core.checkpoint.deepspeed.opening import open_deepspeed
from ds_strategy.core.checkpoint.validate import CheckpointError
from tests.distributed import free_port

DATA = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))
from make_fixtures import MICRO, MORE, STEPS, WORLD, config, model  # noqa: E402

sys.path.remove(str(DATA))
TOL = 2e-5


def _train(engine: ds_strategy.ZeroEngine, steps: range, dtype: torch.dtype, world: int) -> None:
    data = load_file(DATA / "batches.safetensors")
    per_rank = WORLD * MICRO // world
    for i in steps:
        for m in range(per_rank // MICRO):
            rows = slice(m * MICRO, (m + 1) * MICRO)
            x, y = data["inputs"][i, rows], data["targets"][i, rows]
            engine.backward(((engine(x.to(dtype)).float() - y) ** 2).mean())
            engine.step()


def _ours(tmp: Path, stage: int, precision: str) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """Our one-process run: saved after 4 steps; the weights after 7."""
    cfg = config(stage, precision)
    cfg["gradient_accumulation_steps"] = WORLD  # the global batch of two ranks
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    engine = ds_strategy.initialize(model(), None, cfg)
    _train(engine, range(STEPS), dtype, 1)
    engine.save_checkpoint(tmp / "ours", client_state={"epoch": 3})
    _train(engine, range(STEPS, STEPS + MORE), dtype, 1)
    final = engine.full_state_dict()
    engine.destroy()
    return tmp / "ours", final, cfg


@pytest.mark.parametrize(("stage", "target"), [(2, 2), (3, 1), (1, 3)])
def test_an_export_reads_back_and_resumes_here_through_deepspeeds_layout(
    tmp_path: Path, stage: int, target: int
) -> None:
    src, final, cfg = _ours(tmp_path, stage, "fp32")
    assert (
        cli(
            ["convert", str(src), str(tmp_path / "ds"), "--world-size", "2", "--stage", str(target)]
        )
        == 0
    )
    tag = find_deepspeed(tmp_path / "ds")
    assert tag == tmp_path / "ds" / f"global_step{STEPS}"
    ckpt = open_deepspeed(tag)  # without DeepSpeed: its classes load as records
    assert (ckpt.stage, ckpt.world_size, ckpt.global_steps) == (target, 2, STEPS)
    assert ckpt.client_state == {"epoch": 3}
    assert ckpt.ds_config["zero_optimization"]["stage"] == target
    # resumed here from the export at another stage: the uninterrupted run's weights
    cfg["zero_optimization"]["stage"] = 3 - target % 3
    engine = ds_strategy.initialize(model(), None, cfg)
    assert engine.load_checkpoint(tmp_path / "ds") == {"epoch": 3}
    _train(engine, range(STEPS, STEPS + MORE), torch.float32, 1)
    got = engine.full_state_dict()
    diff = max((got[k] - final[k]).abs().max().item() for k in final)
    assert diff <= TOL, f"max |w - uninterrupted| = {diff:.3g}"


def test_an_export_refuses_an_existing_tag_and_a_bad_layout(tmp_path: Path) -> None:
    src, _, _ = _ours(tmp_path, 2, "fp32")
    ds_strategy.convert(src, tmp_path / "ds", world_size=2, stage=2)
    with pytest.raises(FileExistsError, match="global_step4 exists"):
        ds_strategy.convert(src, tmp_path / "ds", world_size=2, stage=2)
    with pytest.raises(ValueError, match="'deepspeed'"):
        ds_strategy.convert(src, tmp_path / "x", to="fsdp", world_size=2, stage=2)
    with pytest.raises(ValueError, match="stage=4"):
        ds_strategy.convert(src, tmp_path / "x", world_size=2, stage=4)
    with pytest.raises((CheckpointError, FileNotFoundError)):
        ds_strategy.convert(tmp_path / "nothing", tmp_path / "x", world_size=2, stage=2)


def _deepspeed_python() -> str | None:
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable
    return os.environ.get("DEEPSPEED_PYTHON")


@pytest.mark.launcher
@pytest.mark.parametrize(
    ("stage", "precision"), [(1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")]
)
def test_deepspeed_resumes_an_export_where_our_run_ends(
    tmp_path: Path, stage: int, precision: str
) -> None:
    python = _deepspeed_python()
    if python is None:
        pytest.skip("DeepSpeed is not installed (set DEEPSPEED_PYTHON to a Python that has it)")
    src, final, cfg = _ours(tmp_path, stage, precision)
    ds_strategy.convert(src, tmp_path / "ds", world_size=WORLD, stage=stage)
    cfg["gradient_accumulation_steps"] = 1  # two ranks: one micro-batch each
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "continued.safetensors"
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={WORLD}",
        f"--master-port={free_port()}",
    ]
    cmd += [
        str(DATA / "resume_in_deepspeed.py"),
        str(tmp_path / "ds"),
        str(tmp_path / "config.json"),
        str(out),
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "global_steps 7 client 3" in run.stdout
    got = load_file(out)
    diff = max((got[k] - final[k]).abs().max().item() for k in final)
    assert diff <= TOL, f"max |w(DeepSpeed resumed) - ours uninterrupted| = {diff:.3g}"
