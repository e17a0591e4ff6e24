"""ZeRO-3 for a model that only runs forward (ZeRO-Inference): the seam ``core/inference``
builds on, so that it needs none of the training runtime's insides.

[Note: forward-only ZeRO-3]
Inference shards a model exactly as training's stage 3 does: the same units (``units.py``),
the same flat groups, built one unit at a time and filled with this rank's slice, the same
gathers, releases and prefetches. What it leaves out is everything about gradients: no
reduction is ever launched (the runtime's reduction queue stays empty), and a group's
transport is plain (ZeRO++ reshapes gradient and repeated-gather traffic that a forward pass
does not have). The groups get their store (device, host, NVMe) from the caller when they are
built, as in training.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..collectives import Comm
from ..memory import ModelStateMeter
from ..precision.policy import PrecisionPolicy
from .flat_group import FlatParamGroup, GradScaling, GroupMaker
from .inflight import ReductionQueue
from .stage3 import Stage3Runtime, Unit, build_groups
from .stores import DeviceStore, ShardStore

__all__ = ["ForwardSharding", "Unit"]


class ForwardSharding:
    """The units of a forward-only ZeRO-3 model: added one at a time (:meth:`add_unit`, in the
    order of the unit plan, root last), then run (:meth:`start`): each unit is gathered just
    before it runs and released after it, the next ones prefetched within the budgets.

    Args:
        comm: the ranks the slices are spread over.
        device: where the model computes.
        dtype: the parameters' dtype.
        meter: where gathered parameters are counted.
        bucket_numel: the most elements of one flat group.
        store: gives each new group its store (on the device by default).
    """

    def __init__(
        self,
        comm: Comm,
        device: torch.device,
        dtype: torch.dtype,
        meter: ModelStateMeter,
        bucket_numel: int,
        store: Callable[[], ShardStore] | None = None,
    ) -> None:
        precision = PrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        self._make = GroupMaker(comm, device, precision, meter, store or DeviceStore)
        self._bucket_numel = bucket_numel
        self.units: list[Unit] = []
        self._runtime: Stage3Runtime | None = None

    def add_unit(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        fill: Callable[[FlatParamGroup], None],
    ) -> list[FlatParamGroup]:
        """Flat groups over ``module``'s ``params`` (materialised, uninitialised), each
        handed to ``fill`` (which loads this rank's slice: ``FlatParamGroup.load_shard``)."""
        if self._runtime is not None:
            raise RuntimeError("ForwardSharding.add_unit after start()")
        groups = build_groups(params, self._make, self._bucket_numel)
        for g in groups:
            fill(g)
        self.units.append(Unit(module, groups, len(self.units)))
        return groups

    @property
    def groups(self) -> list[FlatParamGroup]:
        return [g for u in self.units for g in u.groups]

    def start(self, prefetch_numel: int, max_live_numel: int) -> None:
        """Install the hooks that gather, release and prefetch the units."""
        self._runtime = Stage3Runtime(
            self.units,
            GradScaling(1.0, 1.0),
            should_reduce=lambda: False,
            prefetch_numel=prefetch_numel,
            max_live_numel=max_live_numel,
            queue=ReductionQueue(None),
        )

    @property
    def peak_live_numel(self) -> int:
        """The most parameter elements gathered at once since :meth:`start` or
        :meth:`reset_peak`."""
        return self._runtime.peak_live_numel if self._runtime is not None else 0

    def reset_peak(self) -> None:
        if self._runtime is not None:
            self._runtime.peak_live_numel = self._runtime.live_numel

    def stop(self) -> None:
        """Remove the hooks."""
        if self._runtime is not None:
            self._runtime.remove_hooks()
