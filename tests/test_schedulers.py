"""DeepSpeed's config lr schedules: their curves, their errors, and the engine stepping them."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.core.schedulers import OneCycle, build_scheduler


def _lrs(type_name: str, params: dict, steps: int, lr: float = 1.0, groups: int = 1) -> list:
    tensors = [torch.zeros(1, requires_grad=True) for _ in range(groups)]
    opt = torch.optim.SGD([{"params": [t]} for t in tensors], lr=lr)
    sched = build_scheduler(type_name, params, opt)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def test_warmup_lr_log_and_linear() -> None:
    log = _lrs("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 4}, 6)
    want = [0.01 + 0.09 * math.log(k + 1) / math.log(4) for k in range(4)] + [0.1, 0.1]
    assert [v[0] for v in log] == pytest.approx(want)
    lin = _lrs(
        "WarmupLR",
        {"warmup_max_lr": [0.1, 0.2], "warmup_num_steps": 2, "warmup_type": "linear"},
        3,
        groups=2,
    )
    assert lin == [[0.0, 0.0], [0.05, 0.1], [0.1, 0.2]]


def test_warmup_decay_and_cosine() -> None:
    decay = _lrs(
        "WarmupDecayLR",
        {
            "total_num_steps": 6,
            "warmup_max_lr": 0.1,
            "warmup_num_steps": 2,
            "warmup_type": "linear",
        },
        8,
    )
    assert [v[0] for v in decay] == pytest.approx([0.0, 0.05, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0])
    cos = _lrs(
        "WarmupCosineLR",
        {
            "total_num_steps": 6,
            "warmup_num_steps": 2,
            "warmup_type": "linear",
            "cos_min_ratio": 0.0,
        },
        6,
        lr=0.5,
    )
    ratios = [0.0, 0.5] + [(1 + math.cos(math.pi * d / 4)) / 2 for d in (1, 2, 3, 4)]
    assert [v[0] for v in cos] == pytest.approx([0.5 * r for r in ratios])


def _range_test_ref(k: int, lo: float, size: int, rate: float, stairs: bool) -> float:
    """DeepSpeed's documented LRRangeTest at optimizer step k: lo * (1 + rate * k / size)."""
    interval = k // size if stairs else k / size
    return lo * (1 + rate * interval)


@pytest.mark.parametrize("stairs", [False, True])
def test_lr_range_test_follows_deepspeeds_formula(stairs: bool) -> None:
    params = {
        "lr_range_test_min_lr": [0.1, 0.02],
        "lr_range_test_step_size": 3,
        "lr_range_test_step_rate": 0.5,
        "lr_range_test_staircase": stairs,
    }
    got = _lrs("LRRangeTest", params, 10, groups=2)
    for lo, column in zip((0.1, 0.02), zip(*got, strict=True), strict=True):
        want = [_range_test_ref(k, lo, 3, 0.5, stairs) for k in range(10)]
        assert list(column) == pytest.approx(want)
    assert got[0] == [0.1, 0.02]  # step 0 runs at the minimum, as in DeepSpeed
    # defaults: step size 2000, rate 1.0
    assert [v[0] for v in _lrs("LRRangeTest", {"lr_range_test_min_lr": 0.1}, 3)] == pytest.approx(
        [0.1 * (1 + k / 2000) for k in range(3)]
    )


def _one_cycle_ref(k: int, p: dict) -> tuple[float, float]:
    """(lr, betas[0]) at optimizer step k, from DeepSpeed's documented OneCycle: up over the
    first half, down over the second, each in ``n`` stairs when its stair count ``n > 0``; then
    ``min_lr / (1 + decay_lr_rate * d / decay_step_size)`` and ``max_mom * (1 + decay_mom_rate
    * d / decay_step_size)`` ``d`` steps after the cycle. The momentum mirrors the lr, except
    at step 0, which runs at DeepSpeed's constructor's cycle_min_mom."""
    up, down = p["cycle_first_step_size"], p["cycle_second_step_size"]
    n_up = p.get("cycle_first_stair_count", 0)
    n_down = p.get("cycle_second_stair_count", n_up)  # defaults to the first half's count
    lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
    mom_lo, mom_hi = p.get("cycle_min_mom", 0.8), p.get("cycle_max_mom", 0.9)
    if k <= up + down:
        frac = k / up if k <= up else (up + down - k) / down
        stairs = n_up if k <= up else n_down
        if stairs > 0:
            frac = math.floor(frac * stairs) / stairs
        lr, mom = lo + (hi - lo) * frac, mom_hi - (mom_hi - mom_lo) * frac
    else:
        d = (k - up - down) / p["decay_step_size"]
        lr = lo / (1 + p["decay_lr_rate"] * d)
        mom = mom_hi * (1 + p.get("decay_mom_rate", 0.0) * d)
    return lr, (mom_lo if k == 0 else mom)


