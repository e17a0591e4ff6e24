"""Long sequences split across ranks: Ulysses sequence parallelism (``sequence_parallel_size``)
and ring attention (``context_parallel_size``), alone and together, composed with ZeRO.

The attention primitives equal ``scaled_dot_product_attention`` over the whole sequence, in
their outputs and in the gradients of every rank's queries, keys and values. An engine
splitting each sequence over 2 ranks trains the demo GPT and a transformers Llama (grouped
query attention) to the losses and weights of one process training on the whole sequences,
at ZeRO stages 1-3, with activation checkpointing and gradient accumulation, and with data
parallelism beside it on 4 ranks. Bad input is a ``ConfigError`` naming its key."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

import ds_strategy
from ds_strategy.config import ConfigError, load_config
from ds_strategy.core.activation_checkpointing import SavedTensorMeter
from ds_strategy.core.layout import RankLayout
from ds_strategy.core.sequence import SequenceAttention, SequenceSplit, ring_attention
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks, run_ranks_each
from tests.test_tensor_parallel import key_bias

STEPS, BATCH, SEQ, LR = 4, 2, 32, 1e-2
# The Llama's AdamW steps at 1e-3: where a gradient is near zero AdamW turns rounding noise
# into steps of about lr. One process with eager attention ends 3-8e-5 away from the same
# process with sdpa at 1e-2, 3-8e-6 at 1e-3 (measured), whatever ranks do.
LLAMA_LR = 1e-3
TOL = 1e-5
GPT_CONFIG = GPTConfig(vocab=64, d=32, layers=2, heads=4, seq=SEQ)


# -- the batch split, in one process ---------------------------------------------------------


class _Group:
    """What a ``SequenceSplit`` reads of its group, for arithmetic without processes."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank


def test_a_block_has_its_tokens_positions_and_the_labels_shifted_on_the_whole_sequence() -> None:
    ids = torch.arange(16).view(2, 8)
    split = SequenceSplit(_Group(2, 1))  # type: ignore[arg-type]
    out = split.shard(ids, ids.clone())
    assert out["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert out["position_ids"].tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]
    # position 7 has no next token; position 3 (rank 0's last) is labelled 4, which rank 1 holds
    assert out["shift_labels"].tolist() == [[5, 6, 7, -100], [13, 14, 15, -100]]
    assert SequenceSplit(_Group(2, 0)).shard(ids, ids)["shift_labels"][0, -1] == 4  # type: ignore[arg-type]
    assert int(out["num_items_in_batch"]) == 2 * 7  # the whole sequences' labelled tokens
    with pytest.raises(ConfigError, match="does not split into 2 equal blocks") as e:
        split.shard(torch.zeros(1, 7, dtype=torch.long))
    assert e.value.key == "sequence_parallel_size"
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, -2:] = 0
    with pytest.raises(ConfigError, match="has padding"):
        split.shard(ids, ids, attention_mask=padded)
    split.shard(ids, ids, attention_mask=torch.ones(2, 8))  # no padding: accepted


def test_the_deepspeed_keys_load() -> None:
    cfg = load_config(
        {"sequence_parallel_size": 4, "seq_parallel_comm_data_type": "BF16"}  # DeepSpeed's names
    )
    assert cfg.sequence_parallel_size == 4 and cfg.context_parallel_size == 1
    assert cfg.seq_parallel_communication_data_type is not None
    assert cfg.seq_parallel_communication_data_type.value == "bf16"
    with pytest.raises(ConfigError) as e:
        load_config({"sequence_parallel_size": 0})
    assert e.value.key == "sequence_parallel_size"


# -- the attention primitives against whole-sequence attention ------------------------------


def _attention_case(
    rank: int, world: int, sp: int, cp: int, kv_heads: int, causal: bool, fused: bool = True
) -> dict[str, float]:
    """Outputs and gradients of a split attention against the whole sequence's, worst gaps.
    ``fused=False``: ring attention's blocks written out (as off CPU), not torch's kernel."""
    from ds_strategy.core.sequence import ring

    saved = ring._FUSED_DEVICES
    ring._FUSED_DEVICES = saved if fused else ()
    try:
        return _attention_gaps(sp, cp, kv_heads, causal)
    finally:
        ring._FUSED_DEVICES = saved


