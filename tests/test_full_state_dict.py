"""``engine.full_state_dict(rank0_only=True)``: the same weights on rank 0, nothing on the
others, gathered to rank 0 instead of all-gathered (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import ds_strategy
from tests.distributed import run_ranks
from tests.models import ToyLM, batches, lm_loss

CASES = {
    "stage0": {"zero_optimization": {"stage": 0}},
    "stage1": {"zero_optimization": {"stage": 1}},
    "stage2-bf16": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}},
    "stage3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
}


def worker(rank: int, world: int) -> dict:
    out = {}
    for name, config in CASES.items():
        torch.manual_seed(0)
        model = ToyLM()
        engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters()), config)
        for batch in batches(2, 1, 8, seed=1):
            engine.backward(lm_loss(engine, batch[rank * 4 : rank * 4 + 4]))
            engine.step()
        everywhere = engine.full_state_dict()
        engine.comm_report()  # reset the byte counts
        only = engine.full_state_dict(rank0_only=True)
        sent = engine.comm_report()
        same = only.keys() == everywhere.keys() and all(
            torch.equal(only[k], everywhere[k]) for k in only
        )
        out[name] = {"empty": not only, "same": same, "sent": sent}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(worker, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_rank0_only_gathers_to_rank0_alone(results: list[dict], case: str) -> None:
    r0, r1 = results[0][case], results[1][case]
    assert r0["same"] and not r0["empty"]  # rank 0: exactly the all-gathered weights
    assert r1["empty"]  # rank 1 builds nothing
    for r in (r0, r1):
        assert r["sent"].get("all_gather", 0) == 0  # no rank received the full weights
    if case in ("stage2-bf16", "stage3"):  # sharded masters / parameters go to rank 0 only
        assert r1["sent"]["gather"] > 0 and r0["sent"].get("gather", 0) == 0
    else:  # fp32 stages 0/1 hold the full parameters on every rank: nothing to send
        assert r1["sent"].get("gather", 0) == 0
