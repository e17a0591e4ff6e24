"""DeepSpeed's config learning-rate schedules (``"scheduler": {"type": ..., "params": ...}``)
as torch ``LRScheduler``s, stepped by the engine after every optimizer step.

Types and parameters are DeepSpeed's (``runtime/lr_schedules.py``): ``WarmupLR``,
``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest``. As in DeepSpeed, any
other ``type`` is looked up in ``torch.optim.lr_scheduler`` and built with the section's
``params`` (``{"type": "StepLR", "params": {"step_size": 10}}``).

Timing: like every torch scheduler, the learning rate of optimizer step ``k`` (counting from 0)
is the schedule's value at ``k``. ``OneCycle`` and ``LRRangeTest`` match DeepSpeed step for
step (its constructors put the value of step 0 in place). For the warm-up schedules this is one
deliberate difference: DeepSpeed runs the schedule's value at ``k - 1`` at step ``k`` (and, at
step 0, ``warmup_min_lr``, or an lr of 0 for ``WarmupCosineLR``), so its first value lasts two
steps; here the schedule starts at once.

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
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .warnings import DsStrategyWarning

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "SCHEDULERS",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
    "load_scheduler_state",
]

PerGroup = float | list[float] | tuple[float, ...]
"""One value for every param group, or one per group (a list or a tuple)."""


def _per_group(opt: torch.optim.Optimizer, value: PerGroup, name: str) -> list[float]:
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
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup = 0.001,
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
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup = 0.001,
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

    def get_lr(self) -> list[float | torch.Tensor]:
        r = self.ratio(self.last_epoch)
        return [base * r for base in self.base_lrs]


class LRRangeTest(LRScheduler):
    """The lr range test: ``lr_range_test_min_lr`` growing linearly, by
    ``lr_range_test_step_rate`` times itself every ``lr_range_test_step_size`` steps (in steps
    with ``lr_range_test_staircase``): ``min_lr * (1 + step_rate * k / step_size)`` at step
    ``k``, the ratio floored with the staircase."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: PerGroup = 1e-3,
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
        # DeepSpeed's (last_batch_iteration + 1) / step_size: its last_batch_iteration is k - 1
        # at optimizer step k, where torch's last_epoch is k; step 0 runs at the minimum.
        interval = self.last_epoch / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        factor = 1.0 + self.step_rate * interval
        return [lr * factor for lr in self.min_lrs]


