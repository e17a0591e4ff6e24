"""The rank layout: every parallel dimension's size, and every process group built from it.

[Note: one rank layout]
A :class:`RankLayout` is the only code that creates process groups and device meshes. It
calls the two private primitives of ``collectives.py`` (``_create_group``,
``_create_device_mesh``); nothing else does. Features ask it for what they need:

- a named group of its dimensions: ``comm("tp")``, ``comm("dp")``, ``comm("stage")``...
  (see ``ParallelDims`` for the rank order). Each is created on first use and cached;
  each ``comm`` call wraps it in a new ``Comm``, so byte counts stay per user;
- the torch ``DeviceMesh`` over ``("pp",) "dp", "tp"`` that DTensor's layers use, made
  once, from those same groups (it creates none of its own);
- sub-groups of any ``Comm``, since an engine may run on a user's group: the two levels of
  hierarchical collectives (``machine_levels``), hpZ's block and MiCS's shard group
  (``blocks``), MiCS's replica group (``strided``), pipeline tied-weight groups
  (``cross_stage``), and a gloo twin for background threads (``side``).

Each group is created by its members only (``use_local_synchronization``), in the same
order on each. A ``Comm``'s link comes from the machine ``Topology`` (``core/topology.py``
still detects it): ``comm_report()`` files its bytes by it. A level of a composed
collective counts into its ``parent`` too (see [Note: byte accounting] in collectives).

>>> layout = RankLayout(ParallelDims(world=1))
>>> layout.comm("dp").world_size, layout.global_ranks("tp")
(1, [0])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .collectives import Comm, _create_device_mesh, _create_group
from .parallel_dims import FACTORS, ParallelDims
from .topology import Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "RankLayout"]


class RankLayout:
    """The parallel dimensions of ``base``'s ranks, this rank's place, and their groups.

    Args:
        dims: the sizes, over ``base``'s ranks (``dims.world`` is its size).
        topology: which ranks share a machine; one machine by default.
        base: the group the layout cuts up (default: every rank of the job).

    >>> RankLayout(ParallelDims(world=1)).coordinates["tp"]
    0
    """

    def __init__(
        self, dims: ParallelDims, topology: Topology | None = None, base: Comm | None = None
    ) -> None:
        self.base = base if base is not None else Comm()
        if dims.world != self.base.world_size:
            raise ValueError(
                f"a layout of {dims.world} ranks over a group of {self.base.world_size}"
            )
        self.dims = dims
        self.rank = self.base.rank
        self._members = self.base.global_ranks()
        if topology is None:
            job = Comm().world_size
            topology = Topology(job, job)
        self.topology = topology
        self._groups: dict[str | tuple[str, ...], dist.ProcessGroup | None] = {}
        self._meshes: dict[tuple[str, tuple[str, ...]], DeviceMesh] = {}

    @staticmethod
    def over(
        comm: Comm | None = None, topology: Topology | None = None, **sizes: int
    ) -> RankLayout:
        """The layout of ``comm``'s ranks (default: the job's) with these ``sizes``.

        Args:
            comm: the group to lay out.
            topology: which ranks share a machine; one machine by default.
            **sizes: ``ParallelDims``' sizes (``tp=2``, ``pp=2``...); the rest data-parallel.
        """
        base = comm if comm is not None else Comm()
        return RankLayout(ParallelDims(base.world_size, **sizes), topology, base)

    def place_on(self, topology: Topology) -> None:
        """Where the ranks sit on machines from now on: links and machine levels follow it.

        A pipeline lays its ranks out before its stage's engine reads the machines.

        Args:
            topology: the job's machines (``Topology.detect``).
        """
        self.topology = topology

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's place on every dimension (see ``ParallelDims.coordinates``)."""
        return self.dims.coordinates(self.rank)

    def global_ranks(self, name: str | tuple[str, ...]) -> list[int]:
        """The job's ranks in this rank's group ``name``, in group order.

        Args:
            name: a name of ``ParallelDims``' groups (``"tp"``, ``"dp"``, ``"stage"``...),
                or a tuple of factors and ``"dp"`` (``("cp", "sp")``).
        """
        return [self._members[r] for r in self.dims.ranks(name, self.rank)]

    # -- named groups ------------------------------------------------------------------------

    def group(self, name: str | tuple[str, ...]) -> dist.ProcessGroup | None:
        """This rank's process group ``name``, created on first use (by its members).

        Args:
            name: ``"world"`` (``base``'s own group), a factor, ``"dp"``, ``"ep"``,
                ``"edp"``, ``"stage"`` (the ranks of this pipeline stage), or a tuple of
                factors and ``"dp"``.
        """
        if name == "world":
            return self.base.group
        if name not in self._groups:
            self._groups[name] = _create_group(self.global_ranks(name))
        return self._groups[name]

    def comm(
        self, name: str | tuple[str, ...], *, on_scratch: Callable[[int], None] | None = None
    ) -> Comm:
        """A new ``Comm`` over the group ``name``, its link from the topology.

        Args:
            name: as for ``group``.
            on_scratch: told the scratch bytes of its composed collectives (``Comm``).
        """
        link = self.topology.link(self.global_ranks(name))
        return Comm(self.group(name), link=link, on_scratch=on_scratch)

    def device_mesh(self, device_type: str, dims: tuple[str, ...] | None = None) -> DeviceMesh:
        """torch's ``DeviceMesh`` over this layout's groups, made once per ``dims``.

        Args:
            device_type: ``"cpu"`` or ``"cuda"``.
            dims: its dimensions in rank order: factors or ``"dp"``. By default
                ``("pp",) "dp", ("cp",) ("sp",) "tp"`` (pp, cp, sp only when above 1).
        """
        names = dims if dims is not None else self._mesh_dims()
        key = (device_type, names)
        if key not in self._meshes:
            self._check_mesh_dims(names)
            groups = [self.group(n) for n in names]
            if any(g is None for g in groups):
                raise RuntimeError("a device mesh needs torch.distributed initialised")
            shape = [self.dims.size(n) for n in names]
            ranks = torch.tensor(self._members, dtype=torch.int).view(shape)
            live = [g for g in groups if g is not None]
            self._meshes[key] = _create_device_mesh(device_type, live, ranks, names)
        return self._meshes[key]

    def _mesh_dims(self) -> tuple[str, ...]:
        sizes = self.dims
        return (
            *(("pp",) if sizes.pp > 1 else ()),
            "dp",
            *(("cp",) if sizes.cp > 1 else ()),
            *(("sp",) if sizes.sp > 1 else ()),
            "tp",
        )

    def _check_mesh_dims(self, names: tuple[str, ...]) -> None:
        """The mesh is ``base``'s ranks in its shape: its dimensions must cover every factor
        above 1, in rank order."""
        covered = [f for n in names for f in (("dp_replicate", "dp_shard") if n == "dp" else (n,))]
        needed = [f for f in FACTORS if getattr(self.dims, f) > 1]
        in_order = [f for f in FACTORS if f in covered]
        if covered != in_order or not set(needed) <= set(covered):
            raise ValueError(
                f"a device mesh over {names} does not lay out {self.dims}: name every "
                f"dimension above 1 ({', '.join(needed)}), in the order {', '.join(FACTORS)}"
            )

    # -- sub-groups of a given Comm ----------------------------------------------------------

    def machine_levels(self, comm: Comm) -> tuple[Comm, Comm] | None:
        """The two levels of hierarchical collectives over ``comm`` (``core/hierarchical.py``).

        The first is this rank's machine, the second its peers with the same place on
        theirs; each counts into ``comm``. ``None`` when ``comm`` lies within one machine,
        or has one rank on each. Collective over ``comm``.

        Args:
            comm: the group to split, numbered machine by machine.
        """
        ranks = comm.global_ranks()
        by_machine: dict[int, list[int]] = {}
        for r in ranks:
            by_machine.setdefault(self.topology.machine_of(r), []).append(r)
        sizes = {len(v) for v in by_machine.values()}
        if len(by_machine) == 1 or sizes == {1}:
            return None
        if len(sizes) > 1 or ranks != sorted(ranks):
            raise ValueError(
                f"hierarchical collectives: the group of ranks {ranks} has "
                f"{sorted(len(v) for v in by_machine.values())} ranks on its machines; they "
                "need the same number on each, numbered machine by machine"
            )
        me = ranks[comm.rank]
        mine = by_machine[self.topology.machine_of(me)]
        local = mine.index(me)
        peers = [v[local] for _, v in sorted(by_machine.items())]
        intra = Comm(_create_group(mine), link="intra", parent=comm)
        inter = Comm(_create_group(peers), link="inter", parent=comm)
        return intra, inter

    def blocks(self, comm: Comm, size: int, *, parent: Comm | None = None) -> Comm:
        """This rank's block of ``size`` consecutive ranks of ``comm``.

        hpZ's secondary group and MiCS's shard group. Collective over ``comm``.

        Args:
            comm: the group to cut; ``size`` divides its ranks.
            size: ranks per block.
            parent: where its bytes count too (default: ``comm``).
        """
        ranks = comm.global_ranks()
        start = comm.rank // size * size
        return self._sub(ranks[start : start + size], comm if parent is None else parent)

    def strided(self, comm: Comm, size: int, *, parent: Comm | None = None) -> Comm:
        """The ranks of ``comm`` with this rank's place in their block of ``size``.

        MiCS's replica group. Collective over ``comm``.

        Args:
            comm: the group to cut; ``size`` divides its ranks.
            size: ranks per block.
            parent: where its bytes count too (default: ``comm``).
        """
        ranks = comm.global_ranks()
        return self._sub(ranks[comm.rank % size :: size], comm if parent is None else parent)

    def _sub(self, ranks: list[int], parent: Comm) -> Comm:
        return Comm(_create_group(ranks), link=self.topology.link(ranks), parent=parent)

    def cross_stage(self, stages: list[int]) -> Comm | None:
        """The ranks with this rank's place in its stage, on each of ``stages``.

        A weight tied across pipeline stages keeps its copies in step over it.
        ``None`` on a rank that runs none of ``stages``. Collective over the ranks of
        ``stages``, in the same order on each.

        Args:
            stages: pipeline stages, ascending (group rank 0 is the first).
        """
        per = self.dims.stage_size
        stage, lane = divmod(self.rank, per)
        if stage not in stages:
            return None
        ranks = [self._members[s * per + lane] for s in stages]
        return Comm(_create_group(ranks), link=self.topology.link(ranks))

    @staticmethod
    def side(comm: Comm) -> Comm:
        """A gloo twin of ``comm`` for collectives issued from another thread.

        A background checkpoint write must not interleave with ``comm``'s own
        collectives. Collective: every rank of ``comm`` calls it.

        Args:
            comm: the group to twin.
        """
        if comm.world_size == 1:
            return Comm(comm.group)
        return Comm(_create_group(comm.global_ranks(), backend="gloo"), link=comm.link)
