"""``ds_strategy.init_inference`` on 2 gloo ranks: a transformers Llama built from a config and
the demo GPT, read from their files, generate exactly the plain model's greedy tokens when
sharded (ZeRO-Inference), offloaded to NVMe or the CPU, and tensor-parallel; int8 / int4
logits against fp32 on the corpus; weight bytes per rank counted from live tensors; the
live-parameter budget; loading from ds_strategy checkpoints with each rank reading only its
part; sampling kept in step across ranks. The 2-rank cases share one spawn."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import ds_strategy
from ds_strategy.core.memory import live_tensor_bytes
from tests.distributed import run_ranks_each
from tests.inference_common import (
    GPT_KWARGS,
    LLAMA_VOCAB,
    corpus_tokens,
    corpus_windows,
    write_gpt,
    write_llama,
)

# slow: every layout and model generates in one 2-rank run (about 20 s)
pytestmark = pytest.mark.slow

WORLD = 2
NEW_TOKENS = 32

LAYOUTS: dict[str, Any] = {
    "zero3": ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}, {}),
    "zero3_cpu_offload": (
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "offload_param": {"device": "cpu"},
            }
        },
        {},
    ),
    "zero3_nvme": (None, {}),  # filled per rank with its swap directory
    "tp2": (None, {"tensor_parallel": 2}),
}


def _nvme(path: str) -> dict[str, Any]:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    return {"zero_optimization": {**zero, "offload_param": {"device": "nvme", "nvme_path": path}}}


def _reference_llama(directory: str, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        return tokens, model(prompt).logits


def _reference_gpt(directory: str, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    from ds_strategy.demos.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(**GPT_KWARGS)).eval()
    model.load_state_dict(load_file(f"{directory}/model.safetensors"), strict=False)
    tokens = prompt
    with torch.no_grad():  # greedy, recomputing the prefix: no cache, no engine
        for _ in range(NEW_TOKENS):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
        return tokens, model(prompt)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _parity_worker(rank: int, world: int, dirs: dict[str, str], swap: str) -> dict[str, Any]:
    """Each rank its own prompt (ZeRO-Inference serves different inputs per rank), except
    tensor parallelism, whose ranks share theirs."""
    out: dict[str, Any] = {}
    for kind, directory in dirs.items():
        vocab = LLAMA_VOCAB if kind == "llama" else GPT_KWARGS["vocab"]
        reference = _reference_llama if kind == "llama" else _reference_gpt
        for layout, (config, kwargs) in LAYOUTS.items():
            if layout == "zero3_nvme":
                config = _nvme(f"{swap}/{rank}")
            offset = 0 if layout == "tp2" else 100 * rank
            prompt = corpus_tokens(vocab, 2 * 8, offset).view(2, 8)
            want, want_logits = reference(directory, prompt)
            engine = ds_strategy.init_inference(directory, config, **kwargs)
            got = engine.generate(prompt, NEW_TOKENS)
            logits = _logits(engine(prompt))
            report = engine.memory_report()
            engine.destroy()
            out[f"{kind}/{layout}"] = {
                "tokens_equal": torch.equal(got, want),
                "new_tokens": got.shape[1] - prompt.shape[1],
                "max_logit_diff": (logits - want_logits).abs().max().item(),
                "report": report,
            }
    return out


def _live_weight_bytes(build: Any) -> tuple[Any, int]:
    """The engine ``build()`` returns and the bytes of live tensors it added (its weights: the
    file it read from is closed by then)."""
    gc.collect()
    before = live_tensor_bytes()
    engine = build()
    gc.collect()
    return engine, live_tensor_bytes() - before


def _quant_worker(rank: int, world: int, dirs: dict[str, str]) -> dict[str, Any]:
    """fp32 against int8 / int4, plain and under ZeRO-Inference: logits on corpus windows and
    the weight bytes each rank holds, counted from live tensors."""
    out: dict[str, Any] = {}
    for kind, directory in dirs.items():
        vocab = LLAMA_VOCAB if kind == "llama" else GPT_KWARGS["vocab"]
        windows = corpus_windows(vocab, 4, 48)
        for layout, config in (("plain", None), ("zero3", LAYOUTS["zero3"][0])):
            fp32, fp32_bytes = _live_weight_bytes(
                lambda c=config, d=directory: ds_strategy.init_inference(d, c)
            )
            ref = _logits(fp32(windows)).flatten()
            fp32.destroy()
            del fp32
            for bits in (8, 4):
                engine, nbytes = _live_weight_bytes(
                    lambda c=config, b=bits, d=directory: ds_strategy.init_inference(
                        d, c, quantization=b
                    )
                )
                logits = _logits(engine(windows)).flatten()
                out[f"{kind}/{layout}/int{bits}"] = {
                    "cosine": F.cosine_similarity(logits, ref, 0).item(),
                    "bytes_ratio": nbytes / fp32_bytes,
                    "reported_ratio": engine.memory_report()["params"] / fp32_bytes,
                }
                engine.destroy()
                del engine
    return out


def _gathered_bytes(groups: list[Any], seen: list[int]) -> Any:
    """A hook recording the bytes the groups' full buffers hold when it runs."""

    def hook(*_: Any) -> None:
        seen.append(sum(g._full.untyped_storage().nbytes() for g in groups))

    return hook


