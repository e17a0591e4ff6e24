"""Whole-parameter norms for an optimizer that may be stepping pieces of parameters.

[Note: why an optimizer may need more than the tensors it holds]
LAMB scales each parameter's update by ``||w|| / ||u||`` over the *whole* parameter. Under
ZeRO (stages 1-3) the optimizer on a rank holds only the pieces of parameters that fall in this
rank's slice of a flat buffer, and one parameter may be split between two or more ranks. So
each rank computes per-tensor *partial* sums (of squares, here), :meth:`ParamNorms.totals` adds
them into one vector indexed by parameter, laid out alike on every rank, sums that vector
across the ranks with a single all-reduce, and hands each piece its parameter's total.

The sharding wrapper (``core/zero/optimizer.py``) builds the :class:`ParamNorms` and gives it to
an optimizer that implements :class:`NeedsParamNorms`; the optimizer only ever asks for totals.
Unsharded (no :class:`ParamNorms`), every tensor is a whole parameter and its own sums are the
totals, so the same optimizer class runs as a plain ``torch.optim.Optimizer`` too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["NeedsParamNorms", "ParamNorms"]


class ParamNorms:
    """Turns per-piece partial sums into per-parameter totals across the ranks.

    ``slots`` maps ``id(tensor)`` of each piece the optimizer steps to the index of its
    parameter in a vector of ``size`` entries that every rank lays out the same way (the
    wrapper keeps the pieces alive, so the ids stay valid); a tensor not in ``slots`` is a whole
    parameter held by this rank alone. ``all_reduce`` sums a tensor in place across the ranks
    holding the pieces; ``device`` is where it can do so (NCCL reduces device tensors only).

    >>> norms = ParamNorms({}, 0, lambda t: None)  # a world of one with no pieces
    >>> norms.totals([], torch.zeros(0, 2)).shape
    torch.Size([0, 2])
    """

    def __init__(
        self,
        slots: Mapping[int, int],
        size: int,
        all_reduce: Callable[[torch.Tensor], object],
        device: torch.device | None = None,
        all_reduce_max: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        self.slots = dict(slots)
        self.size = size
        self.all_reduce = all_reduce
        self.all_reduce_max = all_reduce_max
        self.device = device or torch.device("cpu")

    def totals(self, tensors: Sequence[torch.Tensor], partial: torch.Tensor) -> torch.Tensor:
        """``partial[i]`` holds sums over ``tensors[i]``; the result holds the same sums over the
        whole parameter each tensor is a piece of (float64, on ``partial``'s device).

        Collective: every rank calls it exactly once per optimizer step, with however many
        tensors it has (none included), or the ranks wait on each other."""
        return self._combine(tensors, partial, "sum")

    def maxima(self, tensors: Sequence[torch.Tensor], partial: torch.Tensor) -> torch.Tensor:
        """As :meth:`totals`, for per-tensor maxima: the maximum over the whole parameter.
        Collective, once per step, like :meth:`totals`."""
        return self._combine(tensors, partial, "max")

    def _combine(
        self, tensors: Sequence[torch.Tensor], partial: torch.Tensor, op: str
    ) -> torch.Tensor:
        here = self.device
        index = torch.tensor([self.slots.get(id(t), -1) for t in tensors], dtype=torch.long)
        index = index.to(here)
        shared = index >= 0
        values = partial.to(device=here, dtype=torch.float64, copy=True)
        if op == "sum":
            vector = torch.zeros(self.size, values.shape[1], dtype=torch.float64, device=here)
            vector.index_add_(0, index[shared], values[shared])
            self.all_reduce(vector)
        else:
            if self.all_reduce_max is None:
                raise ValueError("ParamNorms.maxima: these ranks were given no max all-reduce")
            vector = torch.full(
                (self.size, values.shape[1]), -math.inf, dtype=torch.float64, device=here
            )
            rows = index[shared].unsqueeze(1).expand(-1, values.shape[1])
            vector.scatter_reduce_(0, rows, values[shared], "amax")
            self.all_reduce_max(vector)
        values[shared] = vector[index[shared]]
        return values.to(partial.device)


@runtime_checkable
class NeedsParamNorms(Protocol):
    """An optimizer whose update needs whole-parameter norms (LAMB's trust ratio); a sharding
    wrapper calls ``use_param_norms`` once, after building it over this rank's pieces."""

    def use_param_norms(self, norms: ParamNorms | None) -> None: ...
