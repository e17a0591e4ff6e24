"""Single-process tests of the pure logic: shard ranges, buckets, unit planning, and the
engine as a world of one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.config import load_config
from ds_strategy.core.zero.layout import FlatLayout, split_into_buckets
from ds_strategy.core.zero.units import plan_units
from tests.models import ToyLM


@pytest.mark.parametrize(
    "numels,world", [([3, 4], 2), ([5], 3), ([7, 1, 9, 2], 4), ([1], 8), ([0, 4], 3)]
)
def test_pieces_tile_every_parameter_exactly_once(numels: list[int], world: int) -> None:
    lay = FlatLayout(numels, world)
    assert lay.padded_total % world == 0 and lay.padded_total - lay.total < world
    covered = {i: [0] * n for i, n in enumerate(numels)}
    for r in range(world):
        lo, hi = lay.shard_range(r)
        assert hi - lo == lay.shard_size
        for pc in lay.pieces(r):
            assert pc.shard_start >= 0 and pc.shard_start + pc.length <= lay.shard_size
            assert lay.slots[pc.index].offset + pc.param_start == lo + pc.shard_start
            for k in range(pc.param_start, pc.param_start + pc.length):
                covered[pc.index][k] += 1
            assert r in lay.owners(pc.index)
    assert all(c == 1 for cs in covered.values() for c in cs)


def test_layout_example_and_bad_world() -> None:
    lay = FlatLayout([3, 4], 2)
    assert (lay.padded_total, lay.shard_size, lay.padding) == (8, 4, 1)
    assert [(p.index, p.param_start, p.shard_start, p.length) for p in lay.pieces(0)] == [
        (0, 0, 0, 3),
        (1, 0, 3, 1),
    ]
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout([1], 0)


def test_buckets_keep_order_and_size() -> None:
    assert split_into_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert split_into_buckets([], 8) == []


def test_units_follow_blocks_and_keep_attention_whole() -> None:
    model = ToyLM()
    plan = plan_units(model)
    units = plan.units
    assert units[-1] is model  # the root owns the rest
    assert all(b in units for b in model.blocks)
    assert model.attn.out_proj not in units  # read by the attention's own forward
    # the tied embedding/head weight is owned once, by the root
    owned = [id(p) for ps in plan.params.values() for p in ps]
    assert len(owned) == len(set(owned)) == len(list(model.parameters()))
    assert any(p is model.embed.weight for p in plan.params[id(model)])


def test_weight_shared_by_two_blocks_moves_to_root() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    plan = plan_units(model)
    assert any(p is model[0].weight for p in plan.params[id(model)])
    assert not any(p is model[0].weight for p in plan.params[id(model[0])])


def test_persistence_threshold_keeps_small_parameters_whole() -> None:
    plan = plan_units(ToyLM(), persistence_threshold=30)
    assert plan.persistent and all(p.numel() < 30 for p in plan.persistent)


def test_world_of_one_trains_like_plain_pytorch() -> None:
    torch.manual_seed(0)
    model, ref = nn.Linear(6, 3), nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    engine = ds_strategy.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_optimization": {"stage": 3}}
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(5, 6)
    for _ in range(3):
        engine.backward(engine(x).square().mean())
        engine.step()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v)
    assert engine.global_steps == 3 and engine.world_size == 1


def test_unsupported_engine_settings_are_clear_errors() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="offload_param.*stage 3"):
        ds_strategy.initialize(
            model,
            opt,
            load_config(
                {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                strict=True,  # loaded leniently, DeepSpeed's way, it is ignored with a warning
            ),
        )
    with pytest.raises(ds_strategy.ConfigError, match="did you mean 'stage'"):
        ds_strategy.initialize(model, opt, {"zero_optimization": {"stgae": 2}})
    with pytest.raises(ValueError, match="no optimizer"):
        ds_strategy.initialize(model, None, {})
    with pytest.raises(ds_strategy.ConfigError, match=r"train_batch_size \(3\)"):
        ds_strategy.initialize(
            model,
            opt,
            {
                "train_batch_size": 3,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 1,
            },
        )


def test_meta_module_without_init_is_a_clear_error() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(Custom(), nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"param_init_fn"):
        ds_strategy.initialize(
            model, lambda ps: torch.optim.SGD(ps, lr=0.1), {"zero_optimization": {"stage": 3}}
        )


def test_config_scheduler_errors_and_unknown_optimizer_options_are_named() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"scheduler\.params\.cycle_min_lr: required by OneCycle"):
        ds_strategy.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            {"scheduler": {"type": "OneCycle", "params": {}}},
        )
    one_cycle = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2}
    engine = ds_strategy.initialize(
        model,
        torch.optim.Adam(model.parameters(), lr=0.5),
        {"scheduler": {"type": "OneCycle", "params": one_cycle}},
    )
    for _ in range(2):
        engine.backward(engine(torch.randn(3, 2)).sum())
        engine.step()
    assert type(engine.lr_scheduler).__name__ == "OneCycle"
    assert engine.get_lr() == pytest.approx([0.1])  # the top of the cycle at step 2
    assert engine.optimizer.param_groups[0]["betas"] == pytest.approx((0.8, 0.99))
    bad = {
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "torch_adam": True, "lookahead": 5},
        }
    }
    with pytest.raises(ValueError, match=r"\['lookahead'\]"):
        ds_strategy.initialize(nn.Linear(2, 2), None, bad)


def test_persistence_threshold_includes_its_own_size_as_deepspeed() -> None:
    """DeepSpeed keeps a parameter whole when ``ds_numel <= threshold``: a bias of exactly the
    threshold's size stays whole, a weight one element larger is sharded."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # weights 16, biases 4
    plan = plan_units(model, 4)
    assert sorted(p.numel() for p in plan.persistent) == [4, 4]
    assert plan_units(model, 3).persistent == []
    assert len(plan_units(model, 16).persistent) == 4
