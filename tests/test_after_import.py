"""``_after_import.after_import``: a function run once a package is imported, never before."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds_strategy._after_import import after_import


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "ds_strategy_probe_pkg"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "package", None) != name]


def test_runs_after_the_first_import_has_finished(package: str) -> None:
    seen: list[int] = []
    after_import(package, lambda: seen.append(sys.modules[package].VALUE))
    after_import(package, lambda: seen.append(-1))  # one waits already: not a second call
    assert seen == [] and package not in sys.modules
    __import__(package)
    assert seen == [7]  # the module was whole when the function ran
    __import__(package)
    assert seen == [7]


def test_runs_now_when_loaded_and_never_when_blocked(
    package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    __import__(package)
    after_import(package, lambda: seen.append("now"))
    assert seen == ["now"]
    monkeypatch.setitem(sys.modules, package, None)  # imports of it are blocked
    after_import(package, lambda: seen.append("blocked"))
    assert seen == ["now"]
