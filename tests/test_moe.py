"""Mixture of experts: DeepSpeed-MoE's gating worked by hand, its layer, and expert
parallelism composed with ZeRO.

A transformers Mixtral (4 experts, top-2) with ``{"moe": {"ep_size": 2}}`` on 2 ranks trains
at ZeRO-1/2/3 to the losses and weights of one process running both ranks' batches, each
rank holding half of the expert bytes; the demo GPT with DeepSpeed-style ``MoE`` layers does
the same, its ``l_aux`` equal to the one-process value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.core.moe import MoE, capacity, top1, top2, topk
from tests.distributed import run_ranks_each

STEPS, BATCH, SEQ, LR, TOL = 4, 2, 16, 1e-3, 1e-5


# -- gating, worked by hand ------------------------------------------------------------------


def test_top1_capacity_keeps_the_first_tokens_and_weights_by_probability() -> None:
    # 6 tokens, 2 experts, capacity factor 1: ceil(6 / 2 * 1) = 3 tokens an expert
    logits = torch.tensor([[2.0, 0], [1, 0], [0, 3], [4, 0], [5, 0], [0, 1]])
    r = top1(logits, capacity_factor=1.0, min_capacity=1, use_rts=False)
    # expert 0 is chosen by tokens 0, 1, 3, 4: the fourth (token 4) is dropped
    assert r.experts.view(-1).tolist() == [0, 0, 1, 0, -1, 1]
    assert r.exp_counts.tolist() == [4, 2]  # before dropping
    probs = torch.softmax(logits, dim=1)
    expect = [probs[0, 0], probs[1, 0], probs[2, 1], probs[3, 0], 0.0, probs[5, 1]]
    assert r.weights.view(-1).tolist() == pytest.approx([float(x) for x in expect])
    # l_aux = E * sum_e(mean prob_e * fraction of tokens choosing e)
    me, ce = probs.mean(0), torch.tensor([4 / 6, 2 / 6])
    assert float(r.l_aux) == pytest.approx(float(2 * (me * ce).sum()))
    assert capacity(6, 2, 1.0, 4) == 4  # min_capacity is a floor
    kept = top1(logits, 1.0, 4, use_rts=False)
    assert (kept.experts >= 0).all()
    dropless = top1(logits, 1.0, 1, drop_tokens=False)
    assert (dropless.experts >= 0).all()


def test_top2_second_choices_queue_after_every_first_choice() -> None:
    # 4 tokens, 2 experts: capacity ceil(4 / 2 * 2 * 0.5) = 2 an expert
    logits = torch.tensor([[3.0, 1], [2, 1], [1, 2], [3, 0]])
    r = top2(logits, 0.5, 1, second_expert_sampling=False)
    # first choices: expert 0 <- tokens 0, 1, 3 (token 3 dropped: third); expert 1 <- token 2
    # second choices queue after: expert 1 <- tokens 0 (place 1), 1 (place 2: dropped), 3
    assert r.experts.tolist() == [[0, 1], [0, -1], [1, -1], [-1, -1]]
    assert r.exp_counts.tolist() == [4, 4]
    probs = torch.softmax(logits, dim=1)
    assert r.weights[0].tolist() == pytest.approx(probs[0].tolist())  # both kept: renormalised
    assert r.weights[1].tolist() == pytest.approx([1.0, 0.0])  # one kept: weight 1
    me, ce = probs.mean(0), torch.tensor([3 / 4, 1 / 4])
    assert float(r.l_aux) == pytest.approx(float((me * ce).mean() * 4))


def test_topk_drops_by_logit_or_by_position() -> None:
    # top-2 of each row: t0 -> 0, 1; t1 -> 1, 2; t2 -> 0, 2; t3 -> 2, 1
    logits = torch.tensor([[3.0, 2, 0], [1, 4, 2], [5, 0, 1], [0, 1, 6]])
    # 4 tokens, 3 experts, k=2, factor 0.5: ceil(4 / 3 * 0.5 * 2) = 2 tokens an expert
    by_logit = topk(logits, 2, 0.5, 1, drop_policy="probs")
    # expert 1 keeps its two largest logits (t1: 4, t0: 2), dropping t3 (1); expert 2 keeps
    # t3 (6) and t1 (2), dropping t2 (1)
    assert by_logit.experts.tolist() == [[0, 1], [1, 2], [0, -1], [2, -1]]
    by_place = topk(logits, 2, 0.5, 1, drop_policy="position")
    # each expert keeps its first two: expert 1 t0, t1; expert 2 t1, t2; t3 loses both
    assert by_place.experts.tolist() == [[0, 1], [1, 2], [0, 2], [-1, -1]]
    assert by_logit.exp_counts.tolist() == [2, 3, 3]
    probs = torch.softmax(logits, dim=1)
    ce = torch.tensor([2 / 4, 3 / 4, 3 / 4])
    assert float(by_logit.l_aux) == pytest.approx(float((probs.mean(0) * ce).mean() * 9 / 2))
    pair = probs[0, :2] / probs[0, :2].sum()  # both kept: renormalised over the two
    assert by_logit.weights[0].tolist() == pytest.approx(pair.tolist())
    assert by_logit.weights[2].tolist() == pytest.approx([1.0, 0.0])


# -- the DeepSpeed-style layer ---------------------------------------------------------------


def test_the_layer_has_deepspeeds_names_and_returns_its_triple() -> None:
    torch.manual_seed(0)
    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=1, use_residual=True)
    names = [n for n, _ in layer.named_parameters()]
    assert "deepspeed_moe.gate.wg.weight" in names
    assert "deepspeed_moe.experts.deepspeed_experts.3.weight" in names
    assert {"mlp.weight", "coefficient.weight"} <= set(names)
    out, l_aux, counts = layer(torch.randn(2, 5, 8))
    assert out.shape == (2, 5, 8) and l_aux.dim() == 0 and counts.sum() == 10
    with pytest.raises(ValueError, match="not divisible by ep_size=3"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=3)
    spread = MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2)
    assert len(spread.deepspeed_moe.experts.deepspeed_experts) == 2
    with pytest.raises(RuntimeError, match="give the model to ds_strategy.initialize"):
        spread(torch.randn(2, 5, 8))


# -- a transformers Mixtral, experts over 2 ranks --------------------------------------------


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def _batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 128, (2 * BATCH, SEQ), generator=gen) for _ in range(STEPS)]
    return [r[rank * BATCH : (rank + 1) * BATCH] for r in rows]


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )


def _mixtral_run(
    rank: int, world: int, stage: int, extra: dict[str, Any], save: str | None = None
) -> dict[str, Any]:
    model = _mixtral()
    whole = _expert_bytes(model)
    extra = dict(extra)
    zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}
    zero.update(extra.pop("offload", {}))
    config = {"zero_optimization": zero, "gradient_clipping": 1.0, "moe": {"ep_size": 2}, **extra}
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config)
    losses, aux = [], []
    for step, tokens in enumerate(_batches(rank)):
        if save is not None and step == 2:
            engine.save_checkpoint(save, tag="global_step2")
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        aux.append(out.aux_loss.item())
    held = sum(
        t.numel() * t.element_size()
        for g in engine.plan.groups
        if engine.experts is not None and engine.experts.is_expert(g.params[0])
        for t in ([g.master] if g.master is not None else [g.shard])
    )
    return {
        "losses": losses,
        "aux": aux,
        "state": engine.full_state_dict(),
        "whole_expert_bytes": whole,
        "held_expert_bytes": held,
        "memory": engine.memory_report(),
        "comm": engine.comm_report(),
    }


def _mixtral_reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, every expert: each step the mean of both ranks' losses."""
    model = _mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, aux = [], []
    per_rank = [_batches(0), _batches(1)]
    for step in range(STEPS):
        opt.zero_grad()
        outs = [model(input_ids=b[step], labels=b[step]) for b in per_rank]
        loss = sum(o.loss for o in outs) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append([o.loss.item() for o in outs])
        aux.append([o.aux_loss.item() for o in outs])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, aux, state  # type: ignore[return-value]


