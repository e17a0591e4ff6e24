"""Which ranks share a machine: the split every topology-aware collective is built on.

[Note: where ranks per machine come from]
In order, the first that is set:

1. the config's ``topology.ranks_per_machine`` (a single machine can then pose as several,
   to test and measure what crosses machines);
2. ``LOCAL_WORLD_SIZE`` (torchrun and ``accelerate launch``: the ranks its agent on this
   machine started; ``torchrun --nnodes=2 --nproc-per-node=2`` with two agents on one host
   simulates two machines);
3. SLURM's ``SLURM_NTASKS_PER_NODE``, or the first count of ``SLURM_TASKS_PER_NODE``
   (``"4(x2)"``), when SLURM started the ranks (``SLURM_NTASKS`` is the world size: a single
   process inside an allocation of many tasks is one machine);
4. otherwise every rank is on one machine.

Ranks are taken to be numbered machine by machine, as torchrun and SLURM's block
distribution number them: rank ``r`` is on machine ``r // ranks_per_machine``. Launchers
tell each rank its machine (``GROUP_RANK`` / ``SLURM_NODEID``) and its place on it
(``LOCAL_RANK``); where they say otherwise the layout is refused rather than guessed, since
every collective built on it would mix machines up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """``world`` ranks, ``ranks_per_machine`` on each machine, numbered machine by machine.

    >>> t = Topology(world=4, ranks_per_machine=2)
    >>> t.machines, t.machine_of(3), t.spans([0, 1]), t.spans([0, 2])
    (2, 1, False, True)
    """

    world: int
    ranks_per_machine: int

    def __post_init__(self) -> None:
        if self.ranks_per_machine < 1 or self.world % self.ranks_per_machine:
            raise ValueError(
                f"topology: {self.world} ranks do not split into machines of "
                f"{self.ranks_per_machine} ranks each; set topology.ranks_per_machine to a "
                f"divisor of the world size ({_divisors(self.world)}), or launch the same "
                "number of ranks on every machine"
            )

    @property
    def machines(self) -> int:
        return self.world // self.ranks_per_machine

    def machine_of(self, rank: int) -> int:
        return rank // self.ranks_per_machine

    def spans(self, ranks: Iterable[int]) -> bool:
        """Whether a group of these global ranks has members on more than one machine."""
        return len({self.machine_of(r) for r in ranks}) > 1

    def link(self, ranks: Iterable[int]) -> str:
        """``"inter"`` for a group spanning machines, else ``"intra"``: the link its
        collectives' bytes are counted under (see [Note: byte accounting] in collectives)."""
        return "inter" if self.spans(ranks) else "intra"

    @staticmethod
    def detect(
        world: int, rank: int, override: int | None = None, env: Mapping[str, str] | None = None
    ) -> Topology:
        """The topology of this job, from ``override`` or the launcher's variables (see the
        note); ``env`` defaults to ``os.environ``.

        >>> Topology.detect(8, 5, env={"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"})
        Topology(world=8, ranks_per_machine=4)
        """
        import os

        env = os.environ if env is None else env
        if override is not None:
            return Topology(world, int(override))
        if world == 1:
            return Topology(1, 1)
        per, source = _from_launcher(env, world)
        if per is None:
            return Topology(world, world)
        topology = Topology(world, per)
        _check_numbering(topology, rank, env, source)
        return topology


def _from_launcher(env: Mapping[str, str], world: int) -> tuple[int | None, str]:
    if env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    if env.get("SLURM_NTASKS") != str(world):
        return None, ""  # SLURM did not start these ranks (or there is no SLURM)
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"]), "SLURM_NTASKS_PER_NODE"
    tasks = env.get("SLURM_TASKS_PER_NODE")
    if tasks:
        counts = [int(c) for c in re.findall(r"(\d+)(?:\(x\d+\))?", tasks)]
        if len(set(counts)) > 1:
            raise ValueError(
                f"topology: SLURM_TASKS_PER_NODE={tasks!r} starts a different number of ranks "
                "on different machines; launch the same number on each (--ntasks-per-node), "
                "or set topology.ranks_per_machine"
            )
        return counts[0], "SLURM_TASKS_PER_NODE"
    return None, ""


def _check_numbering(topology: Topology, rank: int, env: Mapping[str, str], source: str) -> None:
    """The launcher's own word on this rank's machine and local rank must agree with the
    machine-by-machine numbering."""
    per = topology.ranks_per_machine
    said = {
        "machine": env.get("GROUP_RANK") or env.get("SLURM_NODEID"),
        "local rank": env.get("LOCAL_RANK") or env.get("SLURM_LOCALID"),
    }
    expected = {"machine": rank // per, "local rank": rank % per}
    for what, value in said.items():
        if value not in (None, "") and int(value) != expected[what]:
            raise ValueError(
                f"topology: rank {rank} is on {what} {value} by the launcher, but {source}="
                f"{per} numbers ranks machine by machine (rank {rank} -> {what} "
                f"{expected[what]}); launch with contiguous ranks per machine (torchrun does; "
                "under SLURM use --distribution=block), or set topology.ranks_per_machine"
            )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
