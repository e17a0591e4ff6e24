"""The optimizer step over low-precision weights or state: computed in fp32, a chunk at a
time, and rounded back stochastically.

[Note: the rounded step]
With DeepSpeed's ``bf16_master_weights_and_grads`` (or ``fp16_...``) the optimizer updates
the compute-dtype weights themselves, with no fp32 master; with ``bf16_optimizer_states`` its
per-element state (Adam's moments) is kept in bf16. A torch optimizer given bf16 tensors
computes in bf16 and rounds each result to nearest, which drops every update below half a
unit in the last place (see ``rounding.py``). So the step runs over the pieces in chunks of
at most ``chunk`` elements. For each chunk the weights, gradients and stored state become
fp32 working copies, the user's optimizer steps them (every other piece has ``.grad = None``,
so it is skipped, as for a parameter without a gradient), and the results are rounded back
stochastically into the stored tensors. Only one chunk's fp32 copies exist at a time, and the
meter counts them. Each piece's hyper-parameters, step counter and update are those of one
full step; the rounding noise depends on the step, the parameter and the element only, so
a rank's piece rounds as one process rounds the whole parameter.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch

from ..memory import Held, ModelStateMeter
from ..optim.state import per_element
from .rounding import rounding_key, stochastic_round_

if TYPE_CHECKING:
    from ..zero.optimizer import OptimizerPiece, ShardedOptimizer

__all__ = ["RoundedStep"]

# elements stepped at once when the config does not ask for fewer (zero_optimization's
# sub_group_size): 16 MiB of fp32 weights, gradients and two moments
DEFAULT_CHUNK = 1 << 20


class RoundedStep:
    """Replaces ``optimizer.step()`` for a ``ShardedOptimizer`` over low-precision tensors.

    Args:
        sharded_opt: the optimizer and its pieces.
        ordinals: ``id(parameter)`` to its place in the model, part of the rounding key.
        state_dtype: the dtype per-element state is stored in; None keeps the optimizer's.
        chunk: the most elements stepped at once.
        meter: where the fp32 working copies are counted.
    """

    what = "the rounded step of low-precision master weights or optimizer states"
    instead = (
        "keep fp32 masters and states (remove bf16_master_weights_and_grads, "
        "bf16_optimizer_states, fp16_master_weights_and_grads), or use another optimizer"
    )

    def __init__(
        self,
        sharded_opt: ShardedOptimizer,
        ordinals: dict[int, int],
        state_dtype: torch.dtype | None,
        chunk: int,
        meter: ModelStateMeter,
    ) -> None:
        self.sharded_opt = sharded_opt
        self.ordinals = ordinals
        self.state_dtype = state_dtype
        self.chunk = max(1, chunk)
        self.meter = meter

    def chunks(self) -> list[list[int]]:
        """Indices of the pieces with a gradient, in runs of at most ``chunk`` elements."""
        return self.sharded_opt.live_runs(self.chunk)

    def step(self) -> None:
        for chunk in self.chunks():
            held = self.meter.held()
            stored = [self._to_fp32(self.sharded_opt.pieces[i], held) for i in chunk]
            self.sharded_opt.optimizer.step()
            for i, (weights, states) in zip(chunk, stored, strict=True):
                self._round_back(i, weights, states)
            held.drop()

    def settle(self) -> None:
        """Per-element state not in ``state_dtype`` (loaded from an fp32 checkpoint, say) is
        converted now, rounded to nearest as a load would be, not at the next step."""
        if self.state_dtype is None:
            return
        opt = self.sharded_opt.optimizer
        for pc in self.sharded_opt.pieces:
            st = opt.state.get(pc.tensor, {})
            for k, v in per_element(st, pc.tensor).items():
                if v.dtype != self.state_dtype:
                    st[k] = v.to(self.state_dtype)

    def _to_fp32(
        self, pc: OptimizerPiece, held: Held
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Point the piece, its gradient and its state at fp32 copies; returns what they
        replaced (the stored weights and low-precision state) to round the results into."""
        t = pc.tensor
        weights = t.data
        if weights.dtype != torch.float32:
            t.data = held.take(weights.float())
        grad = pc.grad()
        t.grad = grad if grad.dtype == torch.float32 else held.take(grad.float())
        st = self.sharded_opt.optimizer.state.get(t, {})
        states = {}
        for k, v in per_element(st, t).items():
            if v.dtype != torch.float32:
                states[k] = v
                st[k] = held.take(v.float())
        return weights, states

    def _round_back(self, i: int, weights: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        pc = self.sharded_opt.pieces[i]
        t = pc.tensor
        step = self.sharded_opt.clock()
        ordinal = self.ordinals.get(id(pc.group.params[pc.index]), pc.index)
        if t.data.data_ptr() != weights.data_ptr():
            stochastic_round_(weights, t.data, pc.start, rounding_key(step, ordinal, 0))
            t.data = weights
        t.grad = None
        st = self.sharded_opt.optimizer.state[t]
        for k, v in per_element(st, t).items():
            keep = states.get(k)
            if keep is None and self.state_dtype in (None, v.dtype):
                continue  # state kept as the optimizer made it
            if keep is None:  # made by the optimizer just now: stored from here on
                keep = torch.empty_like(v, dtype=self.state_dtype)
                self.meter.touch(keep.numel() * keep.element_size())
            key = rounding_key(step, ordinal, zlib.crc32(str(k).encode()))
            stochastic_round_(keep, v, pc.start, key)
            st[k] = keep