def _attention_gaps(sp: int, cp: int, kv_heads: int, causal: bool) -> dict[str, float]:
    layout = RankLayout.over(sp=sp, cp=cp)
    split = SequenceSplit(layout.comm(("cp", "sp")))
    attention = SequenceAttention(layout.comm("sp"), layout.comm("cp"))
    attention.enabled = True
    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 16, 8
    q = torch.randn(b, h, s, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen, requires_grad=True) for _ in "kv")
    weight = torch.randn(b, h, s, d, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != h)
    (ref * weight).sum().backward()
    local = [split.block(t.detach(), 2).requires_grad_() for t in (q, k, v)]
    out = attention(*local, causal=causal)
    (out * split.block(weight, 2)).sum().backward()
    gaps = {"out": (out - split.block(ref.detach(), 2)).abs().max().item()}
    for name, mine, whole in zip("qkv", local, (q, k, v), strict=True):
        assert mine.grad is not None and whole.grad is not None
        gaps[name] = (mine.grad - split.block(whole.grad, 2)).abs().max().item()
    return gaps


ATTENTION_CASES = {
    2: [
        # (sp, cp, key/value heads, causal)
        (2, 1, 4, True),
        (2, 1, 2, True),
        (2, 1, 1, True),  # fewer key/value heads than ranks: replicated
        (2, 1, 4, False),
        (1, 2, 4, True),
        (1, 2, 2, True),
        (1, 2, 4, False),
        (1, 2, 2, True, False),  # ring attention's blocks without the fused kernel
        (1, 2, 4, False, False),
    ],
    4: [(2, 2, 2, True), (2, 2, 1, True), (4, 1, 4, True), (1, 4, 2, True)],
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_split_attention_equals_attention_over_the_whole_sequence(world: int) -> None:
    cases = ATTENTION_CASES[world]
    results = run_ranks_each([(_attention_case, case) for case in cases], world)
    for case, per_rank in zip(cases, results, strict=True):
        for rank, gaps in enumerate(per_rank):
            assert max(gaps.values()) <= 1e-5, (case, rank, gaps)


def _ring_one_rank(rank: int, world: int) -> float:
    """Ring attention of a group of one is attention: the ranks of a 2-rank job each alone."""
    from ds_strategy.core.collectives import Comm

    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in "qkv")
    layout = RankLayout.over(Comm(), cp=1)
    got = ring_attention(q, k, v, layout.comm("cp"))
    return (got - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max().item()


def test_ring_attention_of_one_rank_is_plain_attention() -> None:
    assert max(run_ranks(_ring_one_rank, 2)) <= 1e-6


# -- engines against one process on the whole sequences -------------------------------------


def _batches(world_batches: int = 1) -> list[torch.Tensor]:
    """``STEPS`` batches of ``world_batches x BATCH`` sequences of ``SEQ + 1`` tokens."""
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, GPT_CONFIG.vocab, (world_batches * BATCH, SEQ + 1), generator=gen)
        for _ in range(STEPS)
    ]


def _config(stage: int, sizes: dict[str, int], extra: dict[str, Any] | None) -> dict[str, Any]:
    extra = dict(extra or {})
    zero = {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}
    zero.update(extra.pop("zero_optimization", {}))  # (offload sections)
    return {"zero_optimization": zero, "gradient_clipping": 1.0, **sizes, **extra}


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CONFIG)


