"""Hierarchical collectives (``topology.hierarchical``, ``core/hierarchical.py``) on 4 gloo
ranks posing as 2 machines x 2: ZeRO stages 0-3 train to single-process training's weights
as flat collectives do, with less inter-machine traffic (by ``comm_report()`` and by a
counter around ``torch.distributed`` classifying calls by group members), and their
checkpoints load into flat ZeRO."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.core.hierarchical import HierarchicalComm
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks_each
from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches
from tests.test_memory_peak import CFG
from tests.test_topology import _GroupCounter

# slow: 4 ranks posing as 2 machines x 2, every case in one run of about 20-30 s
pytestmark = pytest.mark.slow

STEPS, ACCUM, CLIP = 10, 2, 0.5


def toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def _config(stage: int, hierarchical: bool) -> dict[str, Any]:
    topology = {"ranks_per_machine": 2, "hierarchical": hierarchical}
    return parity_config(stage, ACCUM, CLIP, topology=topology)


def _both(rank: int, world: int, stage: int, data: list[torch.Tensor]) -> Any:
    out = {}
    counter = _GroupCounter(2)  # wraps torch.distributed once for the process
    for hierarchical in (False, True):
        counter.links = {"intra": 0, "inter": 0}
        engine = train_engine(
            toy(), "adamw", _config(stage, hierarchical), data, rank, world, STEPS
        )
        out[hierarchical] = {
            "state": engine.full_state_dict(),
            "report": engine.comm_report(),
            "wire": dict(counter.links),
            "two_level": isinstance(engine.comm, HierarchicalComm),
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, list[Any]]:
    """Every 4-rank run of this module's tests, in one spawn (results by case, then rank)."""
    data = batches(STEPS, ACCUM, 8)
    root = str(tmp_path_factory.mktemp("hier") / "ckpt")
    calls: dict[Any, tuple[Any, tuple]] = {stage: (_both, (stage, data)) for stage in range(4)}
    calls["checkpoint"] = (_checkpoint, (root, batches(4, ACCUM, 8)))
    calls["one machine"] = (_kinds, (4, 1))
    calls["tp fills the machines"] = (_kinds, (2, 2))
    calls["peak"] = (_peak_inside_collectives, (2,))  # last: it freezes the collector
    return dict(zip(calls, run_ranks_each(list(calls.values()), 4), strict=True))


@pytest.mark.parametrize(
    ("stage", "bound", "payload"), [(0, 0.7, 0.85), (1, 0.5, 0.6), (2, 0.5, 0.6), (3, 0.5, 0.6)]
)
def test_hierarchical_equals_flat_zero_and_crosses_machines_less(
    runs: dict[Any, list[Any]], stage: int, bound: float, payload: float
) -> None:
    """Inter-machine bytes, hierarchical over flat. ``comm_report()`` (ring model: a ring of
    M = 2 instead of N = 4 over 1/L = 1/2 of the data) measured 0.53 at stage 0 (whose small
    buckets go whole at both levels), 0.38, 0.36, 0.35 at stages 1-3; the torch.distributed
    counter sees the tensors handed to calls on groups spanning machines, which halve: 0.77,
    0.53, 0.52, 0.51 (a broken split that sends everything across would be 1 or more)."""
    expected = train_reference(toy(), "adamw", batches(STEPS, ACCUM, 8), STEPS, ACCUM, CLIP)
    for r in runs[stage]:
        flat, two = r[False], r[True]
        assert two["two_level"] and not flat["two_level"]
        for run in (flat, two):
            worst = max((run["state"][k] - v).abs().max().item() for k, v in expected.items())
            assert worst <= 2e-5, worst
        f, h = flat["report"], two["report"]
        assert h["intra_machine"] + h["inter_machine"] == h["total"]
        assert 0 < h["inter_machine"] <= bound * f["inter_machine"]
        assert h["intra_machine"] > 0
        # the same seen from torch.distributed: the calls on groups spanning the machines
        assert 0 < two["wire"]["inter"] <= payload * flat["wire"]["inter"]


