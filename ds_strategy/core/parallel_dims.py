"""How many ranks each parallel dimension has, and where a rank sits among them.

Pure arithmetic: no process group. ``core/layout.py`` builds the groups from it.

[Note: rank order]
The world is ``pp x dp_replicate x dp_shard x cp x sp x tp`` ranks, slowest to fastest.
Tensor-parallel ranks are consecutive: they exchange activations every layer, so they get
the fastest links, inside one machine. Sequence and context ranks come next (they talk at
every attention layer). Then the data ranks: ZeRO shards over ``dp_shard``, replicas over
``dp_replicate``. Pipeline stages vary slowest. Without ``cp`` and ``sp``, global rank
``s*(D*T) + d*T + t`` runs stage ``s`` as data rank ``d`` and tensor rank ``t``. That is
DeepSpeed's ``PipeDataParallelTopology`` with the tensor rank fastest of all.

Expert parallelism is not a factor of the world. It cuts the ``D = dp_replicate x dp_shard``
data ranks of one place into expert groups of ``ep`` consecutive data ranks. The
expert-data group (``"edp"``) holds the ``D / ep`` data ranks with the same place in theirs.

>>> dims = ParallelDims(world=8, pp=2, tp=2)
>>> dims.dp, dims.coordinates(5)["pp"], dims.coordinates(5)["dp"], dims.ranks("dp", 5)
(2, 1, 0, [5, 7])
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import ConfigError

__all__ = ["FACTORS", "GROUPS", "KEYS", "ParallelDims"]

# the dimensions whose sizes multiply to the world, slowest to fastest
FACTORS = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
# every name ``ranks`` takes alone: the factors, and the groups made of them
GROUPS = (*FACTORS, "dp", "ep", "edp", "stage", "world")
# the config key an error names for each size
KEYS = {
    "pp": "pipeline.stages",
    "dp_replicate": "data_parallel_replicate_size",
    "dp_shard": "data_parallel_shard_size",
    "cp": "context_parallel_size",
    "sp": "sequence_parallel_size",
    "tp": "tensor_parallel.autotp_size",
    "ep": "moe.ep_size",
}
_KINDS = {"pp": "pipeline", "cp": "context-parallel", "sp": "sequence-parallel"}
_KINDS |= {"tp": "tensor-parallel"}
# the names that stand for several factors
_COMPOSITE = {"dp": ("dp_replicate", "dp_shard"), "stage": FACTORS[1:], "world": FACTORS}


@dataclass(frozen=True)
class ParallelDims:
    """The size of every parallel dimension of ``world`` ranks, checked.

    ``dp_shard=-1`` means "the rest": the world divided by every other factor. Each size
    that does not fit raises ``ConfigError`` naming its config key.

    Args:
        world: how many ranks the layout covers.
        pp: pipeline stages.
        dp_replicate: data-parallel replicas (HSDP's replicate dimension).
        dp_shard: data-parallel ranks ZeRO shards over, or -1 for the rest.
        cp: context-parallel ranks.
        sp: sequence-parallel ranks.
        tp: tensor-parallel ranks.
        ep: expert-parallel ranks; a divisor of the data ranks, not a factor of the world.

    >>> ParallelDims(world=12, tp=2, dp_replicate=2)
    ParallelDims(world=12, pp=1, dp_replicate=2, dp_shard=3, cp=1, sp=1, tp=2, ep=1)
    """

    world: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        self._check_sizes()
        model = self.pp * self.cp * self.sp * self.tp
        if self.world % model:
            raise self._not_dividing(model)
        data = self.world // model
        if self.dp_shard == -1:
            if data % self.dp_replicate:
                raise self._replicas_not_dividing(data)
            object.__setattr__(self, "dp_shard", data // self.dp_replicate)
        elif self.dp_replicate * self.dp_shard != data:
            raise self._data_mismatch(data)
        if self.dp % self.ep:
            raise ConfigError(
                f"{KEYS['ep']}={self.ep} does not divide the {self.dp} data-parallel ranks: "
                f"expert groups are {self.ep} consecutive data-parallel ranks; choose a "
                f"divisor of {self.dp} ({_divisors(self.dp)})",
                key=KEYS["ep"],
            )

    # -- sizes -------------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """The data-parallel ranks: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage: every factor but ``pp``."""
        return self.world // self.pp

    def size(self, name: str) -> int:
        """How many ranks the group ``name`` has (any name of ``GROUPS``).

        Args:
            name: a factor, or ``"dp"``, ``"ep"``, ``"edp"``, ``"stage"``, ``"world"``.
        """
        if name == "ep":
            return self.ep
        if name == "edp":
            return self.dp // self.ep
        size = 1
        for factor in self._factors((name,)):
            size *= getattr(self, factor)
        return size

    # -- places ------------------------------------------------------------------------------

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits: its index on every factor, and on ``dp``, ``ep``, ``edp``.

        Args:
            rank: a rank of the layout, ``0 <= rank < world``.

        >>> ParallelDims(world=8, tp=2, ep=2).coordinates(5)["dp"]
        2
        """
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of the layout's {self.world} ranks")
        place: dict[str, int] = {}
        rest = rank
        for name in reversed(FACTORS):
            place[name] = rest % getattr(self, name)
            rest //= getattr(self, name)
        out = {name: place[name] for name in FACTORS}
        dp = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return {**out, "dp": dp, "ep": dp % self.ep, "edp": dp // self.ep}

    def rank_of(self, place: Mapping[str, int]) -> int:
        """The rank at ``place`` (an index for every factor; missing ones are 0).

        Args:
            place: factor name -> index, as ``coordinates`` gives them.
        """
        rank = 0
        for name in FACTORS:
            rank = rank * getattr(self, name) + place.get(name, 0)
        return rank

    def ranks(self, dims: str | tuple[str, ...], rank: int) -> list[int]:
        """The ranks that share ``rank``'s place on every dimension not in ``dims``.

        They come in ascending order, which is their order in a process group.

        Args:
            dims: a name of ``GROUPS`` (``"dp"`` is ``dp_replicate x dp_shard``), or a tuple
                of factors and ``"dp"``. ``"ep"`` and ``"edp"`` go alone.
            rank: the rank whose group it is.

        >>> dims = ParallelDims(world=8, tp=2, ep=2)
        >>> dims.ranks("tp", 5), dims.ranks("ep", 5), dims.ranks("edp", 5)
        ([4, 5], [5, 7], [1, 5])
        """
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        if "ep" in names or "edp" in names:
            return self._expert(names, rank)
        varying = self._factors(names)
        here = self.coordinates(rank)
        axes = [range(getattr(self, f)) if f in varying else [here[f]] for f in FACTORS]
        return [self.rank_of(dict(zip(FACTORS, c, strict=True))) for c in itertools.product(*axes)]

    def _expert(self, names: tuple[str, ...], rank: int) -> list[int]:
        if len(names) != 1:
            raise ValueError(f"{names}: 'ep' and 'edp' name a group alone, not with others")
        data = self.ranks("dp", rank)  # by data-parallel index
        dp = self.coordinates(rank)["dp"]
        if names[0] == "ep":
            start = dp // self.ep * self.ep
            return data[start : start + self.ep]
        return data[dp % self.ep :: self.ep]

    def _factors(self, names: tuple[str, ...]) -> set[str]:
        out: set[str] = set()
        for name in names:
            if name not in FACTORS and name not in _COMPOSITE:
                raise ValueError(
                    f"no parallel dimension {name!r}; the layout has {', '.join(GROUPS)}"
                )
            out.update(_COMPOSITE.get(name, (name,)))
        return out

    # -- errors ------------------------------------------------------------------------------

    def _check_sizes(self) -> None:
        if self.world < 1:
            raise ValueError(f"a layout needs at least one rank, not {self.world}")
        for name, key in KEYS.items():
            size = getattr(self, name)
            if size < 1 and not (name == "dp_shard" and size == -1):
                rest = " (or -1 for the rest)" if name == "dp_shard" else ""
                raise ConfigError(
                    f"{key}={size}: a number of ranks must be at least 1{rest}", key=key
                )

    def _not_dividing(self, model: int) -> ConfigError:
        """The error for model-parallel sizes whose product does not divide the world."""
        named = [n for n in ("pp", "cp", "sp", "tp") if getattr(self, n) > 1]
        world, tp, pp = self.world, self.tp, self.pp
        if named == ["tp"]:
            return ConfigError(
                f"{KEYS['tp']}={tp} does not divide the world size {world}: the world is "
                "data-parallel x tensor-parallel ranks; choose a size that divides it or "
                "launch a multiple of it",
                key=KEYS["tp"],
            )
        if named == ["pp"]:
            return ConfigError(
                f"{KEYS['pp']}: the world size {world} is not divisible by {pp} stages; use a "
                f"number of stages dividing {world}, or launch a multiple of {pp} ranks",
                key=KEYS["pp"],
            )
        sizes = " x ".join(f"{KEYS[n]}={getattr(self, n)}" for n in named)
        kinds = [_KINDS[n] for n in named]
        kinds.insert(1 if named[0] == "pp" else 0, "data-parallel")
        return ConfigError(
            f"{sizes} = {model} does not divide the world size {world}: the world is "
            f"{' x '.join(kinds)} ranks; choose sizes whose product divides it or launch a "
            f"multiple of {model} ranks",
            key=KEYS[named[-1]],
        )

    def _replicas_not_dividing(self, data: int) -> ConfigError:
        key = KEYS["dp_replicate"]
        return ConfigError(
            f"{key}={self.dp_replicate} does not divide the {data} data-parallel ranks "
            f"(the world size {self.world} over the other dimensions); choose a divisor of "
            f"{data} ({_divisors(data)})",
            key=key,
        )

    def _data_mismatch(self, data: int) -> ConfigError:
        rep, shard = KEYS["dp_replicate"], KEYS["dp_shard"]
        return ConfigError(
            f"{rep}={self.dp_replicate} x {shard}={self.dp_shard} = "
            f"{self.dp_replicate * self.dp_shard}, but the world size {self.world} leaves "
            f"{data} data-parallel ranks; set {shard} to -1 for the rest, or sizes whose "
            f"product is {data}",
            key=shard,
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
