"""Engine assembly (core/assembly.py): the builder returns an engine's named parts, each from
the resolved config, and the engine is those parts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.assembly import EngineBuilder, EngineParts, LoopHooks
from ds_strategy.core.collectives import Comm


def _hooks() -> LoopHooks:
    return LoopHooks(
        reduce_every_backward=lambda: True,
        reduce_at_boundary=lambda: True,
        loss_scale=lambda: 1.0,
        global_steps=lambda: 0,
        steps_taken=lambda: 0,
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_the_builder_returns_every_part_built_from_the_resolved_config() -> None:
    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
        "gradient_compression": {"method": "none"},
        "wall_clock_breakdown": True,
    }
    model = _model()
    builder = EngineBuilder(
        model, config, Comm(None), process_group=None, pipeline_stage=None, loop=_hooks()
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parts = builder.build(opt, None, None)
    try:
        names = [f.name for f in dataclasses.fields(EngineParts)]
        for part in ("plan", "optimizer", "offload", "precision", "compression", "timers"):
            assert part in names
        assert "checkpoint" in names
        assert parts.config.zero_optimization.stage == 3
        assert parts.precision.policy.param_dtype == torch.bfloat16
        assert parts.precision.scaler is None  # bf16: no loss scaling
        assert parts.timers is not None  # wall_clock_breakdown
        assert parts.offload is None and parts.compression is None
        assert parts.plan.groups and parts.optimizer.trainable
        assert parts.optimizer.sharded.pieces  # the optimizer over this rank's shards
        assert parts.checkpoint.comm is parts.ranks.comm and parts.checkpoint.stage is None
    finally:
        parts.plan.remove_hooks()


def test_the_engine_installs_the_parts_under_the_names_it_always_had() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ds_strategy.initialize(model, opt, {"zero_optimization": {"stage": 2}})
    try:
        assert engine.stage == 2 and engine.config.zero_optimization.stage == 2
        assert engine.optimizer is not opt  # rebuilt over this rank's shards
        assert engine.plan.groups and engine.timers is None
        loss = engine(torch.randn(2, 8)).square().mean()
        engine.backward(loss)
        engine.step()
        assert engine.global_steps == 1
    finally:
        engine.destroy()


def test_a_builder_refusal_is_raised_before_any_part_exists() -> None:
    """The rule table runs as the builder reaches each point: an optimizer offload at stage 0
    (nothing sharded to offload) is refused naming the key before a group is built."""
    model = _model()
    config = {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ds_strategy.ConfigError, match="offload_optimizer"):
        EngineBuilder(
            model, config, Comm(None), process_group=None, pipeline_stage=None, loop=_hooks()
        ).build(torch.optim.SGD(model.parameters(), lr=0.1), None, None)
