"""Optional front ends: the core requires only what it imports (torch, omegaconf, safetensors,
tqdm) and numpy, which torch's object collectives need; Lightning, Accelerate, transformers and Hydra come with their extras, and importing a
front end without its framework names the extra to install."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .test_project import _pyproject

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("lightning", "accelerate", "transformers", "hydra")


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_requirements_are_what_the_core_imports() -> None:
    project = _pyproject()["project"]
    core = {"torch", "omegaconf", "safetensors", "tqdm", "numpy"}
    assert _names(project["dependencies"]) == core
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert extras["lightning"] == {"lightning"} and extras["accelerate"] == {"accelerate"}
    assert extras["hf"] == {"transformers", "accelerate"}
    assert extras["recipes"] >= {"hydra-core", "lightning", "accelerate"}
    (everything,) = project["optional-dependencies"]["all"]
    listed = set(everything.split("[")[1].rstrip("]").split(","))
    assert listed == set(extras) - {"all", "test", "docs"}  # docs: for building the site
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
