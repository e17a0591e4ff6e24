"""MiCS (``zero_optimization.mics_shard_size``, ``core/mics.py``) on 4 gloo ranks posing as 2
machines x 2: ZeRO shards over each machine's 2 ranks and replicates across the machines.
Stages 1-3 train to single-process training's weights as flat ZeRO does, with half of flat
ZeRO's shard count (twice its optimizer state per rank) and a fraction of its
inter-machine traffic (by ``comm_report()`` and a counter around ``torch.distributed``);
checkpoints go both ways between MiCS and flat ZeRO; a failure in one shard group raises in
the other; what it does not compose with is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.mics import MiCSComm
from ds_strategy.estimate import estimate, model_facts
from tests.distributed import run_ranks_each
from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches, lm_loss, make_optimizer
from tests.test_topology import _GroupCounter

# slow: 4 ranks posing as 2 machines x 2, every case in one run of about 20-30 s
pytestmark = pytest.mark.slow

STEPS, ACCUM, CLIP = 10, 2, 0.5


def toy() -> ToyLM:
    torch.manual_seed(0)
    return ToyLM()


def _config(stage: int, mics: int, **zero: Any) -> dict[str, Any]:
    """Stage 3 gathers every unit again for its backward (reuse distance 0), so the flat
    run's gathers cross the machines twice a step, as the bounds below count them."""
    config = parity_config(stage, ACCUM, CLIP, topology={"ranks_per_machine": 2})
    config["zero_optimization"].update(mics_shard_size=mics, stage3_max_reuse_distance=0, **zero)
    return config


def _all_stages(rank: int, world: int, data: list[torch.Tensor]) -> Any:
    out = {}
    counter = _GroupCounter(2)  # wraps torch.distributed once for the process
    for stage in (1, 2, 3):
        for mics in (-1, 2):
            counter.links = {"intra": 0, "inter": 0}
            engine = train_engine(toy(), "adamw", _config(stage, mics), data, rank, world, STEPS)
            out[stage, mics] = {
                "state": engine.full_state_dict(),
                "report": engine.comm_report(),
                "wire": dict(counter.links),
                "memory": engine.memory_report(),
                "mics": isinstance(engine.shard_comm, MiCSComm),
                "world": engine.world_size,
            }
            engine.destroy()
    return out


def test_mics_equals_flat_zero_at_stages_1_to_3_and_crosses_machines_less(
    runs: dict[str, list[Any]],
) -> None:
    """10 fp32 AdamW steps of 2 micro-batches, clipped: MiCS and flat ZeRO both within 2e-5
    of single-process training. Inter-machine bytes of the whole run (the initial broadcast
    included), MiCS over flat, by ``comm_report()`` (ring model): 0.38, 0.26, 0.13 at stages
    1-3 (MiCS sends one all-reduce of half the gradients across per step, at the boundary;
    flat ZeRO's rings over all 4 ranks carry its reduce-scatters, one per micro-batch at
    stages 2-3, and all-gathers); by the torch.distributed counter, which sees the tensors
    handed to calls on groups that span machines: 0.29, 0.20, 0.10. Optimizer state per rank
    is twice flat ZeRO's (2 shards instead of 4; padding aside)."""
    data = batches(STEPS, ACCUM, 8)
    expected = train_reference(toy(), "adamw", data, STEPS, ACCUM, CLIP)
    facts = model_facts(toy, persistence_threshold=30)  # parity_config's threshold
    for r in runs["stages"]:
        for stage, bound, payload in ((1, 0.45, 0.35), (2, 0.3, 0.25), (3, 0.16, 0.12)):
            flat, mics = r[stage, -1], r[stage, 2]
            assert mics["mics"] and not flat["mics"]
            assert mics["world"] == 4  # data-parallel ranks: batches are split four ways
            for run in (flat, mics):
                worst = max((run["state"][k] - v).abs().max().item() for k, v in expected.items())
                assert worst <= 2e-5, (stage, worst)
            f, m = flat["report"], mics["report"]
            assert m["intra_machine"] + m["inter_machine"] == m["total"]
            assert 0 < m["inter_machine"] <= bound * f["inter_machine"], (stage, m, f)
            assert m["intra_machine"] > 0
            assert 0 < mics["wire"]["inter"] <= payload * flat["wire"]["inter"], stage
            opt_flat = flat["memory"]["optimizer_state"]
            opt_mics = mics["memory"]["optimizer_state"]
            assert abs(opt_mics - 2 * opt_flat) <= 0.05 * opt_flat, (stage, opt_mics, opt_flat)
            # and as `ds-strategy estimate --mics-shard-size 2` predicts it
            est = estimate(facts, 4, stage, precision="fp32", mics_shard_size=2)
            assert mics["memory"]["total"] == pytest.approx(est.model_state, rel=0.1), stage


