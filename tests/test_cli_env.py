"""``ds-strategy env``, ``ds-strategy --version`` and ``python -m ds_strategy``: the report
holds this interpreter's real versions, devices, packages and path checks."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.cli import main as cli
from ds_strategy.cli.env import NVME_ENV, OPTIONAL_PACKAGES, check_path, env_report

ROW = re.compile(r"^  (\S+) (\.+) (.*)$")


@pytest.fixture(autouse=True)
def _no_nvme_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report adds a check of $DS_STRATEGY_NVME_PATH: only the tests that set it see one."""
    monkeypatch.delenv(NVME_ENV, raising=False)


def _sections(text: str) -> dict[str, list[re.Match[str]]]:
    """The text report's rows by section title."""
    sections: dict[str, list[re.Match[str]]] = {}
    current: list[re.Match[str]] = []
    for line in text.splitlines():
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        elif (m := ROW.match(line)) is not None:
            current.append(m)
    return sections


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert cli(["env", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _real_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_text_report_sections_hold_real_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["env"]) == 0
    sections = _sections(capsys.readouterr().out)
    assert list(sections) == [
        "ds_strategy",
        "python",
        "torch",
        "packages",
        "front_ends",
        "cpu",
        "nvme",
        "config_defaults",
    ]
    values = {title: {m[1]: m[3] for m in rows} for title, rows in sections.items()}
    assert values["ds_strategy"]["version"] == ds_strategy.__version__
    assert values["python"]["version"] == platform.python_version()
    assert values["torch"]["version"] == torch.__version__
    assert values["torch"]["cuda_available"] == ("yes" if torch.cuda.is_available() else "no")
    assert values["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert values["packages"] == {n: _real_version(n) for n in OPTIONAL_PACKAGES}
    assert values["config_defaults"]["zero_optimization.reduce_bucket_size"] == "500000000"
    for title, rows in sections.items():  # the values of a section start in one column
        assert len({m.start(3) for m in rows}) == 1, title


def test_json_report_holds_versions_backends_and_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = _json(capsys)
    assert report["ds_strategy"]["version"] == ds_strategy.__version__
    assert Path(report["ds_strategy"]["location"]) == Path(ds_strategy.__file__).parent
    assert report["python"]["version"] == platform.python_version()
    assert report["python"]["executable"] == sys.executable
    t = report["torch"]
    assert t["version"] == torch.__version__
    assert t["cuda_build"] == torch.version.cuda
    assert t["cuda_available"] is torch.cuda.is_available()
    assert t["device_count"] == torch.cuda.device_count()
    assert len(t["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert t["gloo_backend"] is torch.distributed.is_gloo_available()
    assert t["nccl_backend"] is torch.distributed.is_nccl_available()
    assert t["mpi_backend"] is torch.distributed.is_mpi_available()
    assert (t["nccl_version"] is None) is not torch.distributed.is_nccl_available()
    assert report["packages"] == {n: _real_version(n) for n in OPTIONAL_PACKAGES}
    assert report["cpu"]["torch_threads"] == torch.get_num_threads()
    assert report["cpu"]["cpus"] == os.cpu_count()
    assert report["nvme"] == []
    cfg = ds_strategy.load_config(None)
    zo = cfg.zero_optimization
    assert report["config_defaults"] == {
        "zero_optimization.stage": zo.stage,
        "zero_optimization.reduce_bucket_size": zo.reduce_bucket_size,
        "zero_optimization.stage3_prefetch_bucket_size": zo.stage3_prefetch_bucket_size,
        "zero_optimization.stage3_param_persistence_threshold": (
            zo.stage3_param_persistence_threshold
        ),
        "zero_optimization.stage3_max_live_parameters": zo.stage3_max_live_parameters,
        "zero_optimization.offload_optimizer.device": "none",
        "zero_optimization.offload_param.device": "none",
        "gradient_clipping": cfg.gradient_clipping,
        "steps_per_print": cfg.steps_per_print,
    }
    # DeepSpeed's documented defaults, so a report that read the wrong field would differ
    assert zo.stage3_prefetch_bucket_size == 50_000_000 != zo.reduce_bucket_size


def test_missing_package_and_front_end_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    real_version = importlib.metadata.version
    real_find_spec = importlib.util.find_spec

    def version(name: str) -> str:
        if name == "safetensors":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "accelerate" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    report = env_report()
    assert report["packages"]["safetensors"] == "not installed"
    assert report["packages"]["torchao"] == _real_version("torchao")
    fronts = report["front_ends"]
    assert fronts["ds_strategy.accelerate"]["importable"] is False
    assert fronts["ds_strategy.accelerate"]["missing"] == ["accelerate"]
    assert fronts["ds_strategy.hf"]["missing"] == (
        ["transformers", "accelerate"] if real_find_spec("transformers") is None else ["accelerate"]
    )
    has_lightning = real_find_spec("lightning") is not None
    assert fronts["ds_strategy.lightning"]["importable"] is has_lightning
    assert fronts["ds_strategy.fabric"]["importable"] is has_lightning


@pytest.mark.launcher
def test_python_m_ds_strategy_env_imports_no_framework() -> None:
    # -X importtime lists every module the process imports, on stderr
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ds_strategy", "env", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["torch"]["version"] == torch.__version__
    assert report["front_ends"]["ds_strategy.hf"]["needs"] == ["transformers", "accelerate"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "torch" in imported  # the listing is what it claims to be
    heavy = {"lightning", "transformers", "accelerate", "wandb", "comet_ml", "matplotlib"}
    assert imported & heavy == set()


def test_nvme_check_on_a_writable_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (check,) = _json(capsys, "--nvme-path", str(tmp_path))["nvme"]
    assert check["path"] == str(tmp_path)
    assert check["exists"] is True and check["is_dir"] is True
    assert check["writable"] is True
    assert check["free_bytes"] > 0
    assert check["o_direct"] in ((True, False) if hasattr(os, "O_DIRECT") else (None,))
    assert (check["o_direct"] is False) == any("O_DIRECT" in p for p in check["problems"])
    assert list(tmp_path.iterdir()) == []  # the probe files are gone


def test_nvme_check_on_a_missing_path_and_a_file(tmp_path: Path) -> None:
    missing = check_path(tmp_path / "no_such_dir")
    assert (missing["exists"], missing["is_dir"], missing["writable"]) == (False, False, False)
    assert missing["free_bytes"] is None
    assert missing["problems"] == ["does not exist"]
    (tmp_path / "file").write_text("x")
    a_file = check_path(tmp_path / "file")
    assert (a_file["exists"], a_file["is_dir"], a_file["writable"]) == (True, False, False)
    assert a_file["problems"] == ["not a directory"]


def test_nvme_path_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(NVME_ENV, str(tmp_path / "gone"))
    assert cli(["env", "--nvme-path", str(tmp_path)]) == 0
    nvme = _sections(capsys.readouterr().out)["nvme"]
    rows = [(m[1], m[3]) for m in nvme]
    assert ("source", NVME_ENV) in rows
    assert ("problem", "does not exist") in rows
    assert [v for k, v in rows if k == "writable"] == ["yes", "no"]


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"ds-strategy {ds_strategy.__version__}\n"


@pytest.mark.launcher
def test_python_m_ds_strategy_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ds_strategy", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"ds-strategy {ds_strategy.__version__}\n"
