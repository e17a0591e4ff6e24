"""torch.compile under ZeRO: the demo GPT at width 256 (every block weight sharded: the
persistence threshold is 0) with each block compiled, the whole model compiled, or DeepSpeed's
``compile`` config section, trains to the eager run's weights at stages 1-3 and compiles no
new graph after the first steps (evaluation and accumulation boundaries included); so does a
transformers Llama built from a config (compiled decoder layers) at ZeRO-3; and compiling
composes with offload, bf16/fp16, activation checkpointing, tensor parallelism and pipeline
stages.

The backend is ``aot_eager``: AOTAutograd's traced forward and backward, the part that saved
a gathered weight for backward and failed once ZeRO-3 released it (see [Note: compiled
units] in ``core/zero/stage3.py``), without inductor's code generation time; one case runs
inductor (and ``benchmarks/bench_compile.py`` times it).
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig, as_sequential
from tests.distributed import run_ranks_each

STEPS, MICRO, VOCAB, SEQ = 8, 2, 64, 16
CASES = [("blocks", 1), ("blocks", 2), ("blocks", 3), ("whole", 3), ("config", 3), ("after", 3)]


def gpt(d: int = 256, layers: int = 3, tied: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=VOCAB, d=d, heads=4, layers=layers, seq=SEQ, tie_embeddings=tied))


def llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from tests.inference_common import llama_config

    torch.manual_seed(0)
    sizes = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=64)
    return LlamaForCausalLM(llama_config(vocab_size=VOCAB, **sizes))


def base_config(stage: int, accumulation: int = 1) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,  # every block weight sharded
            "reduce_bucket_size": 20_000,
        },
    }


def train(
    rank: int,
    world: int,
    model: Any,
    config: dict[str, Any],
    how: str = "eager",
    steps: int = STEPS,
    evaluate: bool = False,
) -> dict[str, Any]:
    """``steps`` optimizer steps of ``model`` (compiled as ``how`` says) on rank-split token
    batches; with ``evaluate``, a forward under ``no_grad`` before steps 2 and 5."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = lists[0] if lists else model  # a pipeline's nn.Sequential: its layers
    if how == "blocks":
        for block in blocks:
            block.compile(backend="aot_eager")
    elif how == "whole":
        model = torch.compile(model, backend="aot_eager")
    elif how == "config":  # DeepSpeed's section: the engine compiles each block
        config = {**config, "compile": {"enabled": True, "backend": "aot_eager"}}
    pipeline = "pipeline" in config
    kwargs: dict[str, Any] = {"loss_fn": lm_loss} if pipeline else {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        engine = ds_strategy.initialize(model, optimizer, config, **kwargs)
        if how == "after":  # DeepSpeed's engine.compile() on the built engine
            engine.compile(backend="aot_eager")
        accumulation = config.get("gradient_accumulation_steps", 1)
        tp = "tensor_parallel" in config  # the tensor-parallel ranks see one batch
        g = torch.Generator().manual_seed(1)
        frames, sharded = [], True
        for step in range(steps):
            for _ in range(1 if pipeline else accumulation):
                rows = MICRO * (accumulation if pipeline else 1)
                tokens = torch.randint(0, VOCAB, (world * rows, SEQ + 1), generator=g)
                mine = tokens[:rows] if tp or pipeline else tokens[rank * rows : (rank + 1) * rows]
                if pipeline:
                    engine.train_batch(mine[:, :-1], mine[:, 1:])
                    continue
                if evaluate and step in (2, 5):
                    engine.eval()
                    with torch.no_grad():
                        engine(mine[:, :-1])
                    engine.train()
                engine.backward(lm_loss(engine(mine[:, :-1]), mine[:, 1:]))
                engine.step()
            frames.append(counters["stats"]["unique_graphs"])  # graphs compiled so far
            # between steps ZeRO-3 holds no block weight whole: each was gathered and released
            sharded &= all(p.numel() == 0 for p in blocks.parameters())
    weights = {k.removeprefix("_orig_mod."): v.float() for k, v in engine.full_state_dict().items()}
    comm = {k: v for k, v in engine.comm_report().items() if k.startswith("tp_")}
    result = {
        "weights": weights,
        "frames": frames,
        "sharded": sharded,
        "report": engine.compile_report(),
        "comm": comm,
        "warnings": [str(w.message) for w in caught if "torch.compile" in str(w.message)],
    }
    engine.destroy()
    return result


def lm_loss(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)  # a transformers model's output
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a["weights"].keys() == b["weights"].keys()
    return max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])