def _gpt_run(
    rank: int, world: int, stage: int, sizes: dict[str, int], extra: dict[str, Any] | None
) -> dict[str, Any]:
    """The demo GPT split by the caller (``engine.sequence.shard``): losses, weights, and the
    activations autograd saved in the first forward."""
    model = _gpt()
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LR), _config(stage, sizes, extra)
    )
    seq = engine.sequence.size if engine.sequence is not None else 1  # (None: a reference)
    data_rank, data_ranks = rank // seq, world // seq  # ranks of a sequence are consecutive
    accumulation = engine.gradient_accumulation_steps
    losses, saved = [], 0
    for tokens in _batches(data_ranks):
        mine = tokens[data_rank * BATCH : (data_rank + 1) * BATCH]
        for micro in mine.chunk(accumulation):
            if engine.sequence is None:  # one engine on the whole sequences
                loss = _token_loss(engine(micro[:, :-1]).float(), micro[:, 1:])
                engine.backward(loss)
                engine.step()
                continue
            local = engine.sequence.shard(micro[:, :-1], shift_labels=micro[:, 1:])
            with SavedTensorMeter(model) as meter:
                logits = engine(local["input_ids"], position_ids=local["position_ids"])
            saved = saved or meter.bytes
            loss = engine.sequence.loss(logits, local["shift_labels"], local["num_items_in_batch"])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())  # the step's last micro-batch
    return {"losses": losses, "state": engine.full_state_dict(), "saved": saved}


def _gpt_reference(
    data_ranks: int = 1, accumulation: int = 1
) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """One process, whole sequences, every data rank's batch: losses of the last micro-batch
    of each step (as an engine's rank sees its own), weights, saved activation bytes."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, saved = [], 0
    for tokens in _batches(data_ranks):
        opt.zero_grad()
        per_rank = tokens.chunk(data_ranks)
        for micro in range(accumulation):
            batch = torch.cat([t.chunk(accumulation)[micro] for t in per_rank])
            with SavedTensorMeter(model) as meter:
                logits = model(batch[:, :-1])
            saved = saved or meter.bytes
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            (loss / accumulation).backward()
            rank0 = per_rank[0].chunk(accumulation)[micro]
            with torch.no_grad():
                mine = F.cross_entropy(model(rank0[:, :-1]).flatten(0, 1), rank0[:, 1:].flatten())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(mine))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, saved


def _weight_gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The worst weight difference; the key bias of qkv left out (its true gradient is zero,
    so AdamW turns rounding noise into ±lr steps: see CONVENTIONS.md)."""
    assert got.keys() == want.keys()
    worst = 0.0
    for name, value in want.items():
        diff = (got[name] - value).abs()
        if name.endswith("qkv.bias"):
            diff = diff[~key_bias(diff, GPT_CONFIG.heads)]
        worst = max(worst, diff.max().item())
    return worst


SP, CP = {"sequence_parallel_size": 2}, {"context_parallel_size": 2}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
GPT_CASES = {
    "sp2-zero1": (2, 1, SP, None),
    "sp2-zero2": (2, 2, SP, None),
    "sp2-zero3": (2, 3, SP, None),
    "cp2-zero1": (2, 1, CP, None),
    "cp2-zero3": (2, 3, CP, None),
    "sp2-zero3-checkpointing": (2, 3, SP, {"activation_checkpointing": {"enabled": True}}),
    "sp2-zero3-offload": (2, 3, SP, {"zero_optimization": OFFLOAD}),
    "cp2-zero2-accumulation": (2, 2, CP, {"gradient_accumulation_steps": 2}),
    "sp2-dp2-zero3": (4, 3, SP, None),
    "sp2-cp2-zero2": (4, 2, {**SP, **CP}, None),
}


def _runs_by_world(fn: Any, cases: dict[str, tuple[Any, ...]]) -> dict[str, list[Any]]:
    """``fn`` on each case (its world size first, then ``fn``'s arguments), one spawn a world
    size; results by case name, then rank."""
    out: dict[str, list[Any]] = {}
    for world in sorted({case[0] for case in cases.values()}):
        names = [n for n, case in cases.items() if case[0] == world]
        calls = [(fn, cases[n][1:]) for n in names]
        out.update(zip(names, run_ranks_each(calls, world), strict=True))
    return out


@pytest.fixture(scope="module")
def gpt_runs() -> dict[str, list[dict[str, Any]]]:
    return _runs_by_world(_gpt_run, GPT_CASES)


