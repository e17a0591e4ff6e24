"""The project's own files: one version, the license the metadata names, a changelog entry for
the version, the typing marker and the presets shipped as package data."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

import ds_strategy

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_and_installed_as_such() -> None:
    project = _pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "ds_strategy.__version__"
    assert importlib.metadata.version("ds_strategy") == ds_strategy.__version__


def test_license_changelog_and_typing_marker() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {ds_strategy.__version__} - " in changelog and "## Unreleased" in changelog
    assert (Path(ds_strategy.__file__).parent / "py.typed").is_file()
    data = _pyproject()["tool"]["setuptools"]["package-data"]["ds_strategy"]
    assert {"py.typed", "presets/*.yaml", "presets/precision/*.yaml"} <= set(data)