def _budget_worker(rank: int, world: int, directory: str, swap: str) -> dict[str, Any]:
    """ZeRO-Inference with a live-parameter budget of the root plus two blocks: the bytes
    gathered at any moment of a forward (read from the gathered buffers' storage inside every
    block's forward) stay within it, and prefetching uses it. With NVMe offload the slices
    live in files between uses."""
    out: dict[str, Any] = {}
    for name, offload in (
        ("cpu", None),
        ("nvme", {"device": "nvme", "nvme_path": f"{swap}/b{rank}"}),
    ):
        probe = ds_strategy.init_inference(directory, LAYOUTS["zero3"][0])
        root, block = probe.units[-1].numel, max(u.numel for u in probe.units[:-1])
        probe.destroy()
        zero: dict[str, Any] = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": root + 2 * block,
            "stage3_prefetch_bucket_size": block,
        }
        if offload:
            zero["offload_param"] = offload
        engine = ds_strategy.init_inference(directory, {"zero_optimization": zero})
        groups = [g for u in engine.units for g in u.groups]
        seen: list[int] = []
        for u in engine.units[:-1]:
            u.module.register_forward_hook(_gathered_bytes(groups, seen))
            u.module.register_forward_pre_hook(_gathered_bytes(groups, seen))
        engine.generate(corpus_tokens(LLAMA_VOCAB, 8, 50 * rank).view(1, 8), 6)
        report = engine.memory_report()
        out[name] = {
            "budget_bytes": (root + 2 * block) * 4,
            "one_step_bytes": (root + block) * 4,
            "most_gathered": max(seen),
            "peak_gathered": report["peak_gathered_params"],
            "report": report,
        }
        engine.destroy()
    return out


def _counting(load: Any, read: list[int]) -> Any:
    """``CheckpointSource._load`` that adds the elements it read to ``read[0]``."""

    def counting(self: Any, key: str, dtype: Any, numel: int, runs: Any) -> Any:
        t = load(self, key, dtype, numel, runs)
        read[0] += t.numel()
        return t

    return counting


def _checkpoint_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    """A demo GPT trained 2 steps with ZeRO-3 (and one with tensor parallelism, D=1 x T=2, and
    a pipeline of 2 stages) and saved; inference reads the checkpoints: the same logits as the
    trained weights, and under ZeRO-Inference each rank reads about half of the elements."""
    from ds_strategy.core.inference import sources
    from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss

    cfg = GPTConfig(**GPT_KWARGS)
    x = corpus_tokens(cfg.vocab, 2 * 16).view(2, 16)
    out: dict[str, Any] = {}
    for name, train_cfg in (
        ("zero3", {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}),
        ("tp2", {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}),
    ):
        torch.manual_seed(0)
        model = GPT(cfg)
        engine = ds_strategy.initialize(
            model, torch.optim.AdamW(model.parameters(), 1e-3), train_cfg
        )
        for _ in range(2):
            engine.backward(gpt_loss(engine, corpus_tokens(cfg.vocab, 4 * 17, 7).view(4, 17)))
            engine.step()
        engine.save_checkpoint(f"{root}/{name}", tag="step2")
        trained = GPT(cfg).eval()
        trained.load_state_dict(engine.full_state_dict())
        engine.destroy()
        with torch.no_grad():
            want = trained(x)
        for layout, config in (("plain", None), ("zero3", LAYOUTS["zero3"][0])):
            read = [0]
            original = sources.CheckpointSource._load
            sources.CheckpointSource._load = _counting(original, read)  # type: ignore[method-assign]
            try:
                served = ds_strategy.init_inference(
                    lambda: GPT(cfg), config, checkpoint=f"{root}/{name}"
                )
            finally:
                sources.CheckpointSource._load = original  # type: ignore[method-assign]
            out[f"{name}/{layout}"] = {
                "max_diff": (served(x) - want).abs().max().item(),
                "read_fraction": read[0] / sum(p.numel() for p in trained.parameters()),
            }
            served.destroy()
    out.update(_pipeline_checkpoint(root, x))
    return out


