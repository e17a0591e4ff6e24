"""Fixtures shared by test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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
