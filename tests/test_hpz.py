"""ZeRO++ on 4 gloo ranks posing as 2 machines x 2. hpZ (``zero_hpz_partition_size``): the
secondary shards keep backward's (and later micro-batches') all-gathers inside the machine,
training stays exact, the secondary copy is counted while it lives. hpZ + qwZ + qgZ: the
inter-machine traffic of stage 3 falls below a quarter of plain stage 3's (by
``comm_report()`` and by a counter around ``torch.distributed``), qgZ's reduce-scatter stays
within its error bound, and the demo GPT trains 150 steps to within 3% of plain stage 3."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.estimate import ModelFacts, estimate
from tests.compression_common import corpus_losses
from tests.distributed import run_ranks_each
from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches
from tests.test_topology import _GroupCounter

# slow: 4 ranks posing as 2 machines x 2, every case in one run of about 20-30 s
pytestmark = pytest.mark.slow

STEPS, ACCUM, CLIP = 10, 2, 0.5


def toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def _config(hpz: int, quantized: bool = False) -> dict[str, Any]:
    """hpZ over ``hpz`` ranks; ``quantized``: with qwZ and qgZ (ZeRO++ whole). Every unit is
    gathered again for its backward (reuse distance 0): the gathers hpZ keeps in the machine."""
    zero = {"stage": 3, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 30,
            "zero_hpz_partition_size": hpz, "zero_quantized_weights": quantized,
            "zero_quantized_gradients": quantized, "stage3_max_reuse_distance": 0}  # fmt: skip
    return parity_config(3, ACCUM, CLIP, zero_optimization=zero,
                         topology={"ranks_per_machine": 2})  # fmt: skip


RUNS = {"plain": (1,), "hpz": (2,), "zero++": (2, True)}


def _runs(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    counter = _GroupCounter(2)
    out = {}
    for name, args in RUNS.items():
        counter.links = {"intra": 0, "inter": 0}
        engine = train_engine(toy(), "adamw", _config(*args), data, rank, world, STEPS)
        engine.reset_peak_memory()
        per = data[0].shape[0] // world
        held = []
        for micro in range(ACCUM):  # one more step, to read the peak of a whole step
            batch = data[micro]
            loss = torch.nn.functional.cross_entropy(
                engine(batch[rank * per : (rank + 1) * per, :-1]).flatten(0, 1),
                batch[rank * per : (rank + 1) * per, 1:].flatten(),
            )
            engine.backward(loss)
            engine.step()
            held.append(sum(g._secondary.numel() * 4 for g in engine.plan.groups
                            if g._secondary is not None))  # fmt: skip
        units = [g for g in engine.plan.groups if g.policy.shard_params]
        out[name] = {
            "state": engine.full_state_dict(),
            "report": engine.comm_report(),
            "wire": dict(counter.links),
            "memory": engine.memory_report(),
            "secondary_in_step": held[0],  # between two micro-batches of one step
            "secondary_after_step": held[-1],
            "sharded_numel": sum(g.layout.total for g in units),
        }
    return out


def test_backward_gathers_stay_inside_the_machine(runs: dict[Any, list[Any]]) -> None:
    for r in runs["layouts"]:
        plain, hpz, zpp = r["plain"], r["hpz"], r["zero++"]
        assert all(torch.equal(plain["state"][k], v) for k, v in hpz["state"].items())
        # the forward gathers from every rank, the backward inside the machine: measured
        # 0.52 of plain stage 3's inter-machine bytes; with qwZ and qgZ (whose reduce-scatter
        # goes inside the machine first) 0.14 (the bound DeepSpeed's ZeRO++ claims: 1/4)
        p, h, z = (x["report"]["inter_machine"] for x in (plain, hpz, zpp))
        assert 0 < h <= 0.6 * p and 0 < z <= 0.25 * p
        assert 0 < zpp["wire"]["inter"] <= 0.3 * plain["wire"]["inter"]
        assert hpz["report"]["intra_machine"] > plain["report"]["intra_machine"]
        # the secondary copy lives from a forward to the step: in the peak, not after it
        assert hpz["secondary_after_step"] == 0 and plain["secondary_in_step"] == 0
        # as the estimator counts it: 4 bytes x the sharded parameters / P (padding apart)
        expected = estimate(ModelFacts(params=hpz["sharded_numel"]), 4, 3, precision="fp32",
                            hpz_partition_size=2).device["hpz_secondary"]  # fmt: skip
        assert expected <= hpz["secondary_in_step"] <= 1.05 * expected
        assert hpz["memory"]["params"] == plain["memory"]["params"]
        assert hpz["memory"]["peak"] > plain["memory"]["peak"]


def _exact(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    return train_engine(toy(), "adamw", _config(2), data, rank, world, STEPS).full_state_dict()


def test_hpz_trains_to_single_process_weights(runs: dict[Any, list[Any]]) -> None:
    expected = train_reference(toy(), "adamw", batches(STEPS, ACCUM, 8), STEPS, ACCUM, CLIP)
    for state in runs["exact"]:
        worst = max((state[k] - v).abs().max().item() for k, v in expected.items())
        assert worst <= 2e-5, worst


def _checkpoint(rank: int, world: int, root: str, data: list[torch.Tensor]) -> Any:
    saved = train_engine(toy(), "adamw", _config(2, True), data, rank, world, 3)
    saved.save_checkpoint(root, tag="t")
    plain = parity_config(2, ACCUM, CLIP)
    loaded = train_engine(toy(), "adamw", plain, data, rank, world, 0)
    loaded.load_checkpoint(root, tag="t")
    return saved.full_state_dict(), loaded.full_state_dict()


def test_a_zero_plus_plus_checkpoint_loads_into_plain_zero(runs: dict[Any, list[Any]]) -> None:
    for saved, loaded in runs["checkpoint"]:
        assert all(torch.equal(saved[k], v) for k, v in loaded.items())


def _bad(rank: int, world: int) -> str:
    config = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}
    model = toy()
    with pytest.raises(ValueError, match="zero_hpz_partition_size=3") as info:
        ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    return str(info.value)


def test_a_partition_that_does_not_divide_the_ranks_is_refused(
    runs: dict[Any, list[Any]],
) -> None:
    for message in runs["bad"]:
        assert "does not divide the 4 data-parallel ranks" in message


def _reduce(rank: int, world: int, hierarchical: bool) -> Any:
    from ds_strategy.core.collectives import Comm
    from ds_strategy.core.hierarchical import HierarchicalComm
    from ds_strategy.core.layout import RankLayout
    from ds_strategy.core.topology import Topology
    from ds_strategy.core.zero.quantized import quantized_reduce_scatter

    layout = RankLayout.over(topology=Topology(4, 2))
    comm = HierarchicalComm.build(None, layout) if hierarchical else Comm()
    gen = torch.Generator().manual_seed(rank)
    full = torch.randn(4 * 3000, generator=gen) * torch.logspace(-2, 1, 4 * 3000)
    exact = full.clone()
    torch.distributed.all_reduce(exact)
    amax = torch.tensor([full.abs().max().item()])
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    out = torch.empty(3000)
    quantized_reduce_scatter(comm, out, full)
    return (out - exact.view(4, -1)[rank]).abs().max().item(), float(amax), comm.take_report()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_quantized_reduce_scatter_stays_within_its_bound(
    runs: dict[Any, list[Any]], hierarchical: bool
) -> None:
    """Each rank's part is off by at most half a step (amax / 254) at each level: 4 parts
    flat; 2 parts inside a machine, then the 2 machines' sums (at most 2 amax each)."""
    for err, amax, report in runs["reduce", hierarchical]:
        bound = (2 + 2 * 2) * amax / 254 if hierarchical else 4 * amax / 254
        assert 0 < err <= bound, (err, bound)
        assert report["qgz"] > 0