def _pipeline_checkpoint(root: str, x: torch.Tensor) -> dict[str, Any]:
    """A pipeline (2 stages x 1) trains the demo GPT as layers one step and saves; its root
    (``stage_0``, ``stage_1``) serves the same ``nn.Sequential``, plain and sharded."""
    from ds_strategy.demos.gpt import GPT, GPTConfig, as_sequential

    cfg = GPTConfig(**{**GPT_KWARGS, "tie_embeddings": False})
    torch.manual_seed(0)
    layers = as_sequential(GPT(cfg))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    config = {
        "pipeline": {"stages": 2},
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
    }
    engine = ds_strategy.initialize(
        layers, torch.optim.AdamW(layers.parameters(), 1e-3), config, loss_fn=loss_fn
    )
    batch = corpus_tokens(cfg.vocab, 4 * 17, 11).view(4, 17)
    engine.train_batch(batch[:, :-1], batch[:, 1:])
    engine.save_checkpoint(f"{root}/pipe", tag="step1")
    trained = as_sequential(GPT(cfg)).eval()
    trained.load_state_dict(engine.full_state_dict())
    engine.destroy()
    with torch.no_grad():
        want = trained(x)
    out = {}
    for layout, served_cfg in (("plain", None), ("zero3", LAYOUTS["zero3"][0])):
        served = ds_strategy.init_inference(
            lambda: as_sequential(GPT(cfg)), served_cfg, checkpoint=f"{root}/pipe"
        )
        out[f"pipeline/{layout}"] = {
            "max_diff": (served(x) - want).abs().max().item(),
            "read_fraction": None,
        }
        served.destroy()
    return out