_CPU = {"device": "cpu"}
MIXTRAL_CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "zero0": (0, {}),
    "zero1": (1, {}),
    "zero2": (2, {}),
    "zero3": (3, {}),
    "zero3-offload": (3, {"offload": {"offload_optimizer": _CPU, "offload_param": _CPU}}),
}
BF16_CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "zero2-bf16": (2, {"bf16": {"enabled": True}}),
    "zero3-bf16": (3, {"bf16": {"enabled": True}}),
}
SAVED = "zero2"  # this case saves a checkpoint before its third step


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("moe") / "ckpt")


@pytest.fixture(scope="module")
def mixtral_runs(saved: str) -> dict[str, list[dict[str, Any]]]:
    cases = {**MIXTRAL_CASES, **BF16_CASES}
    calls = [
        (_mixtral_run, (*case, saved if name == SAVED else None)) for name, case in cases.items()
    ]
    return dict(zip(cases, run_ranks_each(calls, 2), strict=True))


@pytest.mark.parametrize("name", list(MIXTRAL_CASES))
def test_a_transformers_mixtral_trains_expert_parallel_as_one_process(
    mixtral_runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    losses, aux, state = _mixtral_reference()
    for rank, r in enumerate(mixtral_runs[name]):
        mine = [step[rank] for step in losses]
        assert r["losses"] == pytest.approx(mine, abs=TOL), (rank, r["losses"], mine)
        assert r["aux"] == pytest.approx([step[rank] for step in aux], abs=TOL)
        assert set(r["state"]) == set(state)
        gaps = {k: (r["state"][k] - v).abs().max().item() for k, v in state.items()}
        worst = max(gaps, key=gaps.__getitem__)
        assert gaps[worst] <= TOL, (rank, worst, gaps[worst])
        # each rank keeps half the experts (not sharded further: its expert group is itself)
        assert r["held_expert_bytes"] == r["whole_expert_bytes"] // 2, name
        memory, comm = r["memory"], r["comm"]
        if "offload" not in name:  # (offloaded: in host memory, not in the report)
            assert memory["expert_params"] == r["whole_expert_bytes"] // 2
            assert memory["expert_optimizer_state"] >= 2 * memory["expert_params"]  # Adam
            assert memory["optimizer_state"] > memory["expert_optimizer_state"]  # dense too
        # the tokens' exchange, counted apart from the data-parallel group's
        assert comm["ep_expert_all_to_all"] > 0 and comm["total"] > comm["ep_expert_all_to_all"]
    initial = _mixtral().state_dict()
    assert max((initial[k] - v).abs().max().item() for k, v in state.items()) > 100 * TOL


def test_an_expert_parallel_checkpoint_resumes_in_one_process_at_another_stage(
    mixtral_runs: dict[str, list[dict[str, Any]]], saved: str
) -> None:
    """Saved at ep=2 (ZeRO-2, 2 ranks), resumed at ep=1 (ZeRO-3, 1 process accumulating both
    ranks' batches): the run ends where the uninterrupted one does."""
    model = _mixtral()
    config = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2}
    config["gradient_clipping"] = 1.0
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config)
    engine.load_checkpoint(saved)
    assert engine.global_steps == 2
    # consolidated offline, the checkpoint is the model's own file: from_pretrained reads it
    from transformers import MixtralForCausalLM

    from ds_strategy.core.checkpoint.consolidate import consolidate

    out = Path(saved).parent / "pretrained"
    consolidate(saved, out / "model.safetensors")
    model.config.save_pretrained(out)
    loaded = MixtralForCausalLM.from_pretrained(out).state_dict()
    at_step2 = engine.full_state_dict()
    assert set(loaded) == set(at_step2)
    assert all(torch.equal(loaded[k], v) for k, v in at_step2.items())
    for step in range(2, STEPS):
        for rank in range(2):
            tokens = _batches(rank)[step]
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()
    state = engine.full_state_dict()
    uninterrupted = mixtral_runs[SAVED][0]["state"]
    worst = max((state[k] - v).abs().max().item() for k, v in uninterrupted.items())
    assert worst <= TOL, worst