class _Branchy(nn.Module):
    """A layer that only some ranks' forwards reach: its gradient exists on rank 3 alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.rare = nn.Linear(8, 8)
        self.use_rare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return self.rare(y) if self.use_rare else y


def _branchy(rank: int, world: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    out = {}
    for stage in (1, 3):
        for mics in (-1, 2):
            model = _Branchy()
            model.use_rare = rank == 3
            with torch.no_grad():  # each rank's own initial weights: rank 0's must win
                model.body.weight.add_(rank)
            config = {"zero_optimization": {"stage": stage, "mics_shard_size": mics,
                                            "stage3_param_persistence_threshold": 0}}  # fmt: skip
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            engine = ds_strategy.initialize(model, opt, config)
            torch.manual_seed(rank)
            for _ in range(3):
                engine.backward(engine(torch.randn(4, 8)).square().mean())
                engine.step()
            out[stage, mics] = engine.full_state_dict()
            engine.destroy()
    return out


def test_a_gradient_from_one_shard_group_updates_every_replica(runs: dict[str, list[Any]]) -> None:
    """Rank 3 alone uses ``rare``; the ranks of the other shard group must still step it
    (which parameters got a gradient is combined over the replicas too), as flat ZeRO does,
    at stage 1 and stage 3. Every rank starts from its own weights: both start from rank
    0's (MiCS broadcasts over every replica, not within each shard group)."""
    for r in runs["branchy"]:
        for stage in (1, 3):
            flat, mics = r[stage, -1], r[stage, 2]
            assert not torch.equal(flat["rare.weight"], _Branchy().rare.weight)  # it moved
            for k, v in flat.items():
                assert (mics[k] - v).abs().max().item() <= 1e-6, (stage, k)


def _resume(rank: int, world: int, root: str) -> list[dict[str, torch.Tensor]]:
    data = batches(STEPS, ACCUM, 8)
    half, per = STEPS // 2, 8 // world
    out = []
    for first, second in ((2, -1), (-1, 2)):
        saved = train_engine(toy(), "adamw", _config(3, first), data[: 2 * half], rank, world, half)
        saved.save_checkpoint(root, tag=f"from{first}")
        saved.destroy()
        loaded = train_engine(toy(), "adamw", _config(2, second), data, rank, world, 0)
        loaded.load_checkpoint(root, tag=f"from{first}")
        for step in range(half, STEPS):
            for micro in range(ACCUM):
                batch = data[step * ACCUM + micro][rank * per : (rank + 1) * per]
                loaded.backward(lm_loss(loaded, batch))
                loaded.step()
        out.append(loaded.full_state_dict())
        loaded.destroy()
    return out


