"""DeepSpeed's config lr schedules: their curves, their errors, and the engine stepping them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import ds_strategy
from ds_strategy.core.schedulers import build_scheduler


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


def test_lr_range_test() -> None:
    smooth = _lrs(
        "LRRangeTest",
        {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 1.0},
        3,
    )
    assert [v[0] for v in smooth] == pytest.approx([0.15, 0.2, 0.25])
    stairs = _lrs(
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 0.1,
            "lr_range_test_step_size": 2,
            "lr_range_test_staircase": True,
        },
        4,
    )
    assert [v[0] for v in stairs] == pytest.approx([0.1, 0.2, 0.2, 0.3])


@pytest.mark.parametrize(
    ("type_name", "params", "match"),
    [
        ("OneCycle", {}, "OneCycleLR"),
        ("Warmup", {}, "'Warmup' is not one of WarmupLR"),
        ("WarmupLR", {"warmup_steps": 3}, "'warmup_steps'.*warmup_num_steps"),
        ("WarmupLR", {"warmup_type": "cubic"}, "warmup_type.*'log' or 'linear'"),
        ("WarmupDecayLR", {}, "total_num_steps"),
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
    seen = []
    for _ in range(6):
        seen.append(engine.get_lr()[0])
        engine.backward(engine(torch.randn(2, 3)).sum())
        engine.step()
    assert seen == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.2, 0.2])  # steps once per 2 micro-steps
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