def _pretrained_run(rank: int, world: int, path: str, stage: int) -> dict[str, Any]:
    """A Mixtral built on the meta device, its experts spread, the files read into the shards."""
    from transformers import MixtralForCausalLM

    config = _mixtral().config
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}
    engine = ds_strategy.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        {"zero_optimization": zero, "moe": {"ep_size": 2}},
    )
    loaded = engine.load_weights(path)
    tokens = _batches(rank)[0]
    loss = engine(input_ids=tokens, labels=tokens).loss.item()
    return {"state": engine.full_state_dict(), "loss": loss, "missing": loaded.missing}


@pytest.mark.parametrize("stage", [1, 3])
def test_pretrained_weights_load_into_expert_parallel_shards(tmp_path: Path, stage: int) -> None:
    """The model's own files (every expert in one tensor) read straight into each rank's
    experts, on a model built on the meta device."""
    model = _mixtral()
    model.save_pretrained(tmp_path)
    expect = model.state_dict()
    for rank, r in enumerate(run_ranks_each([(_pretrained_run, (str(tmp_path), stage))], 2)[0]):
        assert not r["missing"]
        assert set(r["state"]) == set(expect)
        assert all(torch.equal(r["state"][k], v) for k, v in expect.items())
        tokens = _batches(rank)[0]
        assert r["loss"] == pytest.approx(
            model(input_ids=tokens, labels=tokens).loss.item(), abs=TOL
        )


