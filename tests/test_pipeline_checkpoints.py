"""Pipeline checkpoints across layouts: a P=2 x D=2 checkpoint of a language model whose
embedding and head share one weight (tied across stages) resumes as P=2 x D=1, as P=4 x D=1
(another ZeRO stage), as a plain ZeRO-2 engine on 2 ranks, and a plain engine's checkpoint
resumes as a pipeline; each takes the same next step as the uninterrupted run.
``consolidate`` exports a pipeline root as the whole model's weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ds_strategy
from tests.distributed import run_ranks
from tests.test_pipeline import CLIP, MICRO, _diff, lm_ce, tied_lm

GLOBAL = 16  # samples per step, whatever the layout
TOL = 1e-6  # another layout sums the same gradients in another order (1e-8 measured)


def _steps(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, 11, (GLOBAL, 5), generator=g),
            torch.randint(0, 11, (GLOBAL, 5), generator=g),
        )
        for _ in range(n)
    ]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _pipeline(stages: int, zero: int) -> ds_strategy.PipelineEngine:
    dp = int(os.environ["WORLD_SIZE"]) // stages
    model = tied_lm()
    config = {
        "pipeline": {"stages": stages, "schedule": "1f1b"},
        "train_micro_batch_size_per_gpu": MICRO,
        # the same global batch of 16 at every data-parallel size
        "gradient_accumulation_steps": GLOBAL // (MICRO * dp),
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 50},
    }
    return ds_strategy.initialize(model, _optimizer(model), config, loss_fn=lm_ce)


def _plain() -> ds_strategy.ZeroEngine:
    model = tied_lm()
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL // 2,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50},
    }
    return ds_strategy.initialize(model, _optimizer(model), config)


def _share(batch: tuple, rank: int, size: int) -> tuple:
    per = GLOBAL // size
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def _train_pipeline(engine: ds_strategy.PipelineEngine, batch: tuple) -> None:
    engine.train_batch(*_share(batch, engine.data_parallel_rank, engine.data_parallel_size))


def _train_plain(engine: ds_strategy.ZeroEngine, batch: tuple) -> None:
    x, y = _share(batch, engine.rank, engine.world_size)
    engine.backward(lm_ce(engine(x), y))
    engine.step()


def _weights(engine: ds_strategy.PipelineEngine | ds_strategy.ZeroEngine) -> dict:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def four_ranks(rank: int, world: int, root: str) -> dict:
    data = _steps()
    out: dict = {}
    a = _pipeline(2, 1)  # P=2 x D=2, ZeRO-1
    _train_pipeline(a, data[0])
    a.save_checkpoint(f"{root}/p2d2", client_state={"step": 1})
    out["saved"] = _weights(a)
    _train_pipeline(a, data[1])
    out["uninterrupted"] = _weights(a)
    a.destroy()
    b = _pipeline(4, 2)  # P=4 x D=1, ZeRO-2
    out["p4d1_state"] = b.load_checkpoint(f"{root}/p2d2")
    out["p4d1_loaded"] = _diff(_weights(b), out["saved"])
    _train_pipeline(b, data[1])
    out["p4d1"] = _diff(_weights(b), out["uninterrupted"])
    out["p4d1_steps"] = b.global_steps
    b.destroy()
    return out


def two_ranks(rank: int, world: int, root: str, reference: dict) -> dict:
    data = _steps()
    out: dict = {}
    c = _pipeline(2, 1)  # P=2 x D=1
    c.load_checkpoint(f"{root}/p2d2")
    _train_pipeline(c, data[1])
    out["p2d1"] = _diff(_weights(c), reference["uninterrupted"])
    c.destroy()
    d = _plain()  # plain ZeRO-2 on 2 ranks, from the pipeline's checkpoint
    out["plain_state"] = d.load_checkpoint(f"{root}/p2d2")
    _train_plain(d, data[1])
    out["plain"] = _diff(_weights(d), reference["uninterrupted"])
    d.destroy()
    e = _plain()  # and back: the plain engine's checkpoint into a pipeline
    _train_plain(e, data[0])
    e.save_checkpoint(f"{root}/plain")
    out["plain_saved"] = _diff(_weights(e), reference["saved"])
    e.destroy()
    f = _pipeline(2, 2)  # P=2 x D=1, ZeRO-2
    f.load_checkpoint(f"{root}/plain")
    _train_pipeline(f, data[1])
    out["back"] = _diff(_weights(f), reference["uninterrupted"])
    f.destroy()
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict], Path]:
    root = tmp_path_factory.mktemp("pipeline_layouts")
    four = run_ranks(four_ranks, 4, str(root), timeout=240)
    two = run_ranks(two_ranks, 2, str(root), four[0], timeout=240)
    return four, two, root


def test_pipeline_checkpoint_loads_into_four_stages(layouts: tuple) -> None:
    four, _, _ = layouts
    assert _diff(four[0]["uninterrupted"], four[0]["saved"]) > 1e-3  # the step after moved
    for res in four:
        assert res["p4d1_loaded"] <= 1e-7  # the saved weights, each stage its own layers
        assert res["p4d1"] <= TOL
        assert res["p4d1_state"] == {"step": 1} and res["p4d1_steps"] == 2


@pytest.mark.parametrize("case", ["p2d1", "plain", "back"])
def test_pipeline_and_plain_checkpoints_load_into_each_other(layouts: tuple, case: str) -> None:
    _, two, _ = layouts
    for res in two:
        assert res[case] <= TOL, f"{case}: max |w - uninterrupted| = {res[case]:.3g}"
    assert two[0]["plain_state"] == {"step": 1}
    # the plain engine's first step equals the pipeline's: both are the same training
    assert two[0]["plain_saved"] <= TOL


def test_consolidate_exports_a_pipeline_root(layouts: tuple, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    four, _, root = layouts
    out = ds_strategy.consolidate(root / "p2d2", tmp_path / "model.safetensors")
    weights = load_file(out)
    saved = four[0]["saved"]
    assert sorted(weights) == sorted(saved)  # the tied head's name too
    assert _diff({k: weights[k] for k in saved}, saved) == 0.0
    model = tied_lm()
    model.load_state_dict(weights)  # the plain model loads it strictly
