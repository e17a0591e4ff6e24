"""What the front-end tests of tensor parallelism share: the demo GPT, its data and loss (used
by the launched scripts, tests/lightning_scripts/tensor_parallel.py and
tests/accelerate_scripts/tensor_parallel.py), and the check of a 4-process run (2
data-parallel x 2 tensor-parallel) against one process on the global batch."""

from __future__ import annotations

from typing import Any

import torch

from ds_strategy.demos.gpt import GPT, GPTConfig

VOCAB, SEQ, SAMPLES = 37, 9, 64
STEPS = 4  # optimizer steps of 2 micro-batches, clipped at 0.5, AdamW(lr=1e-2)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(3))


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=VOCAB, d=32, layers=2, heads=4, seq=SEQ))


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def check_against_one_process(
    ranks: list[dict[str, Any]], state: dict[str, torch.Tensor], prefix: str = "", pair: str = "tp"
) -> None:
    """``ranks[r]``: the rows rank ``r`` trained on and its mesh coordinates; ``state``: the
    consolidated weights, keyed ``prefix`` + the GPT's names; ``pair``: the dimension of the
    two ranks of a data-parallel rank (``"tp"`` or ``"sp"``)."""
    from tests.test_tensor_parallel import key_bias

    for r, got in enumerate(ranks):
        assert {k: got["coordinates"].get(k, 0) for k in ("pp", "dp", pair)} == {
            "pp": 0,
            "dp": r // 2,
            pair: r % 2,
        }
    assert torch.equal(ranks[0]["seen"], ranks[1]["seen"])  # one tensor/sequence group
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
    expected = {prefix + k: v for k, v in model.state_dict().items()}
    assert state.keys() == expected.keys()
    diff = {k: (state[k] - expected[k]).abs() for k in expected}
    for key in [k for k in diff if k.endswith("qkv.bias")]:
        keys = key_bias(diff[key])  # zero exact gradient: see test_tensor_parallel.py
        if pair == "tp":  # split by heads, its rounding noise stays small; split by tokens,
            # attention sums in another order and AdamW turns the noise into steps of lr
            assert diff[key][keys].max() <= 1e-3
        diff[key] = diff[key][~keys]
    assert max(d.max().item() for d in diff.values()) <= 2e-5
    initial = gpt().state_dict()
    assert max((expected[prefix + k] - v).abs().max().item() for k, v in initial.items()) > 1e-2
