"""The loop semantics and real-model features of the engine, on 2 (and 3) gloo ranks."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_strategy
from tests.distributed import WorkerError, free_port, run_ranks
from tests.models import ToyLM, batches, lm_loss

GB = 8  # global batch


def _local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _sgd(params):  # noqa: ANN001, ANN202
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


# -- meta-device construction under ZeRO-3 ------------------------------------------------------


def meta_worker(rank: int, world: int) -> dict:
    with torch.device("meta"):
        model = ToyLM(n_blocks=4)
    total = sum(p.numel() for p in model.parameters())
    peak = {"numel": 0}

    def init(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            nn.init.normal_(p, std=0.02)
        if isinstance(module, ToyLM):
            module.reset_parameters()  # its buffer: a param_init_fn computes buffers too
        live = sum(p.numel() for p in model.parameters() if p.device.type != "meta")
        peak["numel"] = max(peak["numel"], live)

    engine = ds_strategy.initialize(
        model,
        _sgd,
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
        param_init_fn=init,
    )
    # the plain model, loaded with the weights the engine started from, is the reference
    start = engine.full_state_dict()
    ref = ToyLM(n_blocks=4)
    ref.load_state_dict(start)
    ref_opt = _sgd(ref.parameters())
    for batch in batches(3, 1, GB):
        engine.backward(lm_loss(engine, _local(batch, rank, world)))
        engine.step()
        lm_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {
        "total": total,
        "peak": peak["numel"],
        "diff": _max_diff(engine.full_state_dict(), ref.state_dict()),
        "moved": _max_diff(ref.state_dict(), start),
    }  # noqa: E501


def test_meta_model_is_materialised_unit_by_unit_and_trains() -> None:
    for r in run_ranks(meta_worker, 2):
        assert r["peak"] < 0.6 * r["total"], (
            f"{r['peak']} of {r['total']} parameters were materialised at once"
        )
        assert r["diff"] <= 2e-5 and r["moved"] > 1e-4, r


# -- eval / no_grad, no_sync, schedulers, grad norm, optimizer from config -------------------------


def _train_pair(engine, ref, ref_opt, data, rank, world, no_sync: int | None) -> None:  # noqa: ANN001
    """Two backward calls per optimizer step; ``no_sync`` names the one (0 or 1) run inside
    ``engine.no_sync()``, or None for two reducing backward calls."""
    for i in range(0, len(data), 2):
        for j in (0, 1):
            loss = lm_loss(engine, _local(data[i + j], rank, world))
            if j == no_sync:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
        engine.step()
        (lm_loss(ref, data[i]) + lm_loss(ref, data[i + 1])).backward()
        ref_opt.step()
        ref_opt.zero_grad()


def loop_worker(rank: int, world: int) -> dict:
    out: dict = {}
    data = batches(2, 2, GB)
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        base = ToyLM()
        ref = copy.deepcopy(base)
        engine = ds_strategy.initialize(
            base, _sgd(base.parameters()), {"zero_optimization": {"stage": stage}}
        )
        ref_opt = _sgd(ref.parameters())
        _train_pair(engine, ref, ref_opt, data, rank, world, no_sync=0)
        out[("no_sync", stage)] = _max_diff(engine.full_state_dict(), ref.state_dict())
        _train_pair(engine, ref, ref_opt, data, rank, world, no_sync=1)
        out[("no_sync_last", stage)] = _max_diff(engine.full_state_dict(), ref.state_dict())
        # inference under eval() + no_grad, then back to training
        engine.eval()
        with torch.no_grad():
            x = data[0][:, :-1]
            out[("eval", stage)] = float((engine(x) - ref.eval()(x)).abs().max())
        engine.train()
        ref.train()
        _train_pair(engine, ref, ref_opt, data, rank, world, no_sync=None)
        out[("after_eval", stage)] = _max_diff(engine.full_state_dict(), ref.state_dict())
    out["sched"] = _scheduler_and_norm(rank, world)
    out["config_opt"] = _optimizer_from_config(rank, world)
    return out


def _scheduler_and_norm(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyLM()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    config = {
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1e-3,
    }
    engine = ds_strategy.initialize(model, opt, config, lr_scheduler=sched)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    norms = []
    data = batches(4, 2, GB, seed=3)
    for step, i in enumerate(range(0, 8, 2)):
        for j in (i, i + 1):
            assert engine.is_gradient_accumulation_boundary() == (j == i + 1)
            engine.backward(lm_loss(engine, _local(data[j], rank, world)))
            engine.step()
            (lm_loss(ref, data[j]) / 2).backward()
        norms.append(
            (
                engine.get_global_grad_norm(),
                float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)),
            )
        )
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        assert engine.global_steps == step + 1
    return {
        "lr": (engine.get_lr(), [g["lr"] for g in ref_opt.param_groups]),
        "norms": norms,
        "diff": _max_diff(engine.full_state_dict(), ref.state_dict()),
    }


def _optimizer_from_config(rank: int, world: int) -> float:
    torch.manual_seed(0)
    model = ToyLM()
    ref = copy.deepcopy(model)
    config = {
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    }
    engine = ds_strategy.initialize(model, None, config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    for batch in batches(3, 1, GB, seed=5):
        engine.backward(lm_loss(engine, _local(batch, rank, world)))
        engine.step()
        lm_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return _max_diff(engine.full_state_dict(), ref.state_dict())


@pytest.fixture(scope="module")
def loop_results() -> dict:
    return run_ranks(loop_worker, 2)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_sync_accumulates_then_reduces(loop_results: dict, stage: int) -> None:
    assert loop_results[("no_sync", stage)] <= 2e-5
    # a reducing backward, then one under no_sync, then the step
    assert loop_results[("no_sync_last", stage)] <= 2e-5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_eval_no_grad_then_two_reducing_backwards_per_step(loop_results: dict, stage: int) -> None:
    assert loop_results[("eval", stage)] <= 1e-4  # logits of magnitude ~1
    assert loop_results[("after_eval", stage)] <= 2e-5


def test_lr_scheduler_and_global_grad_norm(loop_results: dict) -> None:
    r = loop_results["sched"]
    ours, ref = r["lr"]
    assert ours == pytest.approx(ref) and ours[0] == pytest.approx(1e-2 / 5)
    for got, want in r["norms"]:
        assert got == pytest.approx(want, rel=1e-5)
        assert want > 1e-3  # clipping was active
    assert r["diff"] <= 2e-5


def test_optimizer_built_from_config_section(loop_results: dict) -> None:
    assert loop_results["config_opt"] <= 2e-5


# -- ZeRO-3 memory knobs -----------------------------------------------------------------------------


def knobs_worker(rank: int, world: int) -> dict:
    out = {}
    block = sum(p.numel() for p in ToyLM(d=32).blocks[0].parameters() if p.numel() >= 100)
    root = sum(p.numel() for n, p in ToyLM(d=32).named_parameters() if not n.startswith("blocks."))
    for name, zc in {
        "default": {},
        "tight": {"stage3_max_live_parameters": 1, "stage3_prefetch_bucket_size": 1},
        "one_ahead": {"stage3_prefetch_bucket_size": block, "stage3_max_reuse_distance": 0},
        # room for three blocks beside the root, the running block and the prefetched one
        "reuse": {"stage3_prefetch_bucket_size": block, "stage3_max_live_parameters": root + 5 * block},
    }.items():  # fmt: skip
        torch.manual_seed(0)
        model = ToyLM(n_blocks=8, d=32)
        engine = ds_strategy.initialize(
            model,
            _sgd,
            {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100, **zc}},
        )
        runtime = engine.plan.stage3
        gathers: list[int] = []  # the units gathered in the last step
        plain = runtime._gather

        def counting(unit, wait: bool, plain=plain, gathers=gathers) -> None:  # noqa: ANN001
            if not unit.gathered:
                gathers.append(unit.index)
            plain(unit, wait)

        runtime._gather = counting
        for batch in batches(3, 1, GB):
            gathers.clear()
            engine.backward(lm_loss(engine, _local(batch, rank, world)))
            engine.step()
        units = runtime.units
        out[name] = {
            "peak": engine.memory_report()["peak_gathered_params"],
            "sizes": {n: p.numel() for n, p in model.named_parameters()},
            "bound": 4 * (units[-1].numel + 2 * max(u.numel for u in units[:-1])),
            "ahead_bound": 4 * (units[-1].numel + 3 * max(u.numel for u in units[:-1])),
            "all": 4 * sum(u.numel for u in units),
            "max_live": 4 * runtime.max_live_numel,
            "gathers": sorted(gathers),
            "weights": {k: v.clone() for k, v in engine.full_state_dict().items()},
        }
    return out


def test_persistence_threshold_and_live_parameter_bound() -> None:
    r = run_ranks(knobs_worker, 2)[0]
    sizes = r["default"]["sizes"]
    assert sizes["blocks.0.norm.weight"] == 32  # under the threshold: stays whole
    assert sizes["blocks.0.fc1.weight"] == 0  # sharded: released between uses
    # with no room to prefetch, only the root and the blocks in use are gathered at once
    assert r["tight"]["peak"] <= r["tight"]["bound"]
    assert r["tight"]["peak"] < r["default"]["peak"]
    # a prefetch bucket of one block keeps about one block gathered ahead of the one running
    # (plus the root and, in backward, the block just done), not a bucket more at each unit
    one = r["one_ahead"]
    assert one["peak"] <= one["ahead_bound"] < one["all"] / 2, one
    # stage3_max_reuse_distance: the last units of forward stay gathered into backward as far
    # as stage3_max_live_parameters leaves room (three blocks): block 0, which runs again last
    # and stays gathered anyway, then blocks 7 and 6, which backward no longer gathers again
    reuse = r["reuse"]
    missing = list(one["gathers"])
    for u in reuse["gathers"]:
        missing.remove(u)
    assert missing == [6, 7], (one["gathers"], reuse["gathers"])
    assert reuse["peak"] <= reuse["max_live"], reuse["peak"]
    # DeepSpeed's defaults (reuse and live bounds of 1e9 elements) keep this small model's
    # units gathered from forward into backward: each is gathered once a step
    assert len(r["default"]["gathers"]) < len(one["gathers"])
    for k, v in one["weights"].items():  # the same training, whatever stays gathered
        torch.testing.assert_close(reuse["weights"][k], v, rtol=0, atol=0)
        torch.testing.assert_close(r["default"]["weights"][k], v, rtol=0, atol=0)


# -- process groups ----------------------------------------------------------------------------------


def subgroup_worker(rank: int, world: int) -> float | None:
    group = dist.new_group([0, 1])  # every rank must take part in creating it
    if rank == 2:
        return None
    torch.manual_seed(0)
    model = ToyLM()
    ref = copy.deepcopy(model)
    engine = ds_strategy.initialize(
        model, _sgd(model.parameters()), {"zero_optimization": {"stage": 3}}, process_group=group
    )
    assert engine.world_size == 2
    ref_opt = _sgd(ref.parameters())
    for batch in batches(3, 1, GB):
        engine.backward(lm_loss(engine, _local(batch, rank, 2)))
        engine.step()
        lm_loss(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return _max_diff(engine.full_state_dict(), ref.state_dict())


def test_engine_on_a_subgroup() -> None:
    results = run_ranks(subgroup_worker, 3)
    assert results[2] is None and results[0] <= 2e-5 and results[1] <= 2e-5


def env_init_worker(rank: int, world: int, port: int) -> tuple[int, int, bool]:
    dist.destroy_process_group()  # start like a torchrun script: only the environment is set
    assert os.environ["WORLD_SIZE"] == str(world)
    # A port of its own: on the pool's port, a rank done destroying could reach rank 0's old
    # store while rank 0 is still closing it ("Failed to recv, got 0 bytes").
    os.environ["MASTER_PORT"] = str(port)
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(
        model, _sgd(model.parameters()), {"zero_optimization": {"stage": 2}}
    )
    return engine.rank, engine.world_size, dist.is_initialized()


def test_process_group_initialised_from_environment() -> None:
    assert run_ranks(env_init_worker, 2, free_port()) == [(0, 2, True), (1, 2, True)]


def hang_worker(rank: int, world: int) -> None:
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(
        model, _sgd(model.parameters()), {"zero_optimization": {"stage": 2}}
    )
    if rank == 0:  # rank 1 never joins: the gradient reduction cannot complete
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
    else:
        time.sleep(30)


@pytest.mark.slow
def test_a_collective_that_never_completes_fails_fast() -> None:
    with pytest.raises((WorkerError, TimeoutError)):
        run_ranks(hang_worker, 2, timeout=60, pg_timeout=5)
