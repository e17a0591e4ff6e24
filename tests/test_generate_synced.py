"""``generate()`` on a model the engines shard keeps the ranks in step (``core/generation.py``).

A tiny transformers Llama under ZeRO-3 with every weight sharded (persistence threshold 0), on
2 ranks whose prompts stop at different lengths: rank 0's first greedy token is the
end-of-sequence token, rank 1 runs to ``max_new_tokens``. Without ``synced_gpus`` the finished
rank stops calling forward and its peer waits in an all-gather; the short process-group timeout
turns that hang into a failure in seconds.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from tests.distributed import run_ranks, run_ranks_each

pytest.importorskip("transformers")

VOCAB, PROMPT, NEW = 64, 6, 8
HANG = dict(timeout=90, pg_timeout=10)  # a hang fails in seconds, not at the default 60 s


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every weight sharded, gathered
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": 2}


def _greedy(model: nn.Module, prompt: torch.Tensor, **kwargs: Any) -> list[int]:
    out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, **kwargs)
    return out[0].tolist()


def _prompts_and_eos(plain: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank 0's prompt, rank 1's, and an end-of-sequence id: the first token greedy decoding
    gives rank 0, which rank 1's greedy decoding never produces (the same on every rank)."""
    prompts = [
        torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(s))
        for s in range(16)
    ]
    new = [_greedy(plain, p)[PROMPT:] for p in prompts]
    for i, first in enumerate(new):
        for j, other in enumerate(new):
            if first[0] not in other:
                return prompts[i], prompts[j], first[0]
    raise AssertionError("no pair of prompts stops at different lengths")


def _train_one_step(engine: Any, rank: int) -> None:
    batch = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    engine.step()


def _plain_copy(engine: Any, prefix: str) -> nn.Module:
    """The engine's trained weights in an unsharded Llama."""
    plain = _llama()
    state = engine.full_state_dict()
    plain.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()})
    return plain.eval()


class Holder(nn.Module):
    """A module holding the Llama as an attribute, as a LightningModule does; its forward
    generates when asked, as Lightning runs ``validation_step`` inside the wrapped forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, generate: bool = False, **kwargs: Any) -> Any:
        if generate:
            return self.model.generate(**kwargs)
        return self.model(**kwargs)


def different_lengths_worker(rank: int, world: int, wrapped: bool) -> dict[str, Any]:
    """One ZeRO-3 step, then ``generate`` on the module the user holds (the Llama itself, or
    inside a container as a LightningModule holds it) with prompts that stop apart."""
    model = _llama()
    holder = Holder(model) if wrapped else model
    engine = ds_strategy.initialize(holder, lambda ps: torch.optim.SGD(ps, lr=0.5), _config(3))
    _train_one_step(engine, rank)
    plain = _plain_copy(engine, "model." if wrapped else "")
    first, second, eos = _prompts_and_eos(plain)
    prompt = first if rank == 0 else second
    expected = _greedy(plain, prompt, eos_token_id=eos)
    holder.eval()
    if wrapped:
        kwargs = dict(input_ids=prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
        got = holder(generate=True, **kwargs)[0].tolist()
    else:
        got = _greedy(model, prompt, eos_token_id=eos)
    return {"got": got, "expected": expected, "eos": eos}


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "module-holding-it"])
def test_zero3_generate_finishes_when_ranks_stop_at_different_lengths(wrapped: bool) -> None:
    """Called on every rank without ``synced_gpus``, the rank that meets EOS first keeps
    gathering for the other: both finish, each with the plain model's greedy tokens."""
    res = run_ranks(different_lengths_worker, 2, wrapped, **HANG)
    for r in res:
        assert r["got"] == r["expected"]
    assert res[0]["got"] == [*res[0]["got"][:PROMPT], res[0]["eos"]]  # stopped at once
    assert len(res[1]["got"]) == PROMPT + NEW and res[1]["eos"] not in res[1]["got"][PROMPT:]


def _watch_synced(model: nn.Module) -> list[bool]:
    """What each decoding loop of ``model.generate`` ran with: transformers' loops ask
    ``_has_unfinished_sequences(done, synced_gpus, ...)`` every token; a per-instance spy on it
    records the value that reached the loop."""
    seen: list[bool] = []
    ask = model._has_unfinished_sequences

    def spy(done: bool, synced_gpus: bool, **kwargs: Any) -> bool:
        if not seen or seen[-1] is not synced_gpus:
            seen.append(synced_gpus)
        return ask(done, synced_gpus, **kwargs)

    model._has_unfinished_sequences = spy  # type: ignore[method-assign]
    return seen


def synced_by_stage_worker(rank: int, world: int, stage: int) -> list[bool]:
    """The ``synced_gpus`` generate's loop runs with at ``stage``, by default; same-length
    prompts on both ranks (no EOS), so no choice can hang."""
    model = _llama()
    ds_strategy.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), _config(stage))
    seen = _watch_synced(model.eval())
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(rank))
    _greedy(model, prompt)
    return seen


def test_only_a_sharded_forward_turns_synced_gpus_on() -> None:
    """Stages 1 and 2 run no collective in forward: generate keeps transformers' default
    (off, no all-reduce per token). Stage 3 gathers in every forward: on."""
    stages = (1, 2, 3)
    res = run_ranks_each([(synced_by_stage_worker, (s,)) for s in stages], 2, timeout=90)
    assert {s: r for s, r in zip(stages, res, strict=True)} == {
        1: [[False], [False]],
        2: [[False], [False]],
        3: [[True], [True]],
    }