def _run(sched: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[tuple]:
    """(lr, betas) of the first param group at each of ``steps`` optimizer steps."""
    opt = sched.optimizer
    out = []
    for _ in range(steps):
        group = opt.param_groups[0]
        out.append((group["lr"], tuple(group.get("betas", ()))))
        opt.step()
        sched.step()
    return out


ONE_CYCLE = {
    "cycle_min_lr": 0.01,
    "cycle_max_lr": 0.1,
    "cycle_first_step_size": 4,
    "cycle_second_step_size": 6,
    "decay_step_size": 2,
    "decay_lr_rate": 0.5,
    "cycle_min_mom": 0.85,
    "cycle_max_mom": 0.95,
    "decay_mom_rate": 0.01,
}


@pytest.mark.parametrize(
    "stairs",
    [
        {},
        {"cycle_first_stair_count": 2, "cycle_second_stair_count": 3},
        {"cycle_first_stair_count": 2},
    ],
    ids=["continuous", "staircase", "staircase-one-count"],
)
def test_one_cycle_lr_and_momentum_follow_deepspeeds_formula(stairs: dict) -> None:
    params = {**ONE_CYCLE, **stairs}
    opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=1.0, betas=(0.5, 0.999))
    got = _run(build_scheduler("OneCycle", params, opt), 18)  # 10 cycle steps, 8 decay steps
    want = [_one_cycle_ref(k, params) for k in range(18)]
    assert [lr for lr, _ in got] == pytest.approx([lr for lr, _ in want])
    assert [b[0] for _, b in got] == pytest.approx([m for _, m in want])
    assert all(b[1] == 0.99 for _, b in got)  # DeepSpeed's fixed second beta
    assert max(lr for lr, _ in got) == pytest.approx(0.1)  # the peak, at step 4
    if stairs:  # held flat: two stairs up (0, .5), then down
        assert got[1][0] == got[0][0] and got[3][0] == got[2][0] != got[1][0]


def test_one_cycle_defaults_without_decay_and_optimizers_without_betas() -> None:
    # second half defaults to the first, no decay: back at cycle_min_lr / cycle_max_mom
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_first_step_size": 2}
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1.0)
    got = _run(build_scheduler("OneCycle", params, opt), 7)
    assert [lr for lr, _ in got] == pytest.approx([0.1, 0.3, 0.5, 0.3, 0.1, 0.1, 0.1])
    assert [b[0] for _, b in got] == pytest.approx([0.8, 0.85, 0.8, 0.85, 0.9, 0.9, 0.9])
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0, momentum=0.3)
    with pytest.warns(UserWarning, match="cycle_momentum: SGD has no betas"):
        sched = build_scheduler("OneCycle", params, sgd)
    for _ in range(3):
        sgd.step()
        sched.step()
    assert sgd.param_groups[0]["momentum"] == 0.3 and "betas" not in sgd.param_groups[0]


@pytest.mark.parametrize(
    ("type_name", "params", "opt_cls"),
    [
        ("OneCycle", {**ONE_CYCLE, "cycle_first_stair_count": 2}, torch.optim.Adam),
        ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}, None),
        ("StepLR", {"step_size": 3, "gamma": 0.5}, None),
    ],
)
def test_state_dict_round_trip_mid_schedule(type_name: str, params: dict, opt_cls: type) -> None:
    def fresh() -> torch.optim.lr_scheduler.LRScheduler:
        opt = (opt_cls or torch.optim.SGD)([torch.zeros(1, requires_grad=True)], lr=1.0)
        return build_scheduler(type_name, params, opt)

    ref = fresh()
    _run(ref, 7)  # mid-cycle
    buf = io.BytesIO()
    torch.save({"sched": ref.state_dict(), "opt": ref.optimizer.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # plain data, as checkpoints load it
    resumed = fresh()
    resumed.optimizer.load_state_dict(saved["opt"])
    resumed.load_state_dict(saved["sched"])
    want = _run(ref, 10)
    assert _run(resumed, 10) == want
    assert want != _run(fresh(), 10)  # the restored schedule is not the one from step 0


def test_other_types_fall_back_to_torch_schedulers() -> None:
    got = _lrs("StepLR", {"step_size": 2, "gamma": 0.5}, 5)
    assert [v[0] for v in got] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25])
    with pytest.raises(ValueError, match=r"scheduler\.type: 'Cosine'.*OneCycle.*StepLR"):
        _lrs("Cosine", {}, 1)
    with pytest.raises(ValueError, match=r"scheduler\.params\.step_size: required by StepLR"):
        _lrs("StepLR", {"gamma": 0.5}, 1)
    with pytest.raises(ValueError, match=r"\['decay'\] are not parameters of StepLR"):
        _lrs("StepLR", {"step_size": 2, "decay": 0.5}, 1)
    with pytest.raises(ValueError, match="ReduceLROnPlateau' steps on a metric"):
        _lrs("ReduceLROnPlateau", {}, 1)