class OneCycle(LRScheduler):
    """DeepSpeed's 1Cycle: the lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and falls back over ``cycle_second_step_size`` (default:
    the first), then decays as ``cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)``
    ``d`` steps after the cycle (no decay when either is 0). A stair count ``n > 0`` holds
    the lr flat on ``n`` stairs across that half. With ``cycle_momentum`` an Adam-family
    optimizer's ``betas[0]`` moves the opposite way, between ``cycle_max_mom`` and
    ``cycle_min_mom``, and grows by ``decay_mom_rate`` after the cycle.

    [Note: DeepSpeed's momentum] Kept as DeepSpeed does it, so a config trains the same:
    only optimizers with ``betas`` in their defaults are cycled (others, SGD included, warn
    and keep their momentum); the second beta is set to 0.99 whatever it was; and the first
    step runs at ``cycle_min_mom`` (its constructor's value) although the cycle itself starts
    at ``cycle_max_mom`` from the second step on.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: PerGroup,
        cycle_max_lr: PerGroup,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: PerGroup = 0.8,
        cycle_max_mom: PerGroup = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self._init_cycle(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
        )
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_step_size = float(decay_step_size)
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        no_decay = math.isclose(self.decay_step_size, 0.0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0.0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0.0)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(
                f"scheduler.params.cycle_momentum: {type(optimizer).__name__} has no betas, so "
                "OneCycle leaves its momentum alone (as DeepSpeed does)",
                DsStrategyWarning,
                stacklevel=3,
            )
            self.cycle_momentum = False
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    def _init_cycle(
        self, first: int, second: int | None, first_stairs: int, second_stairs: int | None
    ) -> None:
        self.first_step_size = float(first)
        self.second_step_size = self.first_step_size if second is None else float(second)
        if self.first_step_size <= 0:
            raise ValueError(f"scheduler.params.cycle_first_step_size: {first}; must be > 0")
        if self.second_step_size < 0:
            raise ValueError(f"scheduler.params.cycle_second_step_size: {second}; must be >= 0")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = int(first_stairs)
        self.second_stair_count = (
            self.first_stair_count if second_stairs is None else int(second_stairs)
        )

    def _scale_factor(self, batch: int) -> float:
        """Where batch ``batch`` sits in the cycle: 0 at ``cycle_min_lr``, 1 at the peak."""
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            factor, stairs = x / self.step_ratio, self.first_stair_count
        else:
            factor, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # From the integer offset, not from ``factor``: a float factor a hair under a stair
            # would floor a whole stair down (DeepSpeed quantises the same way).
            into = batch % self.total_size
            if into <= self.first_step_size:
                position = into * stairs / self.first_step_size
            else:
                position = (self.total_size - into) * stairs / self.second_step_size
            factor = math.floor(position) / stairs
        return factor

    def _decay_interval(self, step: int) -> float:
        return (step - self.total_size) / self.decay_step_size

    def _in_cycle(self, step: int) -> bool:
        # DeepSpeed tests last_batch_iteration < total_size, and that is k - 1 at step k
        return step - 1 < self.total_size

    def get_lr(self) -> list[float]:  # type: ignore[override]
        k = self.last_epoch
        if self._in_cycle(k):
            f = self._scale_factor(k)
            return [lo + (hi - lo) * f for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval(k)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float]:
        """The first beta of each param group at the current step (see the class note)."""
        k = self.last_epoch
        if k == 0:
            return list(self.min_moms)
        if self._in_cycle(k):
            f = self._scale_factor(k)
            return [hi - (hi - lo) * f for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval(k)
        return [hi * factor for hi in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, beta0 in zip(self.optimizer.param_groups, self.get_mom(), strict=True):
                group["betas"] = (beta0, 0.99)


SCHEDULERS: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}
"""DeepSpeed's schedule types; any other ``scheduler.type`` is a torch scheduler's name."""

_TORCH_SCHEDULERS = tuple(
    name
    for name in torch.optim.lr_scheduler.__all__
    if name != "LRScheduler" and issubclass(getattr(torch.optim.lr_scheduler, name), LRScheduler)
)


def _scheduler_class(type_name: str) -> type[LRScheduler]:
    """DeepSpeed's schedule of that name, else ``torch.optim.lr_scheduler.<type_name>`` (as
    DeepSpeed falls back)."""
    if type_name in SCHEDULERS:
        return SCHEDULERS[type_name]
    if type_name == "ReduceLROnPlateau":
        raise ValueError(
            "scheduler.type: 'ReduceLROnPlateau' steps on a metric, which the engine's step() "
            "does not have; use a step-based schedule"
        )
    if type_name in _TORCH_SCHEDULERS:
        cls: type[LRScheduler] = getattr(torch.optim.lr_scheduler, type_name)
        return cls
    raise ValueError(
        f"scheduler.type: {type_name!r} is neither one of DeepSpeed's schedules "
        f"({', '.join(SCHEDULERS)}) nor a torch.optim.lr_scheduler class "
        f"({', '.join(n for n in _TORCH_SCHEDULERS if n != 'ReduceLROnPlateau')}); or pass a "
        "torch scheduler as lr_scheduler= and remove the config's scheduler section"
    )


def build_scheduler(
    type_name: str,
    params: dict[str, Any],  # the config's scheduler.params, values as written
    optimizer: torch.optim.Optimizer,
) -> LRScheduler:
    """The scheduler a config's ``scheduler`` section names, on ``optimizer``; errors name the
    bad type or parameter and what is accepted."""
    cls = _scheduler_class(type_name)
    signature = inspect.signature(cls.__init__).parameters
    accepted = [
        name
        for name, p in signature.items()
        if name not in ("self", "optimizer") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"scheduler.params: {unknown} are not parameters of {type_name}; it takes "
            f"{', '.join(accepted)}"
        )
    for name in accepted:
        if signature[name].default is inspect.Parameter.empty and name not in params:
            raise ValueError(
                f"scheduler.params.{name}: required by {type_name}, which has no default for "
                "it; set it in the config's scheduler section"
            )
    try:
        return cls(optimizer, **params)
    except TypeError as e:  # e.g. a value of the wrong type
        raise ValueError(f"scheduler.params ({type_name}): {e}") from e


# [Note: DeepSpeed's scheduler position]
# DeepSpeed's own schedules save ``{"last_batch_iteration": n}`` and the optimizer's param
# groups keep the learning rate of the next step; ours are torch schedulers indexed by
# ``last_epoch``. The warm-up schedules run DeepSpeed's value of step ``k - 1`` at step ``k``
# (see the module note), so ``last_epoch = n`` continues them exactly; ``OneCycle`` and
# ``LRRangeTest`` match DeepSpeed step for step, so ``last_epoch = n + 1``.


def load_scheduler_state(
    scheduler: LRScheduler,
    state: dict[str, Any],  # a state_dict(), torch's or DeepSpeed's
) -> None:
    """``scheduler.load_state_dict(state)``, or for DeepSpeed's ``{"last_batch_iteration": n}``
    the same position of the schedule (see [Note: DeepSpeed's scheduler position]); the
    optimizer's param groups already hold the learning rate of the next step."""
    if set(state) != {"last_batch_iteration"}:
        scheduler.load_state_dict(state)
        return
    n = int(state["last_batch_iteration"])
    scheduler.last_epoch = n + 1 if isinstance(scheduler, (OneCycle, LRRangeTest)) else n
    scheduler._step_count = scheduler.last_epoch + 1
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