@pytest.mark.parametrize("name", list(GPT_CASES))
@pytest.mark.slow  # 9 trainings on 2 and 4 ranks, about 15 s
def test_the_demo_gpt_trains_as_one_process_on_the_whole_sequences(
    gpt_runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    world, _, sizes, extra = GPT_CASES[name]
    seq = sizes.get("sequence_parallel_size", 1) * sizes.get("context_parallel_size", 1)
    accumulation = (extra or {}).get("gradient_accumulation_steps", 1)
    losses, state, _ = _gpt_reference(world // seq, accumulation)
    for rank, r in enumerate(gpt_runs[name]):
        if rank // seq == 0:  # the first data rank's sequences: the reference's rank-0 losses
            assert r["losses"] == pytest.approx(losses, abs=TOL), (rank, r["losses"], losses)
        assert _weight_gap(r["state"], state) <= TOL, rank
    assert _weight_gap(_gpt().state_dict(), state) > 100 * TOL  # the steps moved the weights


# bf16 and fp16 against one engine in that precision on the whole sequences: the same
# rounding of weights and activations, summed in another order
BF16, FP16 = {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}
HALF_CASES = {
    "one-bf16": (1, 2, {}, BF16),
    "sp2-bf16": (2, 2, SP, BF16),
    "cp2-bf16": (2, 3, CP, BF16),
    "one-fp16": (1, 2, {}, FP16),
    "sp2-fp16": (2, 3, SP, FP16),
}


@pytest.mark.slow
def test_half_precision_trains_split_as_one_engine_on_the_whole_sequences() -> None:
    runs = _runs_by_world(_gpt_run, HALF_CASES)
    for name, ranks in runs.items():
        if name.startswith("one"):
            continue
        (one,) = runs["one-" + name.split("-")[1]]
        initial = _gpt().state_dict()  # (fp16's loss scaling skipped not every step)
        assert max((one["state"][k] - v).abs().max().item() for k, v in initial.items()) > 1e-2
        for r in ranks:
            assert r["losses"] == pytest.approx(one["losses"], abs=2e-2), (name, r["losses"])
            gaps = torch.cat([(r["state"][k] - v).abs().flatten() for k, v in one["state"].items()])
            # measured: means 2e-4 (sp2) and 4e-4 (cp2); 0.2-0.3% of the weights more than
            # 1e-2 apart (AdamW's steps of +-lr where bf16 noise flips a tiny gradient's sign)
            assert gaps.mean() <= 1e-3, (name, gaps.mean())
            assert (gaps > 1e-2).float().mean() <= 0.01, name


@pytest.mark.slow
def test_a_rank_keeps_about_half_the_activations_at_two_sequence_ranks(
    gpt_runs: dict[str, list[dict[str, Any]]],
) -> None:
    """Saved-for-backward bytes in the forward at stage 1 (parameters whole, so none of them
    counted): each of 2 ranks holds at most 0.6x what one process holds for the whole
    sequences."""
    _, _, whole = _gpt_reference()
    for name in ("sp2-zero1", "cp2-zero1"):
        for r in gpt_runs[name]:
            assert 0 < r["saved"] <= 0.6 * whole, (name, r["saved"], whole)


def _llama(kv_heads: int, attention: str) -> torch.nn.Module:
    """A Llama from a config; ``attention`` is its implementation, after ``"qwen2:"`` for a
    Qwen2 of the same sizes (biases on the query, key and value projections)."""
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.inference_common import llama_config

    family, _, attention = attention.rpartition(":")
    config = llama_config()
    if family == "qwen2":
        config = Qwen2Config(**config.to_dict())
    config.num_key_value_heads = kv_heads
    config._attn_implementation = attention
    torch.manual_seed(0)
    return (Qwen2ForCausalLM if family == "qwen2" else LlamaForCausalLM)(config)


def _llama_batches(rows: int = BATCH) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(1, 100, (rows, SEQ), generator=gen) for _ in range(STEPS)]


def _llama_run(
    rank: int,
    world: int,
    stage: int,
    sizes: dict[str, int],
    kv_heads: int,
    attention: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A transformers Llama called as transformers does it (input_ids, labels): the engine
    splits the batch itself."""
    model = _llama(kv_heads, attention)
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LLAMA_LR), _config(stage, sizes, extra)
    )
    tiled_loss = (extra or {}).get("tiling", {}).get("loss", False)
    losses = []
    for tokens in _llama_batches():
        out = engine(input_ids=tokens, labels=tokens, attention_mask=torch.ones_like(tokens))
        if tiled_loss:
            assert out.logits is None  # never made whole
        else:
            assert out.logits.shape[1] == SEQ // 2  # this rank's tokens only
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return {"losses": losses, "state": engine.full_state_dict()}


def _llama_reference(
    kv_heads: int, rows: int = BATCH, family: str = ""
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _llama(kv_heads, f"{family}:sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)
    losses = []
    for tokens in _llama_batches(rows):
        opt.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


LLAMA_CASES = {
    "sp2-zero1-sdpa": (1, SP, 2, "sdpa"),
    "sp2-zero2-eager": (2, SP, 2, "eager"),
    "sp2-zero3-sdpa-one-kv-head": (3, SP, 1, "sdpa"),
    "cp2-zero3-sdpa": (3, CP, 2, "sdpa"),
    "cp2-zero1-eager-one-kv-head": (1, CP, 1, "eager"),
    # flex attention cannot run backward on CPU; split, the model's attention calls are ours
    "sp2-zero2-flex": (2, SP, 2, "flex_attention"),
    "sp2-zero3-qwen2": (3, SP, 2, "qwen2:sdpa"),
    # the loss and the MLPs over tiles of 5 of a rank's 16 tokens (a short last tile)
    "sp2-zero3-tiled": (3, SP, 2, "sdpa", {"tiling": {"loss": True, "mlp": True, "tokens": 5}}),
}


@pytest.fixture(scope="module")
def llama_runs() -> dict[str, list[dict[str, Any]]]:
    calls = [(_llama_run, case) for case in LLAMA_CASES.values()]
    return dict(zip(LLAMA_CASES, run_ranks_each(calls, 2), strict=True))


@pytest.mark.parametrize("name", list(LLAMA_CASES))
@pytest.mark.slow
def test_a_transformers_llama_trains_as_one_process_on_the_whole_sequences(
    llama_runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    kv_heads, family = LLAMA_CASES[name][2], LLAMA_CASES[name][3].rpartition(":")[0]
    losses, state = _llama_reference(kv_heads, family=family)
    for rank, r in enumerate(llama_runs[name]):
        assert r["losses"] == pytest.approx(losses, abs=TOL), (rank, r["losses"], losses)
        gaps = {k: (r["state"][k] - v).abs().max().item() for k, v in state.items()}
        worst = max(gaps, key=gaps.__getitem__)
        assert gaps[worst] <= TOL, (rank, worst, gaps[worst])
    initial = _llama(kv_heads, f"{family}:sdpa").state_dict()
    assert max((initial[k] - v).abs().max().item() for k, v in state.items()) > 100 * TOL


# -- bad input ----------------------------------------------------------------------------


def _refusals(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}

    def refused(name: str, config: dict[str, Any], heads: int = 4) -> None:
        model = GPT(GPTConfig(vocab=64, d=8 * heads, layers=1, heads=heads, seq=SEQ))
        engine = None
        try:
            engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), 0.1), config)
            assert engine.sequence is not None
            local = engine.sequence.shard(torch.zeros(1, SEQ, dtype=torch.long))
            engine(local["input_ids"], position_ids=local["position_ids"])
            out[name] = "accepted"
        except ConfigError as e:
            out[name] = f"{e.key}: {e}"
        finally:
            if engine is not None:
                engine.destroy()

    refused("size", {"sequence_parallel_size": 3})
    refused("both", {"sequence_parallel_size": 2, "context_parallel_size": 2})
    refused("heads", {"sequence_parallel_size": 2}, heads=3)
    refused("ring with odd heads", {"context_parallel_size": 2}, heads=3)
    refused("compression", {**SP, "gradient_compression": {"method": "topk"}})
    refused("hierarchical", {**CP, "topology": {"hierarchical": True, "ranks_per_machine": 1}})
    return out


def test_bad_sizes_and_head_counts_are_config_errors_naming_the_key() -> None:
    for out in run_ranks(_refusals, 2):
        assert out["size"].startswith("sequence_parallel_size: "), out
        assert "does not divide the world size 2" in out["size"], out
        assert out["both"].startswith(("sequence_parallel_size: ", "context_parallel_size: "))
        assert "does not divide the world size 2" in out["both"], out
        assert out["heads"].startswith("sequence_parallel_size: "), out
        assert "3 query / 3 key-value heads" in out["heads"], out
        assert "context_parallel_size" in out["heads"], out  # the way out it names
        for name, feature in (("compression", "gradient compression"), ("hierarchical", "topo")):
            assert out[name].startswith("sequence_parallel_size: "), out
            assert f"does not work with {feature}" in out[name], out
        assert out["ring with odd heads"] == "accepted", out  # ring attention needs no split


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _in_pipeline(rank: int, world: int) -> str:
    from ds_strategy.demos.gpt import as_sequential

    model = as_sequential(GPT(GPTConfig(vocab=64, d=32, layers=2, heads=4, seq=SEQ,
                                        tie_embeddings=False)))  # fmt: skip
    config = {"pipeline": {"stages": 2}, "sequence_parallel_size": 2}
    try:
        ds_strategy.initialize(
            model, torch.optim.SGD(model.parameters(), 0.1), config, loss_fn=_token_loss
        )
    except ConfigError as e:
        return f"{e.key}: {e}"
    return "accepted"


def test_sequence_parallelism_inside_a_pipeline_is_refused() -> None:
    for out in run_ranks(_in_pipeline, 2):
        assert out.startswith("sequence_parallel_size: "), out
        assert "pipeline" in out, out


# -- through Accelerate's ParallelismConfig -------------------------------------------------


def _accelerate_run(
    rank: int, world: int, stage: int, sp: int, cp: int, via_env: bool = False
) -> dict[str, Any]:
    """A plain Accelerate loop with ``ParallelismConfig`` (or, ``via_env``, the variables
    ``accelerate launch`` sets from a config file's parallelism section): the loader shards
    over the data-parallel ranks only, the model is called as transformers calls it."""
    import os

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset

    from ds_strategy.accelerate import ZeroAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    data_ranks = world // (sp * cp)
    if via_env:
        os.environ.update(
            ACCELERATE_USE_PARALLELISM_CONFIG="true",
            PARALLELISM_CONFIG_SP_SIZE=str(sp),
            PARALLELISM_CONFIG_CP_SIZE=str(cp),
        )
        parallelism = None
    else:
        parallelism = ParallelismConfig(sp_size=sp, cp_size=cp)
    acc = ZeroAccelerator(config=_config(stage, {}, None), cpu=True, parallelism_config=parallelism)
    model = _llama(2, "sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LLAMA_LR)
    rows = torch.cat(_llama_batches(BATCH * data_ranks))
    loader = DataLoader(TensorDataset(rows), batch_size=BATCH, shuffle=False)
    engine, opt, loader = acc.prepare(model, opt, loader)
    seen, losses = [], []
    for (tokens,) in loader:
        seen.append(tokens.clone())
        loss = engine(input_ids=tokens, labels=tokens).loss
        acc.backward(loss)
        acc.clip_grad_norm_(engine.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"seen": torch.stack(seen), "losses": losses, "state": acc.get_state_dict(engine)}


ACCELERATE_CASES = {
    "sp2-zero3": (2, 3, 2, 1),
    "cp2-zero2": (2, 2, 1, 2),
    "sp2-zero1-from-the-environment": (2, 1, 2, 1, True),
    "sp2-dp2-zero2": (4, 2, 2, 1),
}


@pytest.fixture(scope="module")
def accelerate_runs() -> dict[str, list[dict[str, Any]]]:
    return _runs_by_world(_accelerate_run, ACCELERATE_CASES)


@pytest.mark.parametrize("name", list(ACCELERATE_CASES))
@pytest.mark.slow
def test_zero_accelerator_with_a_parallelism_config_trains_as_one_process(
    accelerate_runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    world, _, sp, cp = ACCELERATE_CASES[name][:4]
    per_batch = sp * cp
    data_ranks = world // per_batch
    losses, state = _llama_reference(2, BATCH * data_ranks)
    runs = accelerate_runs[name]
    for rank, r in enumerate(runs):
        assert len(r["losses"]) == STEPS, rank
        # the ranks of one sequence read the same rows; data-parallel ranks, different ones
        assert torch.equal(r["seen"], runs[rank // per_batch * per_batch]["seen"]), rank
        if data_ranks == 1:
            assert r["losses"] == pytest.approx(losses, abs=TOL), (rank, r["losses"], losses)
        gaps = {k: (r["state"][k] - v).abs().max().item() for k, v in state.items()}
        worst = max(gaps, key=gaps.__getitem__)
        assert gaps[worst] <= TOL, (rank, worst, gaps[worst])
    if data_ranks > 1:
        assert not torch.equal(runs[0]["seen"], runs[per_batch]["seen"])


# -- Lightning and Fabric -----------------------------------------------------------------


def test_lightning_and_fabric_samplers_give_the_ranks_of_a_sequence_the_same_rows() -> None:
    """4 processes, ``sequence_parallel_size=2`` in the strategy's config: 2 data-parallel
    ranks, each read by the 2 consecutive ranks that split its sequences."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from ds_strategy.fabric import ZeroStrategy as FabricZeroStrategy
    from ds_strategy.lightning import ZeroStrategy

    for cls in (ZeroStrategy, FabricZeroStrategy):
        strategy = cls(config={"sequence_parallel_size": 2, "zero_optimization": {"stage": 3}})
        strategy.parallel_devices = [torch.device("cpu")] * 4
        got = []
        for rank in range(4):
            env = LightningEnvironment()
            env.set_world_size(4)
            env.set_global_rank(rank)
            strategy.cluster_environment = env
            got.append(strategy.distributed_sampler_kwargs)
        assert got == [{"num_replicas": 2, "rank": r // 2} for r in range(4)], (cls, got)


# -- checkpoints ----------------------------------------------------------------------------


def _train_split(engine: Any, batches: list[torch.Tensor]) -> None:
    for tokens in batches:
        engine.backward(engine.sequence.next_token_loss(engine, tokens))
        engine.step()


def _reshard(rank: int, world: int, root: str) -> dict[str, Any]:
    """Saved at sequence_parallel_size=2 (ZeRO-2 over both ranks), loaded at 2 data-parallel
    ranks (ZeRO-3) and at context_parallel_size=2, and trained on from each."""
    batches = _batches()
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = ds_strategy.initialize(model, opt, _config(2, SP, None))
    _train_split(engine, batches[:2])
    engine.save_checkpoint(root, tag="sp2")
    saved = engine.full_state_dict()
    _train_split(engine, batches[2:])
    after = engine.full_state_dict()
    engine.destroy()
    out: dict[str, Any] = {}
    for name, sizes, stage in (("dp2", {}, 3), ("cp2", CP, 1)):
        model = _gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        other = ds_strategy.initialize(model, opt, _config(stage, sizes, None))
        other.load_checkpoint(root, tag="sp2")
        loaded = other.full_state_dict()
        if name == "cp2":  # the same sequences again, split the other way
            _train_split(other, batches[2:])
        out[name] = {
            "loaded": max((loaded[k] - v).abs().max().item() for k, v in saved.items()),
            "steps": other.global_steps,
            "after": _weight_gap(other.full_state_dict(), after),
        }
        other.destroy()
    return out


@pytest.mark.slow
def test_a_checkpoint_reshards_to_another_sequence_parallel_degree(tmp_path: Any) -> None:
    for out in run_ranks(_reshard, 2, str(tmp_path / "ckpt")):
        assert out["dp2"]["loaded"] == 0.0 and out["dp2"]["steps"] == 2, out
        assert out["cp2"]["loaded"] == 0.0, out
        assert out["cp2"]["steps"] == 4 and out["cp2"]["after"] <= TOL, out  # resumed exactly
