"""Every stage trains to the weights of plain single-process training on the global batch,
and of DDP: world sizes 2 and 3, AdamW and SGD with two param groups each, gradient
accumulation 2, global-norm clipping, 10 optimizer steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_ranks
from tests.loops import parity_config, train_engine, train_reference
from tests.models import ToyLM, batches, lm_loss, make_optimizer

STEPS, ACCUM, GLOBAL_BATCH, CLIP = 10, 2, 12, 0.5
CASES = [(stage, opt) for stage in (0, 1, 2, 3) for opt in ("adamw", "sgd")]


def _reference(
    model: torch.nn.Module, kind: str, data: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    return train_reference(model, kind, data, STEPS, ACCUM, CLIP)


def _ddp(
    model: torch.nn.Module, kind: str, data: list[torch.Tensor], rank: int, world: int
) -> dict:
    ddp = DDP(model, find_unused_parameters=True)
    opt = make_optimizer(kind, model)
    per = GLOBAL_BATCH // world
    for step in range(STEPS):
        for micro in range(ACCUM):
            local = data[step * ACCUM + micro][rank * per : (rank + 1) * per]
            if micro < ACCUM - 1:
                with ddp.no_sync():
                    (lm_loss(ddp, local) / ACCUM).backward()
            else:
                (lm_loss(ddp, local) / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _engine(
    model: torch.nn.Module, kind: str, stage: int, data: list, rank: int, world: int
) -> dict:
    config = parity_config(stage, ACCUM, CLIP)
    engine = train_engine(model, kind, config, data, rank, world, STEPS)
    assert engine.global_steps == STEPS
    return engine.full_state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def parity_worker(rank: int, world: int) -> dict:
    data = batches(STEPS, ACCUM, GLOBAL_BATCH)
    out = {}
    for kind in ("adamw", "sgd"):
        torch.manual_seed(0)
        base = ToyLM()
        ref = _reference(copy.deepcopy(base), kind, data)
        ddp = _ddp(copy.deepcopy(base), kind, data, rank, world)
        out[("ddp", kind)] = _max_diff(ddp, ref)
        for stage in (0, 1, 2, 3):
            got = _engine(copy.deepcopy(base), kind, stage, data, rank, world)
            out[(stage, kind)] = (_max_diff(got, ref), _max_diff(got, ddp))
        out[("moved", kind)] = _max_diff(ref, base.state_dict())
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def parity_results(request: pytest.FixtureRequest) -> dict:
    results = run_ranks(parity_worker, request.param, timeout=400)
    for r in results[1:]:  # every rank consolidated the same weights
        for k in r:
            if k[0] in (0, 1, 2, 3):
                assert abs(r[k][0] - results[0][k][0]) < 1e-6
    return results[0]


@pytest.mark.parametrize("stage,kind", CASES, ids=[f"stage{s}-{k}" for s, k in CASES])
def test_stage_matches_single_process_and_ddp(parity_results: dict, stage: int, kind: str) -> None:
    vs_ref, vs_ddp = parity_results[(stage, kind)]
    assert vs_ref <= 2e-5, f"stage {stage} {kind}: max |w - reference| = {vs_ref:.3g}"
    assert vs_ddp <= 2e-5, f"stage {stage} {kind}: max |w - DDP| = {vs_ddp:.3g}"


def test_training_moved_the_weights(parity_results: dict) -> None:
    # Guards the parity test itself: equal weights mean nothing if nothing trained.
    assert parity_results[("moved", "adamw")] > 1e-2
    assert parity_results[("moved", "sgd")] > 1e-3
    assert parity_results[("ddp", "adamw")] <= 2e-5
