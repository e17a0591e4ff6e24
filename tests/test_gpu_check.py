"""``benchmarks/gpu_check.py``: one command for everything that needs a CUDA device. Here
(no device) it runs nothing and says so; every part it would run exists and takes the
options it is given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_device_it_runs_nothing_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "no CUDA device here; nothing was run" in done.stderr
    assert not out.exists()


def test_every_part_names_a_script_that_takes_its_options() -> None:
    parts = gpu_check.parts(gpus=2)
    assert [name for name, *_ in parts] == [
        "gpu tests",
        "bench_zero on CUDA",
        "CPU offload on the GPU",
    ]
    assert abs(sum(share for *_, share in parts) - 1.0) < 1e-9
    for _, command, _ in parts[1:]:
        script = Path(command[1])
        assert script.is_file(), script
        options = [c for c in command[2:] if c.startswith("--")]
        text = script.read_text()
        for option in options:
            assert f'"{option}"' in text, (script.name, option)
    assert "gpu" in (ROOT / "pyproject.toml").read_text()  # the marker pytest -m gpu selects