def gpt_run(rank: int, world: int, how: str, stage: int, **kw: Any) -> dict[str, Any]:
    return train(rank, world, gpt(), base_config(stage, kw.pop("accumulation", 1)), how, **kw)


def accumulating_run(rank: int, world: int, how: str) -> dict[str, Any]:
    return gpt_run(rank, world, how, 3, accumulation=2, evaluate=True)


def llama_run(rank: int, world: int, how: str) -> dict[str, Any]:
    return train(rank, world, llama(), base_config(3), how, evaluate=True)


@pytest.mark.slow
def test_compiled_blocks_and_models_train_as_eager_at_every_stage() -> None:
    calls = [(gpt_run, ("eager", stage)) for stage in (1, 2, 3)]
    calls += [(gpt_run, case) for case in CASES]
    # evaluation between steps and accumulation boundaries: the same graphs serve
    calls += [(accumulating_run, (how,)) for how in ("eager", "config")]
    results = run_ranks_each(calls, 2)
    eager = {stage: results[stage - 1][0] for stage in (1, 2, 3)}
    n = len(CASES)
    compiled = list(zip(CASES, results[3 : 3 + n], strict=True))
    compiled.append((("config+accumulation+eval", 3), results[4 + n]))
    eager_of = {case: eager[case[1]] for case, _ in compiled}
    eager_of[("config+accumulation+eval", 3)] = results[3 + n][0]
    for case, per_rank in compiled:
        for res in per_rank:
            assert gap(res, eager_of[case]) <= 1e-5, case
            frames = res["frames"]
            assert frames[0] > 0, case  # it did compile
            assert frames[2] == frames[-1], (case, frames)  # and nothing after step 3
            assert res["sharded"] == (case[1] == 3), case
            report = res["report"]
            assert report["graphs"] == frames[-1] and report["graph_breaks"] == 0, report
            assert report["last_new_graph_step"] <= 3, report
            assert report["compiled_units"] == (1 if case[0] == "whole" else 3), report
    # the runs moved the weights: the comparison above is not of untrained models
    first = gpt().state_dict()
    moved = max((eager[3]["weights"][k] - v).abs().max().item() for k, v in first.items())
    assert moved > 1e-3, moved
    assert eager[3]["report"]["graphs"] == 0 and eager[3]["report"]["compiled_units"] == 0


@pytest.mark.slow
def test_a_transformers_llama_compiles_per_decoder_layer_at_zero3() -> None:
    eager, compiled = run_ranks_each([(llama_run, ("eager",)), (llama_run, ("config",))], 2)
    for res in compiled:
        assert gap(res, eager[0]) <= 1e-5
        assert res["sharded"]  # every decoder-layer weight was released between steps
        assert res["report"]["compiled_units"] == 2  # one per decoder layer
        assert res["report"]["graph_breaks"] == 0, res["report"]["break_reasons"]
        assert res["frames"][0] > 0 and res["frames"][2] == res["frames"][-1], res["frames"]
    moved = max(
        (eager[0]["weights"][k] - v).abs().max().item() for k, v in llama().state_dict().items()
    )
    assert moved > 1e-3, moved