def _sampling_worker(rank: int, world: int, dirs: dict[str, str]) -> dict[str, Any]:
    """Sampling under ZeRO-Inference: both ranks draw the same tokens (one seed, broadcast),
    the same seed draws them again, and a plain engine with that seed draws them too. An end
    token stops a sharded generation where the plain model stops, on each rank's own prompt
    (the ranks keep running forwards until both are done). Plain replicas generate
    independently: rank 0 twice, rank 1 once."""
    llama, gpt = dirs["llama"], dirs["gpt"]
    prompt = corpus_tokens(LLAMA_VOCAB, 8).view(1, 8)
    sharded = ds_strategy.init_inference(llama, LAYOUTS["zero3"][0])
    opts = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95)
    out: dict[str, Any] = {
        "a": sharded.generate(prompt, 16, seed=11, **opts),
        "b": sharded.generate(prompt, 16, seed=11, **opts),
        "c": sharded.generate(prompt, 16, seed=12, **opts),
        "unseeded": sharded.generate(prompt, 16, **opts),  # rank 0's random seed, broadcast
    }
    plain = ds_strategy.init_inference(llama)
    out["plain"] = plain.generate(prompt, 16, seed=11, **opts)
    for _ in range(2 if rank == 0 else 1):  # no collective: this would hang otherwise
        plain.generate(prompt, 4, do_sample=True)
    for kind, directory, vocab in (
        ("llama", llama, LLAMA_VOCAB),
        ("gpt", gpt, GPT_KWARGS["vocab"]),
    ):
        mine = corpus_tokens(vocab, 8, 300 * rank + 20).view(1, 8)
        whole = ds_strategy.init_inference(directory)
        free = whole.generate(mine, 12)
        eos = int(free[0, 8 + 3 + rank])  # each rank's prompt ends at another step
        config = LAYOUTS["zero3"][0]
        stopped = ds_strategy.init_inference(directory, config).generate(mine, 12, eos_token_id=eos)
        out[f"eos/{kind}"] = (stopped, whole.generate(mine, 12, eos_token_id=eos), eos)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    tmp = tmp_path_factory.mktemp("inference")
    dirs = {"llama": str(write_llama(tmp / "llama")), "gpt": str(write_gpt(tmp / "gpt"))}
    swap = tmp / "swap"
    for r in range(WORLD):
        (swap / str(r)).mkdir(parents=True)
        (swap / f"b{r}").mkdir(parents=True)
    calls = [
        (_parity_worker, (dirs, str(swap))),
        (_quant_worker, (dirs,)),
        (_budget_worker, (dirs["llama"], str(swap))),
        (_checkpoint_worker, (str(tmp / "ckpt"),)),
        (_sampling_worker, (dirs,)),
    ]
    names = ["parity", "quant", "budget", "checkpoint", "sampling"]
    return dict(zip(names, run_ranks_each(calls, WORLD, timeout=900), strict=True))


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_equal_the_plain_models(runs: dict[str, Any], kind: str, layout: str) -> None:
    for rank in range(WORLD):
        r = runs["parity"][rank][f"{kind}/{layout}"]
        assert r["new_tokens"] == NEW_TOKENS
        assert r["tokens_equal"], (rank, r)
        bound = 0.0 if layout.startswith("zero3") else 1e-5  # tensor parallelism sums partials
        assert r["max_logit_diff"] <= bound, (rank, r)


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_zero_inference_holds_a_shard_and_nvme_holds_files(runs: dict[str, Any], kind: str) -> None:
    for rank in range(WORLD):
        res = runs["parity"][rank]
        whole = res[f"{kind}/tp2"]["report"]["params"]
        sharded = res[f"{kind}/zero3"]["report"]
        nvme = res[f"{kind}/zero3_nvme"]["report"]
        assert sharded["params"] < whole
        assert sharded["peak"] > sharded["params"]  # gathered blocks are counted at their peak
        assert nvme["offloaded_nvme"] > 0.8 * sharded["params"]
        assert nvme["params"] < 0.2 * sharded["params"]


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("layout", ["plain", "zero3"])
def test_int8_and_int4_logits_and_bytes(runs: dict[str, Any], kind: str, layout: str) -> None:
    """The issue's bounds: cosine >= 0.99 (int8) / 0.97 (int4) with fp32 on the corpus; weight
    bytes per rank <= 0.27x / 0.16x of fp32's, scales included, from live tensors."""
    for rank in range(WORLD):
        int8 = runs["quant"][rank][f"{kind}/{layout}/int8"]
        int4 = runs["quant"][rank][f"{kind}/{layout}/int4"]
        assert int8["cosine"] >= 0.99 and int4["cosine"] >= 0.97, (int8, int4)
        assert int8["bytes_ratio"] <= 0.27 and int4["bytes_ratio"] <= 0.16, (int8, int4)
        for r in (int8, int4):  # the engine's own report agrees with the live tensors
            assert abs(r["reported_ratio"] - r["bytes_ratio"]) < 0.02, r


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_gathered_parameters_stay_within_the_live_budget(
    runs: dict[str, Any], offload: str
) -> None:
    for rank in range(WORLD):
        r = runs["budget"][rank][offload]
        assert r["most_gathered"] <= r["budget_bytes"], r
        assert r["peak_gathered"] <= r["budget_bytes"], r
        assert r["most_gathered"] > r["one_step_bytes"], r  # the next block was prefetched
    nvme = runs["budget"][0]["nvme"]["report"]
    assert nvme["offloaded_nvme"] > 0


@pytest.mark.parametrize("trained", ["zero3", "tp2", "pipeline"])
@pytest.mark.parametrize("layout", ["plain", "zero3"])
def test_checkpoints_of_any_layout_load_and_ranks_read_their_part(
    runs: dict[str, Any], trained: str, layout: str
) -> None:
    for rank in range(WORLD):
        r = runs["checkpoint"][rank][f"{trained}/{layout}"]
        assert r["max_diff"] <= 1e-6, r
        if trained == "pipeline":
            continue  # read as the other layouts are; only the stages' union is new
        if layout == "zero3":
            assert r["read_fraction"] < 0.6, r  # about 1/2, plus the rows shards straddle
        else:
            assert r["read_fraction"] >= 1.0, r


def test_sampling_stays_in_step_and_repeats_with_its_seed(runs: dict[str, Any]) -> None:
    r0, r1 = runs["sampling"]
    for key in ("a", "b", "c", "unseeded", "plain"):
        assert torch.equal(r0[key], r1[key]), key
    assert torch.equal(r0["a"], r0["b"]) and torch.equal(r0["a"], r0["plain"])
    assert not torch.equal(r0["a"], r0["c"])


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_an_end_token_stops_sharded_generation_where_the_plain_model_stops(
    runs: dict[str, Any], kind: str
) -> None:
    for rank in range(WORLD):
        stopped, plain, eos = runs["sampling"][rank][f"eos/{kind}"]
        assert torch.equal(stopped, plain), (rank, stopped, plain)
        assert int(stopped[0, -1]) == eos and stopped.shape[1] < 8 + 12