@pytest.mark.parametrize(
    ("type_name", "params", "match"),
    [
        ("OneCycle", {"cycle_max_lr": 0.1}, r"scheduler\.params\.cycle_min_lr: required"),
        ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0}, "> 0"),
        ("Warmup", {}, r"'Warmup' is neither one of DeepSpeed's schedules \(WarmupLR"),
        ("WarmupLR", {"warmup_steps": 3}, "'warmup_steps'.*warmup_num_steps"),
        ("WarmupLR", {"warmup_type": "cubic"}, "warmup_type.*'log' or 'linear'"),
        ("WarmupDecayLR", {}, r"scheduler\.params\.total_num_steps: required"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, "2 values for 1 optimizer param groups"),
    ],
)
def test_bad_scheduler_sections(type_name: str, params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _lrs(type_name, params, 1)


def test_engine_steps_the_config_scheduler_at_optimizer_steps() -> None:
    model = torch.nn.Linear(3, 1)
    config = {
        "gradient_accumulation_steps": 2,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_max_lr": 0.2, "warmup_num_steps": 2, "warmup_type": "linear"},
        },
    }
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    seen = _lr_per_micro_step(engine, 6)
    assert seen == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.2, 0.2])  # steps once per 2 micro-steps
    engine.destroy()  # the model may have another engine now
    with pytest.raises(ValueError, match="keep one of them"):
        ds_strategy.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1),
        )


@pytest.mark.parametrize("path", sorted(Path("configs/deepspeed").glob("*.json")), ids=str)
def test_shipped_deepspeed_json_examples_load_and_build(path: Path) -> None:
    """Every DeepSpeed-style example loads unchanged; with its "auto" values resolved (as a
    front end does), a one-rank engine builds from it, scheduler section included."""
    cfg = ds_strategy.load_config(path)
    fills = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer.params.lr": 1e-3,
        "scheduler.params.warmup_max_lr": 1e-3,
        "scheduler.params.warmup_num_steps": 2,
        "scheduler.params.total_num_steps": 10,
    }
    resolved = cfg.resolve(1, fills).replace(**{"fp16.enabled": False, "bf16.enabled": False})
    model = torch.nn.Linear(3, 1)
    opt = None if cfg.optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ds_strategy.initialize(model, opt, resolved)
    for _ in range(engine.gradient_accumulation_steps):
        engine.backward(engine(torch.randn(2, 3)).sum())
        engine.step()
    assert engine.global_steps == 1
    if cfg.scheduler is not None:
        assert type(engine.lr_scheduler).__name__ == cfg.scheduler.type


def test_engine_trains_with_a_config_one_cycle_and_a_torch_fallback() -> None:
    torch.manual_seed(0)
    params = {
        "cycle_min_lr": 0.01,
        "cycle_max_lr": 0.05,
        "cycle_first_step_size": 2,
        "cycle_second_step_size": 2,
        "decay_step_size": 1,
        "decay_lr_rate": 1.0,
    }
    model = torch.nn.Linear(3, 1)
    before = model.weight.detach().clone()
    config = {
        "optimizer": {"type": "Adam", "params": {"lr": 1.0}},
        "scheduler": {"type": "OneCycle", "params": params},
    }
    engine = ds_strategy.initialize(model, None, config)
    assert isinstance(engine.lr_scheduler, OneCycle)
    seen = []
    for _ in range(6):
        seen.append((engine.get_lr()[0], engine.optimizer.param_groups[0]["betas"][0]))
        loss = engine(torch.randn(4, 3)).square().mean()
        engine.backward(loss)
        engine.step()
        assert math.isfinite(loss.item())
    want = [v for k in range(6) for v in _one_cycle_ref(k, params)]
    assert [v for pair in seen for v in pair] == pytest.approx(want)
    assert engine.global_steps == 6
    assert not torch.equal(engine.full_state_dict()["weight"], before)

    model = torch.nn.Linear(3, 1)
    step_lr = {"scheduler": {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}}
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.4), step_lr)
    lrs = _lr_per_micro_step(engine, 3)
    assert lrs == pytest.approx([0.4, 0.2, 0.1])


def _lr_per_micro_step(engine: Any, micro_steps: int) -> list[float]:
    """The learning rate before each of ``micro_steps`` backward + step calls on random data."""
    seen = []
    for _ in range(micro_steps):
        seen.append(engine.get_lr()[0])
        engine.backward(engine(torch.randn(2, 3)).sum())
        engine.step()
    return seen
