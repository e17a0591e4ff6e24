"""Lightning's Trainer with a ``tensor_parallel`` config: the sampler shards by data-parallel
rank only (the two tensor-parallel ranks of a group read the same rows) and training equals
one process on the global batch (tests/lightning_scripts/tensor_parallel.py, 4 processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lightning_scripts.launch import run_script
from tests.tp_common import check_against_one_process

# launcher: the Trainer runs as a 4-process script
pytestmark = pytest.mark.launcher


def test_tensor_parallel_trainer_equals_one_process(tmp_path: Path) -> None:
    run_script("tensor_parallel.py", tmp_path, timeout=300, ranks=4)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    check_against_one_process(ranks, torch.load(tmp_path / "state.pt"), prefix="model.")
