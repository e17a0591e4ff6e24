"""PEFT (LoRA) under ZeRO, and ``engine.gathered_parameters``, the counterpart of DeepSpeed's
``zero.GatheredParameters`` that PEFT's merge goes through (2 gloo ranks).

The core block first, on ``ToyLM``: full values inside at every stage; values written with a
modifier rank reach the shards and the fp32 masters (only the elements that changed), so an
optimizer step afterwards keeps them; read-only changes are dropped. Then LoRA on a 2-layer
Llama built from a config, with ``stage3_param_persistence_threshold: 0`` so every weight is
sharded: through ``ZeroAccelerator`` at stages 1, 2 and 3 against the same LoRA model trained in
one process on the whole batch (losses, parameter counts, the merged weights and the merged
model saved and reloaded with ``from_pretrained``), and through ``ZeroTrainer`` at stage 3 (a
checkpoint resumed to the same losses, ``save_model`` of the merged model).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from tests.distributed import run_ranks
from tests.models import ToyLM, batches, lm_loss

# -- engine.gathered_parameters ------------------------------------------------------------------

GATHER_CASES = {
    "stage1-bf16": (1, True),
    "stage2-bf16": (2, True),
    "stage3-bf16": (3, True),
    "stage3": (3, False),
}
CHANGED = ("blocks.1.fc1.weight", "frozen_proj.weight")  # trainable in a block; frozen


def _gather_case(rank: int, stage: int, bf16: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ToyLM()
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    # lr 0: the step changes no master, and copies the masters into the compute weights
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), config)
    params = dict(model.named_parameters())
    before = engine.full_state_dict()
    with engine.gathered_parameters():  # read only, every parameter
        inside = {n: p.detach().float().clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(7)
    new = {n: torch.randn(before[n].shape, generator=g) for n in CHANGED}
    with torch.no_grad(), engine.gathered_parameters([params[n] for n in CHANGED], modifier_rank=1):
        for n in CHANGED:  # rank 1's values are the ones kept
            params[n].copy_(new[n] if rank == 1 else torch.full_like(new[n], 9.0))
    after = engine.full_state_dict()
    engine.backward(lm_loss(engine, batches(1, 1, 4, seed=1)[0][rank * 2 : rank * 2 + 2]))
    engine.step()
    with engine.gathered_parameters([params[n] for n in CHANGED]):
        stepped = {n: params[n].detach().float().clone() for n in CHANGED}
    dropped = None
    if stage == 3:
        with torch.no_grad(), engine.gathered_parameters([params[CHANGED[0]]]):
            params[CHANGED[0]].zero_()
        dropped = engine.full_state_dict()[CHANGED[0]]
    engine.destroy()
    dtype = torch.bfloat16 if bf16 else torch.float32
    return {
        "before": before,
        "inside": inside,
        "new": {n: v.to(dtype).float() for n, v in new.items()},
        "after": after,
        "stepped": stepped,
        "dropped": dropped,
        "dtype": dtype,
    }


def _gather_worker(rank: int, world: int) -> dict[str, Any]:
    return {name: _gather_case(rank, *case) for name, case in GATHER_CASES.items()}


@pytest.fixture(scope="module")
def gathered() -> list[dict[str, Any]]:
    return run_ranks(_gather_worker, 2)


@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_gathered_parameters_hold_full_values_and_keep_a_modifier_ranks_writes(
    gathered: list[dict[str, Any]], case: str
) -> None:
    for r in gathered:
        c = r[case]
        before, after = c["before"], c["after"]
        for n, full in c["inside"].items():  # full values, the masters in the compute dtype
            torch.testing.assert_close(full, before[n].to(c["dtype"]).float(), rtol=0, atol=0)
        for n in CHANGED:  # rank 1's values, in the masters and the compute weights after a step
            torch.testing.assert_close(after[n], c["new"][n], rtol=0, atol=0)
            torch.testing.assert_close(c["stepped"][n], c["new"][n], rtol=0, atol=0)
            assert not torch.equal(before[n], after[n])
        for n in before.keys() - set(CHANGED):  # masters of what was not written: untouched
            if n != "head.weight":  # (tied to embed.weight)
                assert torch.equal(before[n], after[n]), n
        if c["dropped"] is not None:  # read only: a write inside is not kept
            torch.testing.assert_close(c["dropped"], c["new"][CHANGED[0]], rtol=0, atol=0)


def test_gathered_parameters_name_what_was_wrong() -> None:
    """In one process (a world of one): a parameter from elsewhere, a rank that does not
    exist, handing over part of a model."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    with pytest.raises(ValueError, match=r"shape \(3,\) is not one of the engine's model"):
        engine.gathered_parameters([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"modifier_rank=1\): expected None .* in 0\.\.0"):
        engine.gathered_parameters(modifier_rank=1)
    with (
        pytest.raises(ValueError, match=r"hand_over\(\) needs the block over every parameter"),
        engine.gathered_parameters([model[0].weight]) as block,
    ):
        block.hand_over()
    engine.destroy()


# -- LoRA on a small Llama ------------------------------------------------------------------------

STEPS = 3


def _lora(base: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapters' initial A
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(base, lora)


def _sharded(stage: int) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _fresh_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _loaded(path: Path, probe: torch.Tensor) -> dict[str, Any]:
    """The merged model saved at ``path`` read back as a plain Llama: what loading reported,
    its weights and its logits on ``probe``."""
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(str(path), output_loading_info=True)
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"missing": info["missing_keys"], "unexpected": info["unexpected_keys"],
            "state": state, "logits": logits}  # fmt: skip


def _plain_merged(ids: torch.Tensor, probe: torch.Tensor) -> dict[str, Any]:
    """The same LoRA model trained in one process on the whole batch, then merged."""
    from tests.hf_scripts.trainer_runs import model

    peft = _lora(model())
    counts = peft.get_nb_trainable_parameters()
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        batch = ids[step]
        loss = peft(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    merged = peft.merge_and_unload()
    with torch.no_grad():
        logits = merged(input_ids=probe).logits
        tokens = merged.generate(input_ids=probe[:, :4], max_new_tokens=3, do_sample=False)
    state = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    return {"losses": losses, "counts": counts, "state": state, "logits": logits,
            "tokens": tokens}  # fmt: skip


def _accelerate_run(rank: int, stage: int, ids: torch.Tensor, probe: torch.Tensor, out: Path):
    import contextlib
    import io

    import torch.distributed as dist

    from ds_strategy.accelerate import ZeroAccelerator
    from tests.hf_scripts.trainer_runs import model

    _fresh_accelerate()
    acc = ZeroAccelerator(config=_sharded(stage), cpu=True)
    peft = _lora(model())
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    engine, opt = acc.prepare(peft, opt)
    losses = []
    for step in range(STEPS):
        half = ids[step][rank * 2 : rank * 2 + 2]
        loss = engine(input_ids=half, labels=half).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / 2)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        printed = _reported(peft.print_trainable_parameters)  # (the error, if it raised)
    result: dict[str, Any] = {"losses": losses, "counts": peft.get_nb_trainable_parameters(),
                              "printed": printed.get("error", shown.getvalue())}  # fmt: skip
    merged = peft.merge_and_unload()  # collective: every rank
    with torch.no_grad():
        result["logits"] = merged(input_ids=probe).logits
        result["tokens"] = merged.generate(
            input_ids=probe[:, :4], max_new_tokens=3, do_sample=False
        )
    result["state"] = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    if rank == 0:
        merged.save_pretrained(str(out))
    dist.barrier()
    result["loaded"] = _loaded(out, probe)
    engine.destroy()
    return result


STAGES = (1, 2, 3)  # LoRA through ZeroAccelerator at each (stage 3: every weight sharded)


def _peft_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (STEPS, 4, 16), generator=g)  # a global batch of 4 per step
    probe = torch.randint(0, 64, (2, 16), generator=g)
    results: dict[str, Any] = {"plain": _plain_merged(ids, probe)}
    for stage in STAGES:
        folder = Path(out) / f"merged{stage}"
        results[f"accelerate{stage}"] = _reported(_accelerate_run, rank, stage, ids, probe, folder)
    results["trainer"] = _reported(_trainer_run, Path(out), probe)
    return results


