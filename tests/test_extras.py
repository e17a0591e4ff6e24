"""Optional front ends: the core requires only what it imports (torch, omegaconf, safetensors,
tqdm); Lightning, Accelerate, transformers and Hydra come with their extras, and importing a
front end without its framework names the extra to install."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from .test_project import _pyproject

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("lightning", "accelerate", "transformers", "hydra")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_requirements_are_what_the_core_imports() -> None:
    project = _pyproject()["project"]
    assert _names(project["dependencies"]) == {"torch", "omegaconf", "safetensors", "tqdm"}
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert extras["lightning"] == {"lightning"} and extras["accelerate"] == {"accelerate"}
    assert extras["hf"] == {"transformers", "accelerate"}
    assert extras["recipes"] >= {"hydra-core", "lightning", "accelerate"}
    (everything,) = project["optional-dependencies"]["all"]
    listed = set(everything.split("[")[1].rstrip("]").split(","))
    assert listed == set(extras) - {"all", "test"}
    # the core's own modules import none of the frameworks
    front_ends = ("accelerate", "lightning", "fabric", "hf", "frontends", "_lightning_hook.py")
    for path in (ROOT / "ds_strategy").rglob("*.py"):
        if path.relative_to(ROOT / "ds_strategy").parts[0] in front_ends:
            continue
        text = path.read_text()
        for name in FRAMEWORKS:
            assert not re.search(rf"^\s*(import|from) {name}\b", text, re.M), (path, name)


@pytest.mark.launcher
def test_each_front_end_without_its_framework_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        for name in ("lightning", "accelerate", "transformers", "hydra"):
            sys.modules[name] = None  # as if not installed
        import ds_strategy
        assert callable(ds_strategy.initialize)
        for front_end in ("lightning", "fabric", "accelerate", "hf"):
            try:
                __import__(f"ds_strategy.{front_end}")
            except ImportError as e:
                print(front_end, "|", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" | ") for line in out.stdout.strip().splitlines())
    assert lines == {
        "lightning": "ds_strategy.lightning needs lightning, which is not installed: "
        "pip install 'ds_strategy[lightning]'",
        "fabric": "ds_strategy.fabric needs lightning, which is not installed: "
        "pip install 'ds_strategy[lightning]'",
        "accelerate": "ds_strategy.accelerate needs accelerate, which is not installed: "
        "pip install 'ds_strategy[accelerate]'",
        "hf": "ds_strategy.hf needs transformers, accelerate, which is not installed: "
        "pip install 'ds_strategy[hf]'",
    }


RAW_STEP = """
import sys, torch, ds_strategy
assert not [m for m in ("lightning", "accelerate", "hydra", "transformers") if m in sys.modules]
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "zero3")
engine.backward(engine(torch.randn(4, 8)).square().mean())
engine.step()
print("trained", engine.stage, engine.global_steps)
"""

TRAINER = """
import lightning as L, ds_strategy
trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False)
print("trainer", type(trainer.strategy).__name__, trainer.strategy.stage)
"""


@pytest.mark.launcher
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fresh_venv_trains_without_extras_and_lightning_comes_with_its_own(
    tmp_path: Path,
) -> None:
    """``pip install .`` in a new venv (no extras), a raw-loop ZeRO-3 step with no framework
    installed, then ``pip install '.[lightning]'`` and ``Trainer(strategy="zero3")``."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")

    def run(*args: str) -> str:
        out = subprocess.run(
            [python, *args], capture_output=True, text=True, timeout=400, cwd=tmp_path
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout

    pip = ("-m", "pip", "install", "-q", "--disable-pip-version-check")
    run(*pip, "torch==2.13.0")  # the CPU build, as .ci/run installs it
    run(*pip, str(ROOT))
    installed = run("-m", "pip", "list", "--format=freeze").lower()
    assert not [
        f
        for f in ("lightning", "accelerate", "hydra-core", "transformers")
        if f"\n{f}==" in f"\n{installed}"
    ]
    assert "trained 3 1" in run("-c", RAW_STEP)
    run(*pip, f"{ROOT}[lightning]")
    assert "trainer ZeroStrategy 3" in run("-c", TRAINER)