FEATURES: dict[str, dict[str, Any]] = {
    "cpu_offload": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    "nvme_offload": {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "checkpointing": {"activation_checkpointing": {"enabled": True}},
    "tensor_parallel": {"tensor_parallel": {"autotp_size": 2}, "stage": 1},
    "tensor_parallel+checkpointing": {
        "tensor_parallel": {"autotp_size": 2},
        "activation_checkpointing": {"enabled": True},
        "stage": 1,
    },
    "pipeline": {"pipeline": {"stages": 2}, "stage": 1, "gradient_accumulation_steps": 2},
    "inductor": {"backend": "inductor"},  # code generation, not only AOTAutograd's graphs
}


def feature_run(rank: int, world: int, feature: str, how: str, nvme: str) -> dict[str, Any]:
    extra = dict(FEATURES[feature])
    config = base_config(extra.pop("stage", 3))
    if how == "config":
        config["compile"] = {"enabled": True, "backend": extra.pop("backend", "aot_eager")}
        how = "eager"  # the section compiles
    extra.pop("backend", None)
    for key, value in extra.items():
        if key.startswith("offload"):
            if value["device"] == "nvme":
                value = {**value, "nvme_path": nvme}
            config["zero_optimization"][key] = value
        else:
            config[key] = value
    model = gpt(d=128, layers=2, tied="pipeline" not in config)
    if "pipeline" in config:
        model = as_sequential(model)
    return train(rank, world, model, config, how, steps=4)


@pytest.mark.slow
def test_compiling_composes_with_offload_precision_checkpointing_tp_and_pipelines() -> None:
    nvme = tempfile.mkdtemp(prefix="compile-nvme-")
    calls = [(feature_run, (f, how, nvme)) for f in FEATURES for how in ("eager", "config")]
    results = run_ranks_each(calls, 2)
    for i, feature in enumerate(FEATURES):
        eager, compiled = results[2 * i], results[2 * i + 1]
        for e, c in zip(eager, compiled, strict=True):
            assert gap(c, e) <= 1e-5, feature
            assert c["comm"] == e["comm"], feature  # tensor-parallel bytes counted the same
            report = c["report"]
            assert report["compiled_units"] == 2, (feature, report)
            if feature == "tensor_parallel+checkpointing":
                # a break inside a checkpointed region makes Dynamo run the block eagerly;
                # the first step says so
                assert report["graphs"] == 0, report
                assert any("ran eagerly" in w for w in c["warnings"]), c["warnings"]
                continue
            assert report["graphs"] > 0 and report["last_new_graph_step"] == 1, (feature, report)
            assert not c["warnings"], c["warnings"]
            if feature == "tensor_parallel":  # each layer's byte count runs eagerly
                assert set(report["break_reasons"]) == {
                    "Skip calling `torch.compiler.disable()`d function"
                }, report
            else:
                assert report["graph_breaks"] == 0, (feature, report)
    assert results[2 * list(FEATURES).index("tensor_parallel")][0]["comm"]["tp_all_reduce"] > 0


def torch_modules_worker(rank: int, world: int) -> dict[str, Any]:
    """Units whose forward is torch's own: the engine compiles them; a user's
    ``Module.compile()`` of one (which compiles nothing) is warned about."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    config = {**base_config(3), "compile": {"enabled": True, "backend": "aot_eager"}}
    engine = ds_strategy.initialize(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1), config)
    keys = list(engine.module.state_dict())
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 8, 32)).square().mean())
        engine.step()
    report = engine.compile_report()
    engine.destroy()
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    plain.compile(backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        other = ds_strategy.initialize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), {})
    other.destroy()
    return {"report": report, "keys": keys, "warned": [str(w.message) for w in caught]}


def test_torch_own_modules_compile_through_their_forward() -> None:
    from tests.distributed import run_ranks

    got = run_ranks(torch_modules_worker, 1)[0]
    assert got["report"]["compiled_units"] == 2 and got["report"]["graphs"] > 0, got["report"]
    assert got["report"]["graph_breaks"] == 0, got["report"]
    assert got["keys"][0] == "layers.0.self_attn.in_proj_weight"  # names unchanged
    assert any("the model (Sequential)" in w and "run eagerly" in w for w in got["warned"])


def test_a_bad_compile_section_names_its_key() -> None:
    from ds_strategy.config import ConfigError
    from ds_strategy.core.compiled import compile_backend

    assert compile_backend("aot_eager") == "aot_eager"
    assert compile_backend("tests.models.lm_loss") is not None  # "package.module.function"
    for bad in ("no_such_backend", "no.such.module", "", 3):
        with pytest.raises(ConfigError, match="compile.backend"):
            compile_backend(bad)
    with pytest.raises(ConfigError, match="compile.enabled"):
        ds_strategy.load_config({"compile": {"enabled": "maybe"}})
