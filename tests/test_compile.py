"""torch.compile under ZeRO: the demo GPT at width 256 (every block weight sharded: the
persistence threshold is 0) with each block compiled, the whole model compiled, or DeepSpeed's
``compile`` config section, trains to the eager run's weights at stages 1-3, and compiles no
new graph after the first steps.

The backend is ``aot_eager``: AOTAutograd's traced forward and backward, the part that saved
a gathered weight for backward and failed once ZeRO-3 released it (see [Note: compiled
units] in ``core/zero/stage3.py``), without inductor's code generation time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks_each

STEPS, MICRO, VOCAB, SEQ = 8, 2, 64, 16
CASES = [("blocks", 1), ("blocks", 2), ("blocks", 3), ("whole", 3), ("config", 3)]


def compile_worker(rank: int, world: int, how: str, stage: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model: Any = GPT(GPTConfig(vocab=VOCAB, d=256, heads=4, layers=3, seq=SEQ))
    blocks = model.blocks
    if how == "blocks":
        for block in blocks:
            block.compile(backend="aot_eager")
    elif how == "whole":
        model = torch.compile(model, backend="aot_eager")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 20_000,
        },
    }
    if how == "config":  # DeepSpeed's section: the engine compiles each block
        config["compile"] = {"enabled": True, "backend": "aot_eager"}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = ds_strategy.initialize(model, optimizer, config)
    g = torch.Generator().manual_seed(1)
    frames, sharded = [], True
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (world * MICRO, SEQ + 1), generator=g)
        mine = tokens[rank * MICRO : (rank + 1) * MICRO]
        logits = engine(mine[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1)))
        engine.step()
        frames.append(counters["stats"]["unique_graphs"])  # graphs compiled so far
        # between steps ZeRO-3 holds no block weight whole: each was gathered and released
        sharded &= all(p.numel() == 0 for p in blocks.parameters())
    weights = {k.removeprefix("_orig_mod."): v for k, v in engine.full_state_dict().items()}
    engine.destroy()
    return {"weights": weights, "frames": frames, "sharded": sharded}


@pytest.mark.slow
def test_compiled_blocks_and_models_train_as_eager_at_every_stage() -> None:
    calls = [(compile_worker, ("eager", stage)) for stage in (1, 2, 3)]
    calls += [(compile_worker, case) for case in CASES]
    results = run_ranks_each(calls, 2)
    eager = {stage: results[stage - 1][0] for stage in (1, 2, 3)}
    for (how, stage), per_rank in zip(CASES, results[3:], strict=True):
        for res in per_rank:
            ref = eager[stage]["weights"]
            assert res["weights"].keys() == ref.keys()
            gap = max((res["weights"][k] - ref[k]).abs().max().item() for k in ref)
            assert gap <= 1e-5, (how, stage, gap)
            frames = res["frames"]
            assert frames[0] > 0, (how, stage)  # it did compile
            assert frames[2] == frames[-1], (how, stage, frames)  # and nothing after step 3
            assert res["sharded"] == (stage == 3), (how, stage)
    # the runs moved the weights: the comparison above is not of untrained models
    torch.manual_seed(0)
    first = GPT(GPTConfig(vocab=VOCAB, d=256, heads=4, layers=3, seq=SEQ)).state_dict()
    moved = max((eager[3]["weights"][k] - v).abs().max().item() for k, v in first.items())
    assert moved > 1e-3, moved


def test_a_bad_compile_section_names_its_key() -> None:
    from ds_strategy.config import ConfigError
    from ds_strategy.core.engine import compile_backend

    assert compile_backend("aot_eager") == "aot_eager"
    assert compile_backend("tests.models.lm_loss") is not None  # "package.module.function"
    for bad in ("no_such_backend", "no.such.module", "", 3):
        with pytest.raises(ConfigError, match="compile.backend"):
            compile_backend(bad)
    with pytest.raises(ConfigError, match="compile.enabled"):
        ds_strategy.load_config({"compile": {"enabled": "maybe"}})