# -- the demo GPT with DeepSpeed-style MoE layers ---------------------------------------------

GPT_SIZES = dict(vocab=64, d=32, layers=2, heads=4, seq=SEQ)
GPT_CASES: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    # (stage, the layers' arguments, config): layers built whole, the engine keeps its experts
    "top2-dropless-zero2": (2, {"k": 2, "drop_tokens": False}, {"moe": {"ep_size": 2}}),
    # built with ep_size=2 as a DeepSpeed script does: the engine takes the layers' size;
    # top-1 with a capacity that drops tokens, and Residual MoE
    "top1-capacity-residual-zero3": (
        3,
        {"k": 1, "ep_size": 2, "capacity_factor": 0.5, "use_rts": False, "use_residual": True},
        {},
    ),
    "top2-capacity-zero1": (
        1,
        {"k": 2, "capacity_factor": 0.75, "top2_2nd_expert_sampling": False},
        {"moe": {"ep_size": 2}},
    ),
}


def _moe_gpt(layer_args: dict[str, Any]) -> torch.nn.Module:
    from ds_strategy.demos.gpt import GPTConfig
    from ds_strategy.demos.moe_gpt import MoEGPT

    torch.manual_seed(0)
    return MoEGPT(GPTConfig(**GPT_SIZES), num_experts=4, min_capacity=1, **layer_args)


def _gpt_run(
    rank: int, world: int, stage: int, layer_args: dict[str, Any], config: dict[str, Any]
) -> dict[str, Any]:
    model = _moe_gpt(layer_args)
    zero = {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}
    engine = ds_strategy.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        {"zero_optimization": zero, "gradient_clipping": 1.0, **config},
    )
    losses, l_aux = [], []
    for tokens in _gpt_batches(rank):
        loss = engine.module.loss(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        l_aux.append(engine.module.l_aux().item())
    busiest = max(int(b.moe.deepspeed_moe.exp_counts.max()) for b in engine.module.blocks)
    return {"losses": losses, "l_aux": l_aux, "state": engine.full_state_dict(), "busiest": busiest}


def _gpt_batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 64, (2 * BATCH, SEQ), generator=gen) for _ in range(STEPS)]
    return [r[rank * BATCH : (rank + 1) * BATCH] for r in rows]


def _gpt_reference(layer_args: dict[str, Any]) -> dict[str, Any]:
    """One process holding every expert (``ep_size=1``), each step both ranks' batches."""
    model = _moe_gpt({**layer_args, "ep_size": 1})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, l_aux = [], []
    per_rank = [_gpt_batches(0), _gpt_batches(1)]
    for step in range(STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        mine, aux = [], []
        for batches in per_rank:
            loss = model.loss(batches[step])
            total = total + loss / 2
            mine.append(loss.item())
            aux.append(model.l_aux().item())
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(mine)
        l_aux.append(aux)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "l_aux": l_aux, "state": state}


