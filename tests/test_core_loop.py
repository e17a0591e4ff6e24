"""What a loop asks of its engines, checked in one process without a framework: a
``clip_grad_norm_`` request (core.loop), each optimizer paired with its model (core.several),
which engines one backward of several models reaches, the optimizer and lr schedule an engine
builds (core.optimizers), and a pipeline loader's batch arithmetic (core.pipeline.mesh)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import load_config
from ds_strategy.core.loop import clipped_engine
from ds_strategy.core.optimizers import engine_schedule, optimizer_to_shard
from ds_strategy.core.pipeline.mesh import loader_micro_batch
from ds_strategy.core.several import (
    PendingSteps,
    backward_of_models,
    pair_optimizers,
    param_groups,
)


def _engines(*modules: nn.Module) -> list[SimpleNamespace]:
    return [SimpleNamespace(module=m) for m in modules]  # what clipped_engine reads


def test_clip_request_names_the_engine_of_the_model_given() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    engines = _engines(a, b)
    assert clipped_engine(engines, a.parameters(), 1.0, 2) == 0
    assert clipped_engine(engines, b.parameters(), 1.0, 2.0) == 1
    b.bias.requires_grad_(False)  # frozen parameters may be left out
    assert clipped_engine(engines, [b.weight], 0.5, 2) == 1


def test_clip_request_refuses_what_zero_cannot_clip() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    engines = _engines(a, b)
    with pytest.raises(ValueError, match="L2 norm only"):
        clipped_engine(engines, a.parameters(), 1.0, 1)
    with pytest.raises(ValueError, match=r"max_norm=0.0\): must be > 0"):
        clipped_engine(engines, a.parameters(), 0.0, 2)
    with pytest.raises(ValueError, match="all the model's gradients"):
        clipped_engine(engines, [a.weight], 1.0, 2)  # a subset
    with pytest.raises(ValueError, match="all the model's gradients"):
        clipped_engine(engines, [a.weight, b.bias], 1.0, 2)  # two models' parameters
    with pytest.raises(ValueError, match="all the model's gradients"):
        clipped_engine(engines, [nn.Parameter(torch.zeros(1))], 1.0, 2)  # no engine's


def test_each_optimizer_pairs_with_the_model_holding_its_parameters() -> None:
    a, b, frozen = nn.Linear(2, 2), nn.Linear(2, 3), nn.Linear(3, 1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    groups = [{"params": [a.weight]}, {"params": [a.bias], "lr": 0.5}]
    stand_in = SimpleNamespace(params=groups)  # a DummyOptim over param groups
    assert pair_optimizers([a, b, frozen], [opt_b, stand_in]) == [1, 0, None]
    assert param_groups(stand_in) == groups
    assert param_groups(SimpleNamespace(params=[a.weight])) == [{"params": [a.weight]}]
    assert param_groups(opt_b) is opt_b.param_groups


def test_pairing_refuses_an_optimizer_over_several_models_or_two_over_one() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    both = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"SGD holds parameters of 2 of them\)"):
        pair_optimizers([a, b], [both])
    outside = torch.optim.SGD([a.weight, nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="1 of them and of none"):
        pair_optimizers([a, b], [outside], call="setup()")
    twice = [torch.optim.SGD([a.weight], lr=0.1), torch.optim.SGD([a.bias], lr=0.1)]
    with pytest.raises(ValueError, match=r"two optimizers over one model \(Linear\): under Fab"):
        pair_optimizers([a, b], twice, front="Fabric")


class _StandIn:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params


def test_the_optimizer_to_shard_is_the_sections_or_the_loops_never_both() -> None:
    params = list(nn.Linear(2, 2).parameters())
    section = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}).optimizer
    built = optimizer_to_shard(section, _StandIn(params), _StandIn, "pkg.StandIn", "prepare()")
    assert isinstance(built, torch.optim.AdamW) and built.param_groups[0]["params"] == params
    own = torch.optim.SGD(params, lr=0.1)
    assert optimizer_to_shard(None, own, _StandIn, "pkg.StandIn", "prepare()") is own
    with pytest.raises(ValueError, match=r"pkg.StandIn needs an 'optimizer' section.*to go\(\)"):
        optimizer_to_shard(None, _StandIn(params), _StandIn, "pkg.StandIn", "go()")
    with pytest.raises(ValueError, match=r"\(AdamW\) and a SGD.*pass pkg.StandIn\(model"):
        optimizer_to_shard(section, own, _StandIn, "pkg.StandIn", "prepare()")


def test_the_engine_schedule_is_the_sections_or_the_callable_never_both() -> None:
    section = load_config({"scheduler": {"type": "WarmupLR", "params": {}}}).scheduler
    stand_in, make = object(), lambda opt: None
    assert engine_schedule(section, stand_in, None, "Dummy") is None  # step counts only
    assert engine_schedule(None, stand_in, make, "Dummy") is make
    assert engine_schedule(None, None, None, "Dummy") is None
    with pytest.raises(ValueError, match=r"\(WarmupLR\) and Dummy\(lr_scheduler_callable"):
        engine_schedule(section, stand_in, make, "Dummy")
    with pytest.raises(ValueError, match="Dummy without lr_scheduler_callable needs"):
        engine_schedule(None, stand_in, None, "Dummy")


def test_a_pipeline_loader_batch_is_accumulation_micro_batches() -> None:
    assert loader_micro_batch(12, 3) == 4
    assert loader_micro_batch(12, 3, micro=4) == 4
    with pytest.raises(ValueError, match="does not divide into gradient_accumulation_steps=5"):
        loader_micro_batch(12, 5)
    with pytest.raises(ValueError, match=r"= 6; use batch_size=6"):
        loader_micro_batch(12, 3, micro=2)


def _two_models(config: dict) -> tuple[Any, Any]:
    engines = []
    for size in (3, 1):
        model = nn.Linear(3, size)
        engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        engine.keep_foreign_grads = True  # as a loop of several models sets it
        engines.append(engine)
    return engines[0], engines[1]


def test_a_backward_of_several_models_says_which_engines_it_reached() -> None:
    gen, disc = _two_models({})
    x = torch.randn(4, 3)
    loss = disc(gen(x).detach()).square().mean()  # the discriminator's step
    assert backward_of_models(loss, [disc, gen], boundary=False) == [True, False]
    assert not disc.is_gradient_accumulation_boundary()
    loss = disc(gen(x)).square().mean()  # the generator's, through the discriminator
    assert backward_of_models(loss, [disc, gen], boundary=True) == [True, True]
    assert gen.is_gradient_accumulation_boundary() and disc.is_gradient_accumulation_boundary()


def test_under_fp16_a_backward_must_reach_one_model() -> None:
    gen, disc = _two_models({"fp16": {"enabled": True}})
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="under fp16 this backward reaches 2 of the prepared"):
        backward_of_models(disc(gen(x)).float().square().mean(), [gen, disc], boundary=True)
    loss = disc(gen(x).detach()).float().square().mean()
    assert backward_of_models(loss, [gen, disc], boundary=True) == [False, True]


def test_a_loop_deciding_its_boundaries_steps_the_engines_it_reached() -> None:
    gen, disc = _two_models({})
    steps = PendingSteps([disc, gen])
    x = torch.randn(4, 3)
    steps.backward(disc(gen(x).detach()).square().mean(), boundary=False, accumulation_steps=2)
    assert steps.step(disc, boundary=False) is None and disc.global_steps == 0  # a micro-step
    with pytest.raises(RuntimeError, match="^not reduced yet$"):
        steps.clip(disc.module.parameters(), 1.0, 2, "not reduced yet")
    steps.backward(disc(gen(x)).square().mean(), boundary=True, accumulation_steps=2)
    assert steps.pending == {disc: True, gen: True}  # the generator's loss reached both
    before = [p.detach().clone() for p in gen.module.parameters()]
    norm = steps.clip(gen.module.parameters(), 1e-3, 2, "not reduced yet")
    assert norm > 1e-3
    assert steps.step(gen, boundary=True) is False and gen.global_steps == 1
    assert gen.get_global_grad_norm() == pytest.approx(norm)
    assert any(not torch.equal(b, p) for b, p in zip(before, gen.module.parameters(), strict=True))
    assert steps.step(gen, boundary=True) is None  # its step ran: nothing pending
    assert steps.pending == {disc: True, gen: False}
    steps.forget()
    assert steps.step(disc, boundary=True) is None and disc.global_steps == 0
