"""DeepSpeed's 0/1 Adam (``ZeroOneAdam``, `Lu et al., 2022 <https://arxiv.org/abs/2202.06009>`_)
with the arguments of DeepSpeed's class (``deepspeed/runtime/fp16/onebit/zoadam.py``).

[Note: 0/1 Adam's two phases]
Unlike 1-bit Adam, 0/1 Adam never spends a long dense warm-up. Its optimizer steps are of four
kinds, fixed in advance by the step number (:func:`zero_one_kind`):

- up to ``var_freeze_step`` the variance ``v`` is still updated, but only on *variance steps*:
  every step at first, then every 2nd, 4th, ... step, the interval doubling after each
  ``var_update_scaler`` variance steps. A variance step is a dense Adam step (the engine
  averages the gradients as usual). Any other step (``"onebit"``) averages the gradients with
  the error-compensated 1-bit all-reduce and updates the momentum only;
- after ``var_freeze_step`` ``v`` is frozen and the ranks take *local steps*: each rank folds
  its own gradient into its own momentum and moves its own weights, with no communication,
  keeping the sum of its updates (times ``sqrt(v) + eps``, i.e. of ``lr * m``) in an
  accumulator. Every ``local_step_interval`` steps (``"sync"``) the local updates are undone,
  the accumulators are averaged 1-bit compressed, and the average becomes every rank's update
  and (divided by the learning rates summed since the last sync) its momentum. The interval
  starts at 1 and doubles, up to ``local_step_clipper``, after each ``local_step_scaler``
  steps.

The engine runs the exchanges (``core/compression/zeroone_reduce.py``): it tells the optimizer
the kind of each step (``given``) and, for a sync, hands it the compressed all-reduce to call
(``exchange``). As in DeepSpeed's class, no bias correction is applied (``bias_correction`` is
accepted; ``True`` is warned about and ignored); DeepSpeed's first ``step()`` only allocates
buffers, here it is a real step; entries whose ``v`` is zero (no gradient yet) get a zero
momentum instead of DeepSpeed's user-given ``exp_avg_mask``. Local steps move each rank's
weights apart between syncs, so 0/1 Adam needs every parameter's optimizer state on every
rank: ZeRO stage 0, as DeepSpeed runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

from .adam import advance_moments, check_moments, closure_loss
from .onebit import CompressedExchange, check_onebit

__all__ = ["ZeroOneAdam", "zero_one_kind"]

log = logging.getLogger(__name__)

StepKind = Literal["dense", "onebit", "local", "sync"]


def zero_one_kind(
    step: int,
    var_freeze_step: int,
    var_update_scaler: int,
    local_step_scaler: int,
    local_step_clipper: int,
) -> StepKind:
    """The kind of 0/1 Adam's optimizer step number ``step`` (1-based; see the module note).
    The intervals are counted as DeepSpeed counts them, on its step number, one ahead of
    ``step`` (its first ``step()`` call only allocates buffers), so the kinds of the real
    steps are DeepSpeed's.

    >>> [zero_one_kind(t, 12, 2, 2, 4) for t in range(1, 8)]
    ['dense', 'dense', 'dense', 'onebit', 'dense', 'onebit', 'dense']
    >>> [zero_one_kind(t, 2, 2, 2, 4) for t in range(3, 11)]
    ['sync', 'sync', 'sync', 'local', 'sync', 'local', 'local', 'local']
    """
    n = step + 1  # DeepSpeed's count
    if step <= var_freeze_step:
        last, interval = 1, 1  # the last variance step of the blocks before, their interval
        while True:
            first = (last // interval + 1) * interval
            end = first + (var_update_scaler - 1) * interval
            if n <= end:
                return "dense" if n % interval == 0 else "onebit"
            last, interval = end, interval * 2
    doublings = min((step - var_freeze_step - 1) // local_step_scaler, 62)
    interval = min(local_step_clipper, 2**doublings)
    return "sync" if n % interval == 0 else "local"


class ZeroOneAdam(CompressedExchange, torch.optim.Optimizer):
    """0/1 Adam: variance updates on exponentially rarer steps with 1-bit averaged gradients
    between them, then frozen variance and local steps with 1-bit synchronisation (module
    note). Build it from a config (``{"type": "ZeroOneAdam", "params": {...}}``) or pass it to
    ``ds_strategy.initialize``; the engine runs its exchanges at ZeRO stage 0. Weight decay is
    decoupled, as in DeepSpeed's::

        w = w - lr * (m / (sqrt(v) + eps) + weight_decay * w)

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = ZeroOneAdam([w], lr=0.1)
    >>> w.grad = torch.ones(2)
    >>> opt.step()  # a variance step (the first is) is an Adam step
    >>> [round(x, 4) for x in w.tolist()]
    [-0.3162, -0.3162]
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = False,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        name = "ZeroOneAdam"
        check_moments(name, lr, eps, weight_decay, betas)
        check_onebit(name, ("var_freeze_step", var_freeze_step), amsgrad, max_grad_norm)
        for key, value in (
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {key}={value!r} must be an integer >= 1")
        if bias_correction:
            log.warning(
                "ZeroOneAdam: bias_correction=True is ignored; 0/1 Adam applies no bias "
                "correction (as DeepSpeed's ZeroOneAdam)"
            )
        defaults = dict(
            lr=lr,
            bias_correction=False,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            # one schedule for all groups, in the defaults so a rebuild over shards keeps it
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
        )
        super().__init__(params, defaults)
        self.schedule = (var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
        # set by the engine's exchange for the coming step (None: a dense step)
        self.given: StepKind | None = None
        self.exchange: Callable[[Sequence[torch.Tensor]], None] | None = None

    def kind_of(self, step: int) -> StepKind:
        """The kind of optimizer step number ``step`` (1-based) under this schedule."""
        return zero_one_kind(step, *self.schedule)

    @property
    def exchanged(self) -> bool:
        """The coming step's ``.grad`` is what the engine's exchange gave."""
        return self.given is not None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        given, self.given = self.given, None
        syncing = []
        for group in self.param_groups:
            for w in group["params"]:
                state = self.state[w]
                if w.grad is not None:
                    self._update(group, w, w.grad, state, given)
                # a parameter without a gradient at the sync still owes its earlier local steps
                if given == "sync" and "momentum_accumulator" in state:
                    syncing.append((w, state, self._denominator(group, state["exp_avg_sq"])))
        if syncing:
            self._synchronise(syncing)
        return loss

    def _update(
        self,
        group: dict[str, Any],
        w: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        given: str | None,
    ) -> None:
        """One step of ``w`` of the kind ``given`` (None: a variance step), see the note."""
        b1, b2 = group["betas"]
        if given is None:  # a variance step: plain Adam on the averaged gradient
            m, v = advance_moments(state, w, grad, (b1, b2))
        else:
            if not state:
                advance_moments(state, w, torch.zeros_like(w), (b1, b2))
            else:
                state["step"] += 1
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(b1).add_(grad, alpha=1 - b1).masked_fill_(v == 0, 0.0)
        u = m / self._denominator(group, v)
        if group["weight_decay"]:
            u.add_(w, alpha=group["weight_decay"])
        w.add_(u, alpha=-group["lr"])
        if given in ("local", "sync"):
            if "momentum_accumulator" not in state:  # the first local step
                state["momentum_accumulator"] = torch.zeros_like(w)
                state["lrs"] = torch.zeros((), dtype=torch.float64)
            state["momentum_accumulator"].add_(u, alpha=-group["lr"])
            state["lrs"] += group["lr"]

    def _synchronise(
        self, syncing: list[tuple[torch.Tensor, dict[str, Any], torch.Tensor]]
    ) -> None:
        """Undo the local updates, average them (1-bit), apply the average: the momentum
        becomes the averaged ``lr * m`` over the learning rates summed since the last sync."""
        if self.exchange is None:
            raise RuntimeError("ZeroOneAdam: a sync step without the engine's exchange")
        accumulators = []
        for w, state, denom in syncing:
            acc = state["momentum_accumulator"]
            w.sub_(acc)
            accumulators.append(acc.mul_(denom))
        self.exchange(accumulators)
        for w, state, denom in syncing:
            acc, lrs = state["momentum_accumulator"], float(state["lrs"])
            if lrs > 0:  # a zero learning rate since the last sync leaves the momentum as it is
                m = state["exp_avg"]
                torch.div(acc, -lrs, out=m).masked_fill_(state["exp_avg_sq"] == 0, 0.0)
            w.add_(acc / denom)
            acc.zero_()
            state["lrs"].zero_()

    @staticmethod
    def _denominator(group: dict[str, Any], v: torch.Tensor) -> torch.Tensor:
        if group["eps_inside_sqrt"]:
            return (v + group["eps"]).sqrt_()
        return v.sqrt().add_(group["eps"])