@pytest.fixture(scope="module")
def gpt_runs() -> dict[str, list[dict[str, Any]]]:
    calls = [(_gpt_run, case) for case in GPT_CASES.values()]
    return dict(zip(GPT_CASES, run_ranks_each(calls, 2), strict=True))


@pytest.mark.parametrize("name", list(GPT_CASES))
def test_the_demo_gpt_with_moe_layers_trains_expert_parallel_as_one_process(
    gpt_runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    ref = _gpt_reference(GPT_CASES[name][1])
    for rank, r in enumerate(gpt_runs[name]):
        assert r["losses"] == pytest.approx([s[rank] for s in ref["losses"]], abs=TOL)
        assert r["l_aux"] == pytest.approx([s[rank] for s in ref["l_aux"]], abs=TOL)
        assert set(r["state"]) == set(ref["state"])  # every expert, under its global index
        gaps = {k: (r["state"][k] - v).abs().max().item() for k, v in ref["state"].items()}
        worst = max(gaps, key=gaps.__getitem__)
        assert gaps[worst] <= TOL, (rank, worst, gaps[worst])
    initial = _moe_gpt({**GPT_CASES[name][1], "ep_size": 1}).state_dict()
    moved = {k: (ref["state"][k] - initial[k]).abs().max().item() for k in ref["state"]}
    assert min(v for k, v in moved.items() if "deepspeed_experts" in k) > 0  # each expert trained
    args = GPT_CASES[name][1]
    if args.get("drop_tokens", True):  # some expert was chosen by more tokens than it took
        k = args["k"]
        cap = capacity(BATCH * SEQ, 4, args["capacity_factor"] * k, 1)
        assert gpt_runs[name][0]["busiest"] > cap


# -- the memory model ---------------------------------------------------------------------------


def test_the_estimate_counts_experts_apart(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_strategy.cli import main
    from ds_strategy.estimate import ModelFacts, estimate, expert_elements

    model = _mixtral()
    per_layer = 4 * (2 * 48 * 32 + 32 * 48)  # gate_up_proj and down_proj of 4 experts
    assert expert_elements(model) == 2 * per_layer
    facts = ModelFacts(params=1000, experts=600)
    whole = estimate(facts, 4, 3, precision="fp32")  # ep 1: experts sharded like the rest
    assert whole.model_state == 16 * 1000 / 4 and whole.experts == 16 * 600 / 4
    split = estimate(facts, 4, 1, precision="bf16", ep_size=4)  # each rank 150, alone
    assert (
        split.experts == (2 + 2 + 12) * 150
        and split.model_state == 2 * 400 + 2 * 400 + 12 * 100 + split.experts
    )
    with pytest.raises(ValueError, match="ep_size=3 must divide"):
        estimate(facts, 4, 3, ep_size=3)
    assert (
        main(["estimate", "--model", f"{__name__}:_mixtral", "--world-size", "4", "--ep-size", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert f"experts: {2 * per_layer / 1e6:.2f}M of the" in out and "over 2 rank(s)" in out


def test_the_start_summary_names_the_expert_ranks_and_bytes() -> None:
    from ds_strategy.config import ZeroOptimizationConfig
    from ds_strategy.core.precision.policy import PrecisionPolicy
    from ds_strategy.core.start_summary import RankCounts, start_summary

    memory = {"params": 100, "grads": 0, "optimizer_state": 0, "total": 100}
    memory |= {"expert_params": 60, "expert_grads": 0, "expert_optimizer_state": 0}
    line = start_summary(
        1, RankCounts(4, 4, ep=2), PrecisionPolicy(), None, ZeroOptimizationConfig(), memory, 1e3
    )
    assert "4 ranks, experts over 2 ranks" in line and "of which experts 60 bytes)" in line


def test_bf16_expert_parallel_trains_as_one_bf16_engine(
    mixtral_runs: dict[str, list[dict[str, Any]]],
) -> None:
    """bf16 on 2 ranks against one bf16 engine holding every expert, accumulating both
    ranks' batches: the same rounding, summed in another order."""
    model = _mixtral()
    config = {
        "zero_optimization": {"stage": 1},
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
    }
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config)
    losses: list[list[float]] = [[], []]
    for step in range(STEPS):
        for rank in range(2):
            tokens = _batches(rank)[step]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            losses[rank].append(loss.item())
    one = engine.full_state_dict()
    initial = _mixtral().state_dict()
    assert max((one[k] - v).abs().max().item() for k, v in initial.items()) > 1e-3
    for name in BF16_CASES:
        for rank, r in enumerate(mixtral_runs[name]):
            assert r["losses"] == pytest.approx(losses[rank], abs=2e-2), (name, rank)
            gaps = torch.cat([(r["state"][k] - v).abs().flatten() for k, v in one.items()])
            # measured: mean 3.2e-5, 0.07% of the weights more than 2e-3 apart
            assert gaps.mean() <= 2e-4, (name, gaps.mean())
            assert (gaps > 2e-3).float().mean() <= 0.01, name
            assert r["held_expert_bytes"] == r["whole_expert_bytes"] // 2  # fp32 masters


# -- bad input ----------------------------------------------------------------------------------


def _refusals(rank: int, world: int) -> dict[str, tuple[str, str]]:
    from ds_strategy.config import ConfigError
    from ds_strategy.demos.gpt import GPT, GPTConfig
    from ds_strategy.demos.moe_gpt import MoEGPT

    c = GPTConfig(vocab=32, d=16, layers=1, heads=2, seq=8)
    cases = {
        "no experts": (GPT(c), {"moe": {"ep_size": 2}}),
        "3 experts": (MoEGPT(c, num_experts=3), {"moe": {"ep_size": 2}}),
        "3 ranks": (MoEGPT(c, num_experts=6), {"moe": {"ep_size": 3}}),
        # 2 ranks sharing each sequence leave 1 data-parallel rank
        "with sequences": (MoEGPT(c), {"moe": {"ep_size": 2}, "sequence_parallel_size": 2}),
    }
    out = {}
    for name, (model, config) in cases.items():
        try:
            ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        except ConfigError as e:
            out[name] = (e.key, str(e))
    return out


def test_bad_expert_layouts_are_refused_naming_the_key() -> None:
    for per_rank in run_ranks_each([(_refusals, ())], 2)[0]:
        assert per_rank.keys() == {"no experts", "3 experts", "3 ranks", "with sequences"}
        assert all(key == "moe.ep_size" for key, _ in per_rank.values()), per_rank
        assert "the model has no expert layer" in per_rank["no experts"][1]
        assert "does not divide the 3 experts" in per_rank["3 experts"][1]
        assert "moe.ep_size=3 does not divide the 2 data-parallel ranks" in per_rank["3 ranks"][1]
        assert "does not divide the 1 data-parallel ranks" in per_rank["with sequences"][1]


# -- DeepSpeed-MoE's own checkpoints ------------------------------------------------------------

DS_DATA = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"


def _ds_fixture() -> Any:
    """``make_moe_fixture.py``: the network DeepSpeed trained, its config and batches."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_moe_fixture", DS_DATA / "make_moe_fixture.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ds_moe_resume(rank: int, world: int, ep_size: int, stage: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's ep_size=2 ZeRO-2 checkpoint resumed here, its 3 more steps taken."""
    from safetensors.torch import load_file

    from ds_strategy.moe import MoE, split_params_into_different_moe_groups_for_optimizer

    f = _ds_fixture()
    net = f.model(MoE, ep_size)
    groups = [{"params": list(net.parameters()), "name": "params"}]
    opt = torch.optim.AdamW(split_params_into_different_moe_groups_for_optimizer(groups), lr=f.LR)
    config = {**f.CONFIG, "zero_optimization": {"stage": stage, "reduce_bucket_size": 64}}
    config["gradient_accumulation_steps"] = f.WORLD // world  # the same global batch
    engine = ds_strategy.initialize(net, opt, config)
    engine.load_checkpoint(DS_DATA / "moe_s2" / "ckpt")
    assert engine.global_steps == f.STEPS
    data = load_file(DS_DATA / "moe_s2" / "batches.safetensors")
    mine = [rank] if world == f.WORLD else list(range(f.WORLD))
    for step in range(f.STEPS, f.STEPS + f.MORE):
        for r in mine:
            rows = slice(r * f.MICRO, (r + 1) * f.MICRO)
            x, y = data["moe_inputs"][step, rows], data["moe_targets"][step, rows]
            engine.backward(f.loss_of(engine, x, y))
            engine.step()
    return engine.full_state_dict()


def test_a_deepspeed_moe_checkpoint_reads_and_resumes_at_any_ep_size(tmp_path: Path) -> None:
    """DeepSpeed's own MoE checkpoint (ZeRO-2, ep_size=2, its experts' partitions over the
    expert-data groups): every expert read under its global index equals DeepSpeed's
    weights, and so does the consolidated file; resumed at ep_size=2 on 2 ranks (ZeRO-1) and
    at ep_size=1 in one process (ZeRO-3), 3 more steps end where DeepSpeed's own
    continuation does."""
    from safetensors.torch import load_file

    from ds_strategy.core.checkpoint.deepspeed.opening import open_deepspeed

    saved = load_file(DS_DATA / "moe_s2" / "consolidated.safetensors")
    ckpt = open_deepspeed(DS_DATA / "moe_s2" / "ckpt" / "global_step4")
    assert set(ckpt.shapes) == set(saved)  # every expert, under its global index
    assert all(torch.equal(ckpt.full(k), v) for k, v in saved.items())
    from ds_strategy.core.checkpoint.consolidate import consolidate

    out = consolidate(DS_DATA / "moe_s2" / "ckpt", tmp_path / "moe.safetensors")
    written = load_file(out)
    assert set(written) == set(saved) and all(torch.equal(written[k], v) for k, v in saved.items())
    continued = load_file(DS_DATA / "moe_s2" / "continued.safetensors")
    runs = run_ranks_each([(_ds_moe_resume, (2, 1))], 2)[0]
    runs.append(_ds_moe_resume(0, 1, 1, 3))
    for state in runs:
        assert set(state) == set(continued)
        worst = max((state[k] - v).abs().max().item() for k, v in continued.items())
        assert worst <= 2e-5, worst
    moved = max((continued[k] - v).abs().max().item() for k, v in saved.items())
    assert moved > 100 * 2e-5  # the 3 steps moved the weights


# -- a front end --------------------------------------------------------------------------------


def _accelerate_run(rank: int, world: int) -> dict[str, Any]:
    """A plain Accelerate loop on ZeroAccelerator, the config spreading the experts."""
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset

    from ds_strategy.accelerate import ZeroAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = {"zero_optimization": {"stage": 2}, "moe": {"ep_size": 2}}
    acc = ZeroAccelerator(config=config, cpu=True)
    model = _mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # rank 0's batch then rank 1's, step by step: the loader deals them out in turn
    per_rank = [_batches(0), _batches(1)]
    rows = torch.cat([b[step] for step in range(STEPS) for b in per_rank])
    loader = DataLoader(TensorDataset(rows), batch_size=BATCH, shuffle=False)
    engine, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    for (tokens,) in loader:
        loss = engine(input_ids=tokens, labels=tokens).loss
        acc.backward(loss)
        acc.clip_grad_norm_(engine.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": acc.get_state_dict(engine)}


def test_zero_accelerator_spreads_a_mixtrals_experts_from_the_config() -> None:
    """``ZeroAccelerator`` with ``moe.ep_size=2``: each rank reads its own batches and the
    run ends where one process on both ranks' batches ends."""
    losses, _, state = _mixtral_reference()
    for rank, r in enumerate(run_ranks_each([(_accelerate_run, ())], 2)[0]):
        assert r["losses"] == pytest.approx([s[rank] for s in losses], abs=TOL)
        worst = max((r["state"][k] - v).abs().max().item() for k, v in state.items())
        assert worst <= TOL, (rank, worst)
