"""The engines of one job (core.job.JobEngines), on one process without a framework: which
engine a call is for, backward routed to an engine or to a model's several engines, a clip
request at a boundary or waiting for the step, and the engines a checkpoint's state names."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.job import JobEngines
from ds_strategy.core.several import SeveralEngines, holds_gradients

CONFIG: dict[str, Any] = {"zero_optimization": {"stage": 2}}


def _engine(out: int = 1, **config: Any) -> Any:
    model = nn.Linear(3, out)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return ds_strategy.initialize(model, optimizer, {**CONFIG, **config})


class _Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen, self.disc = nn.Linear(3, 3), nn.Linear(3, 1)


def _several() -> SeveralEngines:
    gan = _Gan()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (gan.gen, gan.disc)]
    return SeveralEngines(gan, opts, lambda part, opt: ds_strategy.initialize(part, opt, CONFIG))


def test_a_call_names_its_engine_by_model_or_optimizer_unless_one_is_set_up() -> None:
    job = JobEngines("set a model up first", "pass model=")
    with pytest.raises(RuntimeError, match="set a model up first"):
        job.engine_of()
    a = job.add(_engine())
    assert job.engine_of() is a and job.engine_of(optimizer=object()) is a  # the only one
    b = job.add(_engine())
    assert job.engines == job.trained == [a, b]
    assert job.engine_of(b) is b and job.engine_of(optimizer=b.optimizer) is b
    assert job.engine_of(SimpleNamespace(_orig_mod=b)) is b  # torch.compile(engine)
    assert job.engine_of(optimizer=SimpleNamespace(optimizer=a.optimizer)) is a  # a wrapper
    with pytest.raises(ValueError, match="2 engines are set up .* none of them.*: pass model="):
        job.engine_of(nn.Linear(3, 1))
    job.destroy()
    assert job.engines == [] and job.clips == {}


def test_a_clip_at_a_boundary_clips_now_and_before_one_waits_for_the_step() -> None:
    job = JobEngines("none", "which")
    engine = job.add(_engine(gradient_accumulation_steps=2))
    weight = engine.module.weight
    x = torch.randn(4, 3)
    job.backward(engine(x).square().mean())
    assert job.clip(1e-3) is None and job.clips[engine].max_norm == 1e-3  # not a boundary
    assert job.step(engine.optimizer) is False
    job.backward(engine(x).square().mean())
    before = weight.detach().clone()
    assert job.clip(1e-3, wait=True) is None  # the loop clips right before its step
    assert job.step(engine.optimizer) is True and job.clips[engine].max_norm is None
    moved = (weight.detach() - before).norm().item()
    assert 0 < moved <= 0.1 * 1e-3 * 1.001  # lr x the clipped norm: the waiting clip ran
    job.backward(engine(x).square().mean())
    job.step(engine.optimizer)
    job.backward(engine(x).square().mean())
    norm = job.clip(1e-3, module=engine)  # at a boundary: now, the norm before clipping
    assert norm is not None and norm > 1e-3 and job.clips[engine].max_norm is None


def test_a_model_with_several_optimizers_takes_its_backward_and_checkpoint_names() -> None:
    job = JobEngines("none", "which")
    several = job.add(_several())
    assert job.several_of() is several and job.several_of(several.module) is several
    assert job.several_of(SimpleNamespace(_orig_mod=several.module)) is several
    gen, disc = several.trained
    assert job.engine_of(optimizer=disc.optimizer) is disc
    gan, x = several.module, torch.randn(4, 3)
    job.backward(gan.disc(gan.gen(x).detach()).square().mean(), module=gan)
    assert holds_gradients(disc) and not holds_gradients(gen)  # the several's backward ran it
    other = job.add(_engine())
    assert job.several_of() is None and job.several_of(gan) is several  # two set-ups now
    assert job.engines == [gen, disc, other] and job.trained == [gen, disc, other]
    state = {"gan": gan, "opt_d": disc.optimizer, "critic": other, "step": 3}
    named, rest = job.named(state)
    assert named == {"gan.optimizer_0": gen, "gan.optimizer_1": disc, "critic": other}
    assert rest == ["step"]
    assert job.named({"step": 3, "none": None}) == ({}, ["step", "none"])
    job.destroy()
    assert several.engines == {} and job.setups == []
