"""``ZeroAccelerator`` with a ``tensor_parallel`` section under ``accelerate launch`` (4 CPU
processes): Accelerate's data loader shards by data-parallel rank only and the plain loop
trains as one process would on the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.accelerate_scripts.launch import launch
from tests.tp_common import check_against_one_process

# launcher: an `accelerate launch` on 4 processes
pytestmark = pytest.mark.launcher


def test_tensor_parallel_accelerate_loop_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    launch("tensor_parallel.py", "--out", str(out), num_processes=4, timeout=300)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(4)]
    check_against_one_process(ranks, torch.load(out))