def _reported(fn: Any, *args: Any) -> dict[str, Any]:
    """``fn``'s result, or the error it raised (on every rank alike), for the test to show."""
    try:
        return fn(*args) or {}
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("peft")
    return run_ranks(_peft_worker, 2, str(out))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _run(result: dict[str, Any], name: str) -> dict[str, Any]:
    run = result[name]
    assert "error" not in run, f"{name}: {run.get('error')}"
    return run


@pytest.mark.slow
def test_lora_at_stages_1_to_3_trains_as_in_one_process_and_counts_the_whole_model(
    lora: list[dict[str, Any]],
) -> None:
    plain = lora[0]["plain"]
    for r, stage in itertools.product(lora, STAGES):
        run = _run(r, f"accelerate{stage}")
        assert run["losses"] == pytest.approx(plain["losses"], rel=1e-5)
        assert run["counts"] == plain["counts"] and run["counts"][0] < run["counts"][1]
        trainable, total = plain["counts"]
        assert f"trainable params: {trainable:,d} || all params: {total:,d}" in run["printed"]


@pytest.mark.slow
def test_merge_and_unload_at_stages_1_to_3_merges_what_training_produced_and_saves_a_llama(
    lora: list[dict[str, Any]],
) -> None:
    from tests.hf_scripts.trainer_runs import model

    plain = lora[0]["plain"]
    pretrained = model().state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (plain["state"][q] - pretrained[q]).abs().max() > 1e-3  # the adapters changed it
    for r, stage in itertools.product(lora, STAGES):
        run = _run(r, f"accelerate{stage}")
        assert _max_diff(run["state"], plain["state"]) <= 1e-5
        torch.testing.assert_close(run["logits"], plain["logits"], atol=1e-4, rtol=1e-4)
        assert torch.equal(run["tokens"], plain["tokens"])  # generates with the full weights
        loaded = run["loaded"]
        assert not loaded["missing"] and not loaded["unexpected"]
        assert _max_diff(loaded["state"], plain["state"]) <= 1e-5
        torch.testing.assert_close(loaded["logits"], plain["logits"], atol=1e-4, rtol=1e-4)