def test_checkpoints_go_both_ways_between_mics_and_flat_zero(runs: dict[str, list[Any]]) -> None:
    """Five steps at stage 3, MiCS (flat), saved; loaded at stage 2, flat (MiCS), and trained
    five more: the uninterrupted run's weights, so the optimizer state came back too."""
    data = batches(STEPS, ACCUM, 8)
    expected = train_reference(toy(), "adamw", data, STEPS, ACCUM, CLIP)
    for states in runs["resume"]:
        for state in states:
            worst = max((state[k] - v).abs().max().item() for k, v in expected.items())
            assert worst <= 2e-5, worst


ZERO_PP = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
           "zero_quantized_gradients": True}  # fmt: skip
CHAIN: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
    ("flat", 1, {}, {}),
    ("hierarchical", 2, {}, {"hierarchical": True}),
    ("MiCS", 3, {"mics_shard_size": 2}, {}),
    ("ZeRO++", 3, ZERO_PP, {}),
    ("MiCS + qwZ", 3, {"mics_shard_size": 2, "zero_quantized_weights": True}, {}),
    ("MiCS", 2, {"mics_shard_size": 2}, {}),
    ("flat", 3, {}, {}),
]


def _chain(rank: int, world: int, root: str) -> list[str]:
    """Each layout trains one step, saves; the next loads it: the loaded weights and
    optimizer state must be exactly the saved ones."""
    data = batches(len(CHAIN), ACCUM, 8)
    differs = []
    previous: dict[str, torch.Tensor] | None = None
    for i, (name, stage, zero, topology) in enumerate(CHAIN):
        config = _config(stage, int(zero.get("mics_shard_size", -1)))
        config["zero_optimization"].update(zero)
        config["topology"].update(topology)
        engine = train_engine(toy(), "adamw", config, data[2 * i : 2 * i + 2], rank, world, 0)
        if previous is not None:
            engine.load_checkpoint(root, tag=str(i - 1))
            now = engine.full_state_dict()
            differs += [f"{name}: {k}" for k, v in previous.items() if not torch.equal(now[k], v)]
            state = engine.optimizer.state
            moments = [state[pc.tensor].get("exp_avg") for pc in engine.optimizer_pieces]
            if not any(m is not None and m.norm() > 0 for m in moments):
                differs.append(f"{name}: no optimizer state loaded")
        for micro in range(ACCUM):
            batch = data[2 * i + micro][rank * 2 : rank * 2 + 2]
            engine.backward(lm_loss(engine, batch))
            engine.step()
        engine.save_checkpoint(root, tag=str(i))
        previous = engine.full_state_dict()
        engine.destroy()
    return differs


def test_checkpoints_move_through_every_layout(runs: dict[str, list[Any]]) -> None:
    """flat stage 1 -> hierarchical stage 2 -> MiCS stage 3 -> ZeRO++ (hpZ + qwZ + qgZ) ->
    MiCS with qwZ -> MiCS stage 2 -> flat stage 3, a step in each: every load restores
    exactly the weights the previous layout saved, and its optimizer state."""
    assert runs["chain"] == [[]] * 4


def _fails_in_one_group(rank: int, world: int) -> str:
    def init(module: nn.Module) -> None:
        if rank == 3:
            raise RuntimeError("out of memory on rank 3")
        module.to_empty(device="cpu")

    with torch.device("meta"):
        model = ToyLM()
    config = {"zero_optimization": {"stage": 3, "mics_shard_size": 2}}
    try:
        ds_strategy.initialize(
            model, lambda ps: torch.optim.SGD(ps, lr=0.1), config, param_init_fn=init
        )
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        return f"{type(e).__name__}: {e}"
    return "built"


def test_a_failure_in_one_shard_group_raises_in_the_other(runs: dict[str, list[Any]]) -> None:
    """Rank 3 fails to materialise its layers: ranks 0 and 1, in the other shard group, raise
    too (naming rank 3's error) instead of waiting in a collective rank 3 never joins."""
    out = runs["failure"]
    assert "out of memory on rank 3" in out[3]
    for r in (0, 1, 2):
        assert out[r].startswith("RankFailedError") and "rank 3" in out[r], out[r]


