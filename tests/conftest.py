"""Fixtures shared by test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.pool import RankPools, session_pools


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests need a CUDA device: skipped, with the reason, where none is present.
    The files go in the order that keeps both xdist workers busy to the end."""
    import torch

    _heaviest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _heaviest_files_first(items: list[pytest.Item]) -> None:
    """pytest-xdist hands whole files to the two workers (``--dist loadfile``) in collection
    order (``--no-loadscope-reorder``; by default it would put the files with the most tests
    first, which leaves the long files of few tests for the end, where one worker runs them
    while the other waits). So files go by their count of ``launcher`` and ``slow`` tests
    (seconds each; the others take a fraction of one), most first, and the many quick files
    fill the end evenly. A file's own order is kept (the sort is stable)."""

    def file(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    weight: dict[str, float] = {}
    for item in items:
        heavy = item.get_closest_marker("launcher") or item.get_closest_marker("slow")
        weight[file(item)] = weight.get(file(item), 0.0) + (1.0 if heavy else 0.01)
    items.sort(key=lambda item: -weight[file(item)])


_POOL_SUMMARY = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session", autouse=True)
def rank_pools(request: pytest.FixtureRequest) -> Iterator[RankPools]:
    """Gloo ranks started once for the whole run, one pool per world size used; every
    ``run_ranks`` call of the session runs in them (see ``tests/pool.py``). Under
    pytest-xdist each worker has its own."""
    with session_pools() as pools:
        yield pools
        summary = pools.summary()
        worker = getattr(request.config, "workerinput", {}).get("workerid")
        if worker is not None:  # an xdist worker: the controller prints it (below)
            request.config.workeroutput["pool_summary"] = [f"[{worker}] {s}" for s in summary]
        else:
            request.config.stash[_POOL_SUMMARY] = summary


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """An xdist worker finished: keep its pools' summary for the terminal summary."""
    lines = getattr(node, "workeroutput", {}).get("pool_summary", [])
    node.config.stash.setdefault(_POOL_SUMMARY, []).extend(lines)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """How often each pool's ranks were started, and after which tests they were replaced."""
    lines = config.stash.get(_POOL_SUMMARY, [])
    if lines:
        terminalreporter.write_sep("-", "rank pools")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def clean_accelerate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Accelerate keeps process-wide singletons and reads the environment: the test starts
    from none and no launcher variables, and leaves none behind."""
    from accelerate.state import AcceleratorState, GradientState

    for name in list(os.environ):
        if name.startswith(("DS_STRATEGY_", "ACCELERATE_")) or name in ("WORLD_SIZE", "RANK"):
            monkeypatch.delenv(name)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