def _checkpoint(rank: int, world: int, root: str, data: list[torch.Tensor]) -> Any:
    saved = train_engine(toy(), "adamw", _config(2, True), data, rank, world, 4)
    saved.save_checkpoint(root, tag="t")
    loaded = train_engine(toy(), "adamw", _config(3, False), data, rank, world, 0)
    loaded.load_checkpoint(root, tag="t")
    return saved.full_state_dict(), loaded.full_state_dict()


def test_a_hierarchical_checkpoint_loads_into_flat_zero(runs: dict[Any, list[Any]]) -> None:
    for saved, loaded in runs["checkpoint"]:
        assert all(torch.equal(saved[k], v) for k, v in loaded.items())


def _kinds(rank: int, world: int, per: int, tp: int) -> str:
    config = {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp},
              "topology": {"ranks_per_machine": per, "hierarchical": True}}  # fmt: skip
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=16, d=32, layers=1, heads=4, seq=8))
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    return f"{type(engine.comm).__name__} {engine.comm.link}"


def test_one_level_stays_flat(runs: dict[Any, list[Any]]) -> None:
    """One machine: nothing to split; a data-parallel group with one rank per machine (the
    tensor-parallel pairs fill each machine): only the crossing level exists."""
    assert runs["one machine"] == ["Comm intra"] * 4
    assert runs["tp fills the machines"] == ["Comm inter"] * 4


def _peak_inside_collectives(rank: int, world: int, stage: int) -> dict[str, Any]:
    """The engine's reported peak against live tensors read at every point of a step and
    inside every all-to-all (the reduce-scatters' first level runs on one), where the
    two-level collectives hold their reordered copy and their levels' buffers."""
    import torch.distributed as dist

    from ds_strategy.core.memory import StepMemoryProbe
    from tests.test_memory_peak import _config as memory_config
    from tests.test_memory_peak import _model, _probed_step, _sizes

    sizes = _sizes()
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 512, (2, 33), generator=g) for _ in range(3)]
    StepMemoryProbe.exclude_existing()
    model = _model()
    probe = StepMemoryProbe(model, baseline=0)
    probe.armed = False
    config = memory_config(stage, "fp32", 1, sizes)
    config["topology"] = {"ranks_per_machine": 2, "hierarchical": True}
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    probe.watch_optimizer(engine.optimizer)
    original = dist.all_to_all_single

    def read_inside(*args: Any, **kwargs: Any) -> Any:
        probe.mark("in_collective")
        return original(*args, **kwargs)

    dist.all_to_all_single = read_inside
    _probed_step(engine, probe, data[:1])
    engine.reset_peak_memory()
    probe.armed = True
    _probed_step(engine, probe, data[1:])
    dist.all_to_all_single = original
    out = {"readings": dict(probe.readings), "peak": engine.memory_report()["peak"]}
    probe.close()
    return out


def test_the_reported_peak_includes_the_two_level_buffers(runs: dict[Any, list[Any]]) -> None:
    """ZeRO-2, demo GPT: read from live tensors inside the collectives, the two-level
    reduce-scatter's moment is the step's fullest; ``memory_report()["peak"]`` agrees with it
    within 1% (measured 0.9999; before its buffers were metered it read 5.4% low).

    The live reading is model state plus whatever else is alive then, and the first reduction
    starts from the head's gradient hook, while autograd may still hold the gradient of the
    logits, an activation's (2 x 32 x 512 fp32 here): in most runs it is already freed (live
    616 bytes above the peak), in some (a clean-clone run) still there, 131,688 bytes above
    (1.35%). So that one tensor is allowed for on top of the 1%."""
    logits_grad = 2 * 32 * CFG.vocab * 4  # (batch, positions, vocabulary) fp32
    for r in runs["peak"]:
        live = max(r["readings"].values())
        assert r["readings"]["in_collective"] > 0
        assert r["peak"] <= 1.01 * live, (r["peak"], r["readings"])
        assert live - r["peak"] <= 0.01 * live + logits_grad, (r["peak"], r["readings"])
