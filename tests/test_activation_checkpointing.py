"""Activation checkpointing: which modules it chooses, that it keeps fewer activations, and
that every ZeRO stage trains to the same weights with and without it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import ConfigError, UnsupportedConfigWarning
from ds_strategy.config._schema import ActivationCheckpointingConfig
from ds_strategy.core.activation_checkpointing import (
    SavedTensorMeter,
    apply_activation_checkpointing,
    checkpointed_modules,
    remove_activation_checkpointing,
    select_modules,
)
from tests.distributed import run_ranks
from tests.loops import parity_config, train_engine, train_reference
from tests.models import Block, ToyLM, batches, lm_loss

STEPS, ACCUM, GLOBAL_BATCH, CLIP = 3, 2, 8, 0.5


def _cfg(**kw: object) -> ActivationCheckpointingConfig:
    return ActivationCheckpointingConfig(enabled=True, **kw)


def test_blocks_are_the_elements_of_module_lists() -> None:
    model = ToyLM(n_blocks=4)
    assert select_modules(model) == list(model.blocks)
    assert select_modules(model, every=2) == [model.blocks[1], model.blocks[3]]
    linears = [m for b in model.blocks for m in (b.fc1, b.fc2)]
    assert select_modules(model, "type:Lin.*") == [
        *linears,
        model.frozen_proj,
        model.unused,
        model.head,
    ]
    # a match's submodules are not searched: Block's Linear layers are not chosen
    assert select_modules(model, "type:Block|Linear")[:4] == list(model.blocks)


def test_bad_module_choice_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="blocks"):
        select_modules(ToyLM(), "every_block")
    with pytest.raises(ConfigError, match="regular expression"):
        select_modules(ToyLM(), "type:(")
    with pytest.raises(ConfigError, match="chose no module"):
        apply_activation_checkpointing(ToyLM(), _cfg(modules="type:Conv.*"))


def test_unimplemented_deepspeed_keys_warn() -> None:
    with pytest.warns(UnsupportedConfigWarning, match="partition_activations"):
        apply_activation_checkpointing(ToyLM(), _cfg(partition_activations=True))


def test_disabled_changes_nothing_and_remove_restores() -> None:
    model = ToyLM()
    assert apply_activation_checkpointing(model, ActivationCheckpointingConfig()) == []
    assert checkpointed_modules(model) == []
    apply_activation_checkpointing(model, _cfg())
    assert checkpointed_modules(model) == list(model.blocks)
    remove_activation_checkpointing(model)
    assert checkpointed_modules(model) == []


@pytest.mark.parametrize("cpu", [False, True], ids=["device", "cpu_checkpointing"])
def test_same_gradients_fewer_saved_bytes(cpu: bool) -> None:
    torch.manual_seed(0)
    plain = ToyLM(d=32, n_blocks=4)
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, _cfg(cpu_checkpointing=cpu))
    tokens = batches(1, 1, 6, seq=12)[0]
    measured = {}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        with SavedTensorMeter(model) as meter:
            loss = lm_loss(model, tokens)
        loss.backward()
        measured[name] = meter.bytes
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=n)
    # each block keeps only its input instead of LayerNorm/Linear/tanh intermediates
    assert measured["ckpt"] < 0.6 * measured["plain"], measured
    assert plain.state_dict().keys() == ckpt.state_dict().keys()


def test_eval_and_no_grad_run_the_plain_forward() -> None:
    model = ToyLM()
    apply_activation_checkpointing(model, _cfg())
    tokens = batches(1, 1, 2)[0]
    with torch.no_grad(), SavedTensorMeter(model) as meter:
        model(tokens)
    assert meter.bytes == 0


def _train(model: nn.Module, stage: int, ac: bool, data: list, rank: int, world: int) -> dict:
    config = parity_config(stage, ACCUM, CLIP, activation_checkpointing={"enabled": ac})
    engine = train_engine(model, "adamw", config, data, rank, world, STEPS)
    assert (checkpointed_modules(model) == list(model.blocks)) == ac
    out = engine.full_state_dict()
    engine.destroy()
    return out


def _reference(model: nn.Module, data: list) -> dict:
    return train_reference(model, "adamw", data, STEPS, ACCUM, CLIP)


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


class NestedBlock(nn.Module):
    """A block whose MLP is an ``nn.Sequential``: under ZeRO-3 its layers are units of their
    own, inside the checkpointed region, so the recompute runs their gather hooks."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _nested_stage3(ac: bool, rank: int, world: int) -> tuple[dict, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), NestedBlock(8), NestedBlock(8), nn.Linear(8, 3))
    cfg = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": {"enabled": ac, "modules": "type:NestedBlock"},
    }
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    g = torch.Generator().manual_seed(0)
    gathered = 0
    for _ in range(STEPS):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        engine.comm_report()
        engine.backward(nn.functional.mse_loss(engine(x[rank::world]), y[rank::world]))
        gathered += engine.comm_report().get("all_gather", 0)
        engine.step()
    out = engine.full_state_dict()
    engine.destroy()
    return out, gathered


def stages_worker(rank: int, world: int) -> dict:
    data = batches(STEPS, ACCUM, GLOBAL_BATCH)
    torch.manual_seed(0)
    base = ToyLM()
    ref = _reference(copy.deepcopy(base), data)
    out = {"moved": _diff(ref, base.state_dict())}
    for stage in (0, 1, 2, 3):
        plain = _train(copy.deepcopy(base), stage, False, data, rank, world)
        ckpt = _train(copy.deepcopy(base), stage, True, data, rank, world)
        out[stage] = (_diff(ckpt, plain), _diff(ckpt, ref))
    plain, plain_bytes = _nested_stage3(False, rank, world)
    ckpt, ckpt_bytes = _nested_stage3(True, rank, world)
    out["nested"] = (_diff(ckpt, plain), plain_bytes, ckpt_bytes)
    return out


def test_every_zero_stage_trains_the_same_with_checkpointing() -> None:
    results = run_ranks(stages_worker, 2, timeout=240)
    for res in results:
        assert res["moved"] > 1e-2
        for stage in (0, 1, 2, 3):
            vs_plain, vs_ref = res[stage]
            assert vs_plain <= 2e-5, f"stage {stage}: |ckpt - plain| = {vs_plain:.3g}"
            assert vs_ref <= 2e-5, f"stage {stage}: |ckpt - reference| = {vs_ref:.3g}"
        # ZeRO-3 units inside a checkpointed block: same weights, and the recompute reuses
        # the gather that backward needs anyway (no extra all-gather traffic)
        vs_plain, plain_bytes, ckpt_bytes = res["nested"]
        assert vs_plain <= 1e-6
        assert plain_bytes > 0 and ckpt_bytes == plain_bytes, (plain_bytes, ckpt_bytes)


def test_block_checkpointed_module_runs_its_own_hooks_once() -> None:
    # hooks of the checkpointed module itself fire once per forward, not again on recompute
    block = Block(8)
    calls = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    apply_activation_checkpointing(nn.Sequential(block), _cfg())
    block(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert len(calls) == 1
