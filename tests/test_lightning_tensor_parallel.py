"""Lightning's Trainer with a ``tensor_parallel`` config, then with ``sequence_parallel_size``:
the sampler shards by data-parallel rank only (the two ranks splitting a layer or a sequence
read the same rows) and training equals one process on the global batch
(tests/lightning_scripts/tensor_parallel.py, 4 processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lightning_scripts.launch import run_script
from tests.tp_common import check_against_one_process

# launcher: the Trainer runs as a 4-process script
pytestmark = pytest.mark.launcher


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lightning_split")
    run_script("tensor_parallel.py", out, timeout=300, ranks=4)
    return out


@pytest.mark.parametrize("pair", ["tp", "sp"])
def test_split_layers_or_sequences_train_as_one_process(runs: Path, pair: str) -> None:
    ranks = [torch.load(runs / f"{pair}_rank{r}.pt") for r in range(4)]
    state = torch.load(runs / f"{pair}_state.pt")
    check_against_one_process(ranks, state, prefix="model.", pair=pair)