# -- ZeroTrainer: a LoRA checkpoint resumed, the merged model saved ------------------------------


def _trainer(folder: Path, stage: int) -> Any:
    from ds_strategy.hf import ZeroTrainer
    from tests.hf_scripts.trainer_runs import Tokens, arguments, model

    _fresh_accelerate()
    args = arguments(str(folder), max_steps=4, save_strategy="steps", save_steps=2,
                     gradient_accumulation_steps=1, lr_scheduler_type="constant")  # fmt: skip
    return ZeroTrainer(model=_lora(model()), args=args, train_dataset=Tokens(16, 1),
                       config=_sharded(stage))  # fmt: skip


def _losses(trainer: Any, after: int = 0) -> dict[int, float]:
    """The logged loss of each step after ``after`` (a resumed Trainer's history holds the
    checkpoint's steps too)."""
    log = trainer.state.log_history
    return {e["step"]: float(e["loss"]) for e in log if "loss" in e and e["step"] > after}


def _trainer_run(root: Path, probe: torch.Tensor) -> dict[str, Any]:
    import torch.distributed as dist

    whole = _trainer(root / "whole", 3)
    whole.train()
    resumed = _trainer(root / "resumed", 3)
    resumed.train(resume_from_checkpoint=str(root / "whole" / "checkpoint-2"))
    result: dict[str, Any] = {"whole": _losses(whole), "resumed": _losses(resumed, after=2)}
    resumed.save_model(str(root / "adapter"))  # collective; the adapter, as PEFT saves it
    merged = resumed.model.merge_and_unload()
    result["merged"] = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    resumed.save_model(str(root / "saved"))  # collective
    dist.barrier()
    result["loaded"] = _loaded(root / "saved", probe)
    result["adapter"] = str(root / "adapter")
    with torch.no_grad():
        result["logits"] = merged(input_ids=probe).logits
    return result


@pytest.mark.slow
def test_a_stage3_lora_trainer_resumes_and_saves_its_merged_model_for_from_pretrained(
    lora: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    from peft import PeftModel

    from tests.hf_scripts.trainer_runs import model

    run = _run(lora[0], "trainer")
    whole, resumed = run["whole"], run["resumed"]
    assert sorted(whole) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]  # after checkpoint-2
    assert [resumed[3], resumed[4]] == pytest.approx([whole[3], whole[4]], rel=1e-6)
    loaded = run["loaded"]  # save_model after merge_and_unload, read by from_pretrained
    assert not loaded["missing"] and not loaded["unexpected"]
    assert _max_diff(loaded["state"], run["merged"]) <= 1e-6
    torch.testing.assert_close(loaded["logits"], run["logits"], atol=1e-5, rtol=1e-5)
    # the same adapter merged here, in one process, into the pretrained weights
    offline = PeftModel.from_pretrained(model(), run["adapter"]).merge_and_unload()
    assert _max_diff(loaded["state"], offline.state_dict()) <= 1e-6
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (loaded["state"][q] - model().state_dict()[q]).abs().max() > 1e-3
