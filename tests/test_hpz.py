"""ZeRO++ hpZ (``zero_optimization.zero_hpz_partition_size``) on 4 gloo ranks posing as 2
machines x 2: the secondary shards keep backward's (and later micro-batches') all-gathers
inside the machine, training stays exact, the secondary copy is counted while it lives, and
with qwZ and hierarchical collectives the inter-machine traffic of stage 3 falls below a
quarter of plain stage 3's (by ``comm_report()`` and by a counter around
``torch.distributed``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from tests.distributed import run_ranks
from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches
from tests.test_topology import _GroupCounter

STEPS, ACCUM, CLIP = 10, 2, 0.5


def toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def _config(hpz: int, quantized: bool = False, hierarchical: bool = False) -> dict[str, Any]:
    zero = {"stage": 3, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 30,
            "zero_hpz_partition_size": hpz, "zero_quantized_weights": quantized}  # fmt: skip
    topology = {"ranks_per_machine": 2, "hierarchical": hierarchical}
    return parity_config(3, ACCUM, CLIP, zero_optimization=zero, topology=topology)


RUNS = {"plain": (1,), "hpz": (2,), "zero++": (2, True, True)}


def _runs(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    counter = _GroupCounter(2)
    out = {}
    for name, args in RUNS.items():
        counter.links = {"intra": 0, "inter": 0}
        engine = train_engine(toy(), "adamw", _config(*args), data, rank, world, STEPS)
        engine.reset_peak_memory()
        per = data[0].shape[0] // world
        for micro in range(ACCUM):  # one more step, to read the peak of a whole step
            batch = data[micro]
            loss = torch.nn.functional.cross_entropy(
                engine(batch[rank * per : (rank + 1) * per, :-1]).flatten(0, 1),
                batch[rank * per : (rank + 1) * per, 1:].flatten(),
            )
            engine.backward(loss)
            engine.step()
        secondary = sum(g._secondary.numel() * 4 for g in engine.plan.groups
                        if g._secondary is not None)  # fmt: skip
        out[name] = {
            "state": engine.full_state_dict(),
            "report": engine.comm_report(),
            "wire": dict(counter.links),
            "memory": engine.memory_report(),
            "secondary_after_step": secondary,
        }
    return out


def test_backward_gathers_stay_inside_the_machine() -> None:
    for r in run_ranks(_runs, 4, batches(STEPS, ACCUM, 8)):
        plain, hpz, zpp = r["plain"], r["hpz"], r["zero++"]
        assert all(torch.equal(plain["state"][k], v) for k, v in hpz["state"].items())
        # the forward gathers from every rank, the backward inside the machine: measured
        # 0.52 of plain stage 3's inter-machine bytes; with qwZ and hierarchical reductions
        # 0.15 (the bound for ZeRO++: 1/4)
        p, h, z = (x["report"]["inter_machine"] for x in (plain, hpz, zpp))
        assert 0 < h <= 0.6 * p and 0 < z <= 0.25 * p
        assert 0 < zpp["wire"]["inter"] <= 0.3 * plain["wire"]["inter"]
        assert hpz["report"]["intra_machine"] > plain["report"]["intra_machine"]
        # the secondary copy lives from a forward to the step: in the peak, not after it
        assert hpz["secondary_after_step"] == 0
        assert hpz["memory"]["params"] == plain["memory"]["params"]
        assert hpz["memory"]["peak"] > plain["memory"]["peak"]


def _exact(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    return train_engine(toy(), "adamw", _config(2), data, rank, world, STEPS).full_state_dict()


def test_hpz_trains_to_single_process_weights() -> None:
    data = batches(STEPS, ACCUM, 8)
    expected = train_reference(toy(), "adamw", data, STEPS, ACCUM, CLIP)
    for state in run_ranks(_exact, 4, data):
        worst = max((state[k] - v).abs().max().item() for k, v in expected.items())
        assert worst <= 2e-5, worst


def _checkpoint(rank: int, world: int, root: str, data: list[torch.Tensor]) -> Any:
    saved = train_engine(toy(), "adamw", _config(2, True, True), data, rank, world, 3)
    saved.save_checkpoint(root, tag="t")
    plain = parity_config(2, ACCUM, CLIP)
    loaded = train_engine(toy(), "adamw", plain, data, rank, world, 0)
    loaded.load_checkpoint(root, tag="t")
    return saved.full_state_dict(), loaded.full_state_dict()


def test_a_zero_plus_plus_checkpoint_loads_into_plain_zero(tmp_path: Path) -> None:
    for saved, loaded in run_ranks(_checkpoint, 4, str(tmp_path / "c"), batches(3, ACCUM, 8)):
        assert all(torch.equal(saved[k], v) for k, v in loaded.items())


def _bad(rank: int, world: int) -> str:
    config = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}
    model = toy()
    with pytest.raises(ValueError, match="zero_hpz_partition_size=3") as info:
        ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    return str(info.value)


def test_a_partition_that_does_not_divide_the_ranks_is_refused() -> None:
    for message in run_ranks(_bad, 4):
        assert "does not divide the 4 data-parallel ranks" in message