REFUSED = [
    ({"stage": 2, "mics_shard_size": 3}, {}, "does not divide the 4 data-parallel ranks"),
    ({"stage": 0, "mics_shard_size": 2}, {}, "stage 0, which shards nothing"),
    ({"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2}, {}, "hpZ"),
    ({"stage": 3, "mics_shard_size": 2, "zero_quantized_gradients": True}, {}, "quantized"),
    ({"stage": 2, "mics_shard_size": 2}, {"topology": {"hierarchical": True}}, "hierarch"),
    (
        {"stage": 1, "mics_shard_size": 2},
        {"gradient_compression": {"method": "topk", "ratio": 0.1}},
        "compression",
    ),
]


def _refused(rank: int, world: int) -> list[str]:
    out = []
    for zero, extra, _ in REFUSED:
        model = toy()
        config = {"zero_optimization": zero, **extra}
        try:
            ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("built")
    return out


def test_what_mics_does_not_compose_with_is_refused_on_every_rank(
    runs: dict[str, list[Any]],
) -> None:
    for said in runs["refused"]:
        for (_, _, says), text in zip(REFUSED, said, strict=True):
            assert "mics_shard_size" in text and says in text, text


def _composed(rank: int, world: int) -> dict[str, Any]:
    """MiCS under TP2 x DP2 (shard groups of 1 data-parallel rank, replicated over 2) against
    the same without MiCS; MiCS with CPU optimizer offload at stage 2 against the reference."""
    from tests.test_tensor_parallel import SEQ, VOCAB, _train_steps, gpt
    from tests.test_tensor_parallel import STEPS as TP_STEPS

    data = batches(TP_STEPS, ACCUM, 8, seq=SEQ, vocab=VOCAB)
    out: dict[str, Any] = {}
    for mics in (-1, 1):
        config = parity_config(2, ACCUM, CLIP, tensor_parallel={"autotp_size": 2})
        config["zero_optimization"]["mics_shard_size"] = mics
        model = gpt()
        engine = ds_strategy.initialize(model, make_optimizer("adamw", model), config)
        _train_steps(engine, data, 0, TP_STEPS)  # each data-parallel rank its rows
        out[f"tp{mics}"] = engine.full_state_dict()
        out[f"tp{mics}_mics"] = isinstance(engine.shard_comm, MiCSComm)
        engine.destroy()
    offload = _config(2, 2)
    offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine = train_engine(toy(), "adamw", offload, batches(STEPS, ACCUM, 8), rank, world, STEPS)
    out["offload"] = engine.full_state_dict()
    engine.destroy()
    return out


def test_mics_composes_with_tensor_parallelism_and_offload(runs: dict[str, list[Any]]) -> None:
    from tests.test_tensor_parallel import weights_diff

    expected = train_reference(toy(), "adamw", batches(STEPS, ACCUM, 8), STEPS, ACCUM, CLIP)
    for r in runs["composed"]:
        assert r["tp1_mics"] and not r["tp-1_mics"]
        assert weights_diff(r["tp1"], r["tp-1"]) <= 2e-5
        worst = max((r["offload"][k] - v).abs().max().item() for k, v in expected.items())
        assert worst <= 2e-5, worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every 4-rank run of this module's tests, in one spawn (results by case, then rank);
    the initialisation that fails on rank 3 last."""
    root = tmp_path_factory.mktemp("mics")
    calls = {
        "stages": (_all_stages, (batches(STEPS, ACCUM, 8),)),
        "branchy": (_branchy, ()),
        "resume": (_resume, (str(root / "resume"),)),
        "chain": (_chain, (str(root / "chain"),)),
        "refused": (_refused, ()),
        "composed": (_composed, ()),
        "failure": (_fails_in_one_group, ()),
    }
    return dict(zip(calls, run_ranks_each(list(calls.values()), 4), strict=True))