ZERO = {"stage3_param_persistence_threshold": 0}
ZPP = {**ZERO, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
       "zero_quantized_gradients": True}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, list[Any]]:
    """Every 4-rank run of this module's tests, in one spawn (results by case, then rank)."""
    root = str(tmp_path_factory.mktemp("hpz") / "c")
    topology = {"topology": {"ranks_per_machine": 2}}
    calls: dict[Any, tuple[Any, tuple]] = {
        "layouts": (_runs, (batches(STEPS, ACCUM, 8),)),
        "exact": (_exact, (batches(STEPS, ACCUM, 8),)),
        "checkpoint": (_checkpoint, (root, batches(3, ACCUM, 8))),
        "bad": (_bad, ()),
        ("reduce", False): (_reduce, (False,)),
        ("reduce", True): (_reduce, (True,)),
        ("gpt", "plain"): (
            corpus_losses,
            ({"method": "none"}, "adamw", 3, 1.0, ZERO, topology, 0, 150),
        ),
        ("gpt", "zero++"): (
            corpus_losses,
            ({"method": "none"}, "adamw", 3, 1.0, ZPP, topology, 0, 150),
        ),
    }
    return dict(zip(calls, run_ranks_each(list(calls.values()), 4), strict=True))


def test_zero_plus_plus_trains_the_demo_gpt_to_within_3_percent_of_plain_stage_3(
    runs: dict[Any, list[Any]],
) -> None:
    """150 steps, 4 ranks as 2 machines x 2, every parameter sharded; measured: 0.56% below."""
    losses = [sum(runs["gpt", name][0]) / 20 for name in ("plain", "zero++")]
    print(losses, (losses[1] - losses[0]) / losses[0])
    assert losses[1] != losses[0]
    assert abs(losses[1] - losses[0]) / losses[0] <= 0.03
