"""Lightning's Trainer with a ``tensor_parallel`` config: the sampler shards by data-parallel
rank only (the two tensor-parallel ranks of a group read the same rows) and training equals
one process on the global batch (tests/lightning_scripts/tensor_parallel.py, 4 processes)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.lightning_scripts.launch import run_script
from tests.lightning_scripts.tensor_parallel import STEPS, gpt, loss_of
from tests.test_tensor_parallel import key_bias

TOL = 2e-5


def test_tensor_parallel_trainer_equals_one_process(tmp_path: Path) -> None:
    run_script("tensor_parallel.py", tmp_path, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for r, got in enumerate(ranks):
        assert got["coordinates"] == {"pp": 0, "dp": r // 2, "tp": r % 2}
    assert torch.equal(ranks[0]["seen"], ranks[1]["seen"])  # one tensor-parallel group
    assert torch.equal(ranks[2]["seen"], ranks[3]["seen"])
    assert not torch.equal(ranks[0]["seen"], ranks[2]["seen"])  # two data-parallel ranks
    # one process: each optimizer step's global batch is both data-parallel ranks' rows of
    # its two micro-batches, each micro-batch's loss the mean of the two ranks' means
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first, second = ranks[0]["seen"], ranks[2]["seen"]
    for step in range(STEPS):
        for micro in (2 * step, 2 * step + 1):
            loss = (loss_of(model, first[micro]) + loss_of(model, second[micro])) / 2
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    state = torch.load(tmp_path / "state.pt")
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert state.keys() == expected.keys()
    diff = {k: (state[k] - expected[k]).abs() for k in expected}
    for key in [k for k in diff if k.endswith("qkv.bias")]:
        keys = key_bias(diff[key])  # zero exact gradient: see test_tensor_parallel.py
        assert diff[key][keys].max() <= 1e-3
        diff[key] = diff[key][~keys]
    worst = max(d.max().item() for d in diff.values())
    assert worst <= TOL, worst
    moved = max(
        (expected[k] - v).abs().max().item()
        for k, v in {f"model.{k}": v for k, v in gpt().state_dict().items()}.items()
    )
    assert moved > 1e-2