def explicit_worker(rank: int, world: int) -> dict[str, list[bool]]:
    model = _llama()
    ds_strategy.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), _config(3))
    seen = _watch_synced(model.eval())
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(rank))
    runs = {}
    for name, kwargs in {
        "default": {},
        "None": {"synced_gpus": None},  # transformers' "decide": decided as for DeepSpeed
        "False": {"synced_gpus": False},
        "True": {"synced_gpus": True},
    }.items():
        seen.clear()
        _greedy(model, prompt, **kwargs)
        runs[name] = list(seen)
    # positionally, as GenerationMixin.generate's sixth argument
    seen.clear()
    model.generate(prompt, None, None, None, None, False, max_new_tokens=2, do_sample=False)
    runs["positional False"] = list(seen)
    return runs


def test_an_explicit_synced_gpus_is_passed_through() -> None:
    """``synced_gpus=False`` given by the caller reaches the loop as given (it hangs if the
    ranks stop apart); None and no argument mean on."""
    for runs in run_ranks(explicit_worker, 2, **HANG):
        assert runs == {
            "default": [True],
            "None": [True],
            "False": [False],
            "True": [True],
            "positional False": [False],
        }


def inference_worker(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-Inference: ``engine.module.generate`` (not the engine's own ``generate``, which
    passes ``synced_gpus`` itself) with prompts that stop apart."""
    plain = _llama().eval()
    first, second, eos = _prompts_and_eos(plain)
    prompt = first if rank == 0 else second
    expected = _greedy(plain, prompt, eos_token_id=eos)
    engine = ds_strategy.init_inference(copy.deepcopy(plain), _config(3))
    got = _greedy(engine.module, prompt, eos_token_id=eos)
    return {"got": got, "expected": expected}


def test_zero_inference_module_generate_finishes_when_ranks_stop_apart() -> None:
    res = run_ranks(inference_worker, 2, **HANG)
    for r in res:
        assert r["got"] == r["expected"]
    assert len(res[0]["got"]) == PROMPT + 1 and len(res[1]["got"]) == PROMPT + NEW


class Generating(nn.Module):
    """A module with a ``generate`` of transformers' contract: ``synced_gpus`` after the
    input, None meaning "decide"."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def generate(self, inputs: Any = None, synced_gpus: bool | None = None) -> Any:
        return self, synced_gpus


class NoSync(nn.Module):
    def generate(self, inputs: Any = None, **kwargs: Any) -> Any:  # no synced_gpus parameter
        return kwargs


def test_sync_generation_changes_each_instance_that_accepts_synced_gpus() -> None:
    """One process: which modules change, what their ``generate`` passes on, and that the
    class, a second call, a copy and a single rank are as they should be."""
    from ds_strategy.core.generation import sync_generation

    outer = nn.ModuleDict({"lm": Generating(), "other": NoSync()})
    assert sync_generation(outer["lm"], collective_forward=True, world_size=1) == []
    assert sync_generation(outer, collective_forward=False, world_size=2) == []
    assert outer["lm"].generate(1) == (outer["lm"], None)  # unchanged so far
    assert sync_generation(outer, collective_forward=True, world_size=2) == ["lm"]
    assert sync_generation(outer, collective_forward=True, world_size=2) == []  # once only
    lm = outer["lm"]
    assert lm.generate(1) == (lm, True)
    assert lm.generate(1, None) == (lm, True)
    assert lm.generate(1, False) == (lm, False)  # positional, as given
    assert lm.generate(1, synced_gpus=False) == (lm, False)
    assert outer["other"].generate(1) == {}  # no synced_gpus parameter: left alone
    fresh = Generating()
    assert fresh.generate(1)[1] is None  # the class is not patched
    copied = copy.deepcopy(lm)
    assert copied.generate(1) == (copied, True)  # runs on the copy, still synced


def lightning_worker(rank: int, world: int) -> dict[str, Any]:
    """``Trainer(strategy="zero3")`` on the pool's ranks: a LightningModule holding the Llama
    generates in ``validation_step``, with prompts that stop apart."""
    import os

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from ds_strategy.lightning import ZeroStrategy

    # the ranks exist already: Lightning joins their process group and starts none
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    plain = _llama().eval()
    first, second, eos = _prompts_and_eos(plain)
    prompt = first if rank == 0 else second

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama()
            self.got: list[int] = []

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def validation_step(self, batch: Any, i: int) -> None:
            self.got = _greedy(self.model, prompt, eos_token_id=eos)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)  # the plain model's tokens

    data = DataLoader(TensorDataset(torch.randint(1, VOCAB, (4, 10))), batch_size=2)
    module = Module()
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=3, config=_config(3)),
        accelerator="cpu",
        devices=world,
        max_steps=1,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data, data)
    return {"got": module.got, "expected": _greedy(plain, prompt, eos_token_id=eos)}


@pytest.mark.slow  # Lightning's import and Trainer set-up on both ranks
def test_lightning_validation_step_generates_when_ranks_stop_apart() -> None:
    pytest.importorskip("lightning")
    res = run_ranks(lightning_worker, 2, **HANG)
    for r in res:
        assert r["got"] == r["expected"]
    assert len(res[0]["got"]) == PROMPT + 1 and len(res[1]["got"]) == PROMPT + NEW
