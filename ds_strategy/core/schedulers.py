"""DeepSpeed's config learning-rate schedules (``"scheduler": {"type": ..., "params": ...}``)
as torch ``LRScheduler``s, stepped by the engine after every optimizer step.

Types and parameters are DeepSpeed's: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` and
``LRRangeTest``. One deliberate difference in timing: like every torch scheduler, the learning
rate of optimizer step ``k`` (counting from 0) is the schedule's value at ``k``, so the first
step already runs at ``warmup_min_lr``. (DeepSpeed runs its first step at the optimizer's own
``lr`` and the schedule's value at ``k - 1`` after that.)

>>> import torch
>>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
>>> sched = build_scheduler("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 4,
...                                      "warmup_type": "linear"}, opt)
>>> lrs = []
>>> for _ in range(6):
...     lrs.append(round(opt.param_groups[0]["lr"], 3))
...     opt.step()
...     sched.step()
>>> lrs
[0.0, 0.025, 0.05, 0.075, 0.1, 0.1]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "LRRangeTest",
    "SCHEDULERS",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]


def _per_group(
    opt: torch.optim.Optimizer, value: float | Sequence[float], name: str
) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(opt.param_groups):
            raise ValueError(
                f"scheduler.params.{name}: {len(value)} values for {len(opt.param_groups)} "
                "optimizer param groups; give one value, or one per group"
            )
        return [float(v) for v in value]
    return [float(value)] * len(opt.param_groups)


def _at_least_one(value: int, name: str) -> int:
    if int(value) < 1:
        raise ValueError(f"scheduler.params.{name}: {value}; must be >= 1")
    return int(value)


def _warmup_fraction(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """0 at step 0 rising to 1 at ``warmup_num_steps``, logarithmically or linearly."""
    if step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type: {warmup_type!r}; use 'log' or 'linear'")
    return warmup_type


class WarmupLR(LRScheduler):
    """``warmup_min_lr`` rising to ``warmup_max_lr`` over ``warmup_num_steps`` steps
    (``warmup_type`` ``log`` or ``linear``), then constant. Values may be per param group."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def _gamma(self, step: int) -> float:
        return _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        gamma = self._gamma(self.last_epoch)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _at_least_one(total_num_steps, "total_num_steps")
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return super()._gamma(step)
        remaining = self.total_num_steps - step
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRScheduler):
    """The optimizer's own lr times a ratio rising from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps`` steps, then following a cosine down to ``cos_min_ratio`` at
    ``total_num_steps``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _at_least_one(total_num_steps, "total_num_steps")
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def ratio(self, step: int) -> float:
        if step < self.warmup_num_steps:
            rise = _warmup_fraction(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * rise
        done = step - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine = (1.0 + math.cos(math.pi * min(done, span) / span)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        r = self.ratio(self.last_epoch)
        return [base * r for base in self.base_lrs]


class LRRangeTest(LRScheduler):
    """The lr range test: ``lr_range_test_min_lr`` growing by ``lr_range_test_step_rate``
    every ``lr_range_test_step_size`` steps (in steps with ``lr_range_test_staircase``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _at_least_one(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        interval = (self.last_epoch + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        factor = 1.0 + self.step_rate * interval
        return [lr * factor for lr in self.min_lrs]


SCHEDULERS: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(
    type_name: str, params: dict[str, Any], optimizer: torch.optim.Optimizer
) -> LRScheduler:
    """The scheduler a config's ``scheduler`` section names, on ``optimizer``; errors name the
    bad type or parameter and what is accepted."""
    cls = SCHEDULERS.get(type_name)
    if cls is None:
        hint = (
            " (for OneCycle use torch.optim.lr_scheduler.OneCycleLR, passed as lr_scheduler=)"
            if type_name == "OneCycle"
            else ""
        )
        raise ValueError(
            f"scheduler.type: {type_name!r} is not one of {', '.join(SCHEDULERS)}{hint}; or pass "
            "a torch scheduler as lr_scheduler= and remove the config's scheduler section"
        )
    accepted = [
        n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "optimizer")
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"scheduler.params: {unknown} are not parameters of {type_name}; it takes "
            f"{', '.join(accepted)}"
        )
    try:
        return cls(optimizer, **params)
    except TypeError as e:  # a required parameter is missing
        raise ValueError(f"scheduler.params ({type_name}): {e}") from e
