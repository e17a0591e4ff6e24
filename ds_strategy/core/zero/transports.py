"""How a flat group's shards travel between ranks, chosen when the group is built.

[Note: a group's transport]
A ``FlatParamGroup`` moves its data three ways: stage 3 all-gathers its parameters before they
are used, a trainable group reduce-scatters its gradients (stage 0 all-reduces them), and
stages 1/2 all-gather the updated slices after the step. Which collectives carry the first
two is decided once, from the config and the topology, and handed to the group with its
``Transport``; nothing changes it afterwards.

- plain: the group's comm, whatever it is (flat, the two-level ``HierarchicalComm`` of
  ``topology.hierarchical``, a MiCS shard group's ``MiCSComm``): such a comm composes its
  own levels, so the group never needs to know;
- ZeRO++ qwZ (``zero_quantized_weights``): stage 3's gathers from the primary shards send int8
  blocks (``quantized.py``);
- ZeRO++ qgZ (``zero_quantized_gradients``): stage 3's gradient reduce-scatters send int8
  blocks, in two levels whenever the ranks span machines, as DeepSpeed's qgZ does even
  without ``topology.hierarchical``;
- ZeRO++ hpZ (``zero_hpz_partition_size``): a secondary shard inside the machine serves the
  gathers after the first one of a step (see [Note: hpZ's secondary shard] in flat_params.py).

Each path is a small object that carries its comm and returns the collective in flight
(``Gather``, ``Work``), in the style of ``inflight.py``. hpZ's and qgZ's groups come from the
engine's rank layout (``core/layout.py``), the only code that creates groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ...config import ZeroConfig
from ..collectives import Comm, Work
from ..hierarchical import HierarchicalComm
from ..layout import RankLayout
from .inflight import Gather
from .quantized import quantized_all_gather, quantized_reduce_scatter

__all__ = [
    "GatherPath",
    "PlainGather",
    "PlainReduceScatter",
    "QuantizedGather",
    "QuantizedReduceScatter",
    "ReducePath",
    "Transport",
    "hpz_comm",
    "stage3_transport",
]


class GatherPath(Protocol):
    """Fills a group's full buffer from every rank's shard."""

    @property
    def comm(self) -> Comm: ...

    def __call__(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Gather: ...


class ReducePath(Protocol):
    """Sums a group's full-size gradients over the ranks, this rank's slice into ``out``."""

    @property
    def comm(self) -> Comm: ...

    def __call__(self, out: torch.Tensor, full: torch.Tensor) -> Work: ...


@dataclass(frozen=True)
class PlainGather:
    comm: Comm

    def __call__(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Gather:
        return Gather(self.comm.all_gather(full, shard, async_op=async_op), shard)


@dataclass(frozen=True)
class QuantizedGather:
    """ZeRO++ qwZ: the shards travel as int8 blocks, held (and counted) until the gather
    completes."""

    comm: Comm

    def __call__(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Gather:
        work, held = quantized_all_gather(self.comm, full, shard, async_op)
        return Gather(work, shard, scratch=held)


@dataclass(frozen=True)
class PlainReduceScatter:
    comm: Comm

    def __call__(self, out: torch.Tensor, full: torch.Tensor) -> Work:
        return self.comm.reduce_scatter(out, full, async_op=True)


@dataclass(frozen=True)
class QuantizedReduceScatter:
    """ZeRO++ qgZ over ``comm`` (two levels when it is a ``HierarchicalComm``); completes
    before it returns."""

    comm: Comm

    def __call__(self, out: torch.Tensor, full: torch.Tensor) -> Work:
        return quantized_reduce_scatter(self.comm, out, full)


@dataclass(frozen=True)
class Transport:
    """A flat group's gather and reduce paths, and hpZ's machine-local group (``secondary``,
    None without hpZ)."""

    gather: GatherPath
    reduce: ReducePath
    secondary: Comm | None = None

    @staticmethod
    def plain(comm: Comm) -> Transport:
        return Transport(PlainGather(comm), PlainReduceScatter(comm))

    def gather_secondary(self, full: torch.Tensor, part: torch.Tensor, async_op: bool) -> Gather:
        """hpZ: fill ``full`` from the secondary shards of this rank's machine."""
        assert self.secondary is not None
        return Gather(self.secondary.all_gather(full, part, async_op=async_op), part)


def hpz_comm(comm: Comm, size: int, layout: RankLayout) -> Comm | None:
    """ZeRO++ hpZ's group: this rank's block of ``size`` consecutive group ranks.

    One machine, when ``size`` is the ranks per machine; its link from the layout's
    topology. ``None`` for ``size`` 1 or the whole group (nothing to save; ``size`` divides
    the group's ranks: a rule of config/rules.py). Collective.

    Args:
        comm: the group stage 3 shards over.
        size: ``zero_hpz_partition_size``.
        layout: the rank layout, which creates the group (``RankLayout.blocks``).
    """
    if size == 1 or size >= comm.world_size:
        return None
    return layout.blocks(comm, size)


def _two_level(comm: Comm, layout: RankLayout) -> Comm:
    """``comm`` in two levels (its bytes still ``comm``'s) when its ranks span machines;
    ``comm`` itself when it already is, or lies within one machine. Collective."""
    if isinstance(comm, HierarchicalComm):
        return comm
    two = HierarchicalComm.build(comm.group, layout, parent=comm)
    return two if isinstance(two, HierarchicalComm) else comm


def stage3_transport(comm: Comm, config: ZeroConfig, layout: RankLayout | None) -> Transport:
    """The transport of stage 3's unit groups over ``comm``: ZeRO++'s paths as
    ``zero_optimization`` configures them (see the note). Collective: hpZ's and qgZ's groups.

    Args:
        comm: the group stage 3 shards over.
        config: the engine's config.
        layout: the engine's rank layout, which creates the groups and knows the machines;
            None: one over ``comm``, on one machine.
    """
    zc = config.zero_optimization
    layout = layout if layout is not None else RankLayout.over(comm)
    secondary = hpz_comm(comm, zc.zero_hpz_partition_size, layout)
    gather: GatherPath = QuantizedGather(comm) if zc.zero_quantized_weights else PlainGather(comm)
    reduce: ReducePath = PlainReduceScatter(comm)
    if zc.zero_quantized_gradients:
        reduce = QuantizedReduceScatter(_two_level(comm, layout))
    return Transport(gather, reduce, secondary)
