"""The docs site: ``mkdocs build --strict`` (no broken link, anchor or API reference), the
generated reference pages hold what the code holds, and the built site opens in a real
headless browser (Chromium) with its titles; the README stays a front door."""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return out


@pytest.mark.launcher
def test_the_generated_reference_pages_hold_every_key_and_command(site: Path) -> None:
    from ds_strategy.config._schema import config_keys

    config = (site / "reference" / "config" / "index.html").read_text()
    keys = config_keys()
    assert len(keys) > 100
    for key in keys:
        assert f"<code>{key.path}</code>" in config, key.path
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("consolidate", "convert", "estimate", "generate", "plot"):
        assert f"usage: ds-strategy {command}" in cli


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.skip("no Chromium on this machine (.ci/run installs it)")


def _rendered(url: str) -> str:
    """The page's DOM after Chromium loaded it and ran its scripts."""
    run = subprocess.run(
        [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.launcher
def test_the_site_renders_in_a_headless_browser(served: str) -> None:
    home = _rendered(served + "/")
    assert "<title>ds_strategy</title>" in home
    assert "Getting started" in home and "md-search" in home  # Material's page, scripts run
    api = _rendered(served + "/reference/api/")
    assert "<title>Python API - ds_strategy</title>" in api
    for name in ("initialize", "ZeroEngine", "load_config", "init_inference"):
        assert f'id="ds_strategy.{name}"' in api
    assert re.search(r"Wrap <code>model</code> and <code>optimizer</code>", api)


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 320
    for page in re.findall(r"\]\(docs/([^)#]+\.md)", readme):
        assert (ROOT / "docs" / page).is_file(), page
