"""The rank layout (``core/parallel_dims.py``, ``core/layout.py``): every dimension's size
checked against the world with errors naming the config key, each rank's place and groups
by arithmetic alone, the groups a ``RankLayout`` creates on 4 gloo ranks, and a scan of the
package: only the layout creates process groups and device meshes."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_strategy.config import ConfigError
from ds_strategy.core.layout import ParallelDims, RankLayout
from ds_strategy.core.mesh import ParallelMesh
from ds_strategy.core.parallel_dims import FACTORS, GROUPS
from ds_strategy.core.pipeline.mesh import Mesh
from ds_strategy.core.topology import Topology
from tests.distributed import run_ranks_each

PACKAGE = Path(__file__).resolve().parents[1] / "ds_strategy"

# -- arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "tp", "pp"), [(8, 2, 2), (12, 3, 2), (6, 1, 3), (4, 4, 1), (8, 1, 1), (16, 2, 4)]
)
def test_a_place_is_stage_then_data_then_tensor_rank(world: int, tp: int, pp: int) -> None:
    dims = ParallelDims(world, pp=pp, tp=tp)
    d = world // (pp * tp)
    assert dims.dp == dims.dp_shard == d and dims.dp_replicate == 1
    seen = set()
    for s, dp, t in itertools.product(range(pp), range(d), range(tp)):
        rank = s * (d * tp) + dp * tp + t  # the order ParallelMesh and the pipeline's Mesh use
        where = dims.coordinates(rank)
        assert (where["pp"], where["dp"], where["tp"]) == (s, dp, t)
        assert dims.rank_of(where) == rank
        place = ParallelMesh.place(rank, world, tp, pp)
        assert place.coordinates == {"pp": s, "dp": dp, "tp": t} and place.dp == d
        assert Mesh(pp, d, rank, None, None, tp_size=tp).coordinates == place.coordinates
        seen.add(rank)
    assert seen == set(range(world))


def _brute(dims: ParallelDims, name: str, rank: int) -> list[int]:
    """The ranks sharing ``rank``'s place on every dimension outside group ``name``, found
    by comparing coordinates."""
    here = dims.coordinates(rank)
    varying = {
        "dp": {"dp_replicate", "dp_shard"},
        "stage": set(FACTORS[1:]),
        "world": set(FACTORS),
        "ep": {"dp_replicate", "dp_shard"},
        "edp": {"dp_replicate", "dp_shard"},
    }.get(name, {name})
    out = []
    for other in range(dims.world):
        there = dims.coordinates(other)
        if any(there[f] != here[f] for f in FACTORS if f not in varying):
            continue
        if name == "ep" and there["edp"] != here["edp"]:
            continue  # another expert group of the same data ranks
        if name == "edp" and there["ep"] != here["ep"]:
            continue  # another place in the expert groups
        out.append(other)
    return out


@pytest.mark.parametrize(
    "sizes",
    [
        {"world": 8, "pp": 2, "tp": 2},
        {"world": 16, "pp": 2, "dp_replicate": 2, "tp": 2, "ep": 2},
        {"world": 24, "dp_replicate": 2, "cp": 2, "sp": 1, "tp": 3},
        {"world": 16, "sp": 2, "tp": 2, "ep": 4},
        {"world": 6},
    ],
)
def test_every_group_is_the_ranks_that_share_the_other_coordinates(sizes: dict[str, int]) -> None:
    dims = ParallelDims(**sizes)
    for rank, name in itertools.product(range(dims.world), GROUPS):
        ranks = dims.ranks(name, rank)
        assert ranks == _brute(dims, name, rank), (name, rank)
        assert len(ranks) == dims.size(name) and rank in ranks


def test_the_groups_of_one_rank() -> None:
    dims = ParallelDims(world=8, pp=2, tp=2)  # rank 5: stage 1, data rank 0, tensor rank 1
    assert dims.ranks("tp", 5) == [4, 5]
    assert dims.ranks("dp", 5) == dims.ranks("dp_shard", 5) == [5, 7]
    assert dims.ranks("dp_replicate", 5) == dims.ranks("cp", 5) == [5]
    assert dims.ranks("pp", 5) == [1, 5]
    assert dims.ranks("stage", 5) == dims.ranks(("dp", "tp"), 5) == [4, 5, 6, 7]
    assert dims.ranks("world", 5) == list(range(8))
    replicated = ParallelDims(world=8, dp_replicate=2, tp=2)  # dp_shard: the rest, 2
    assert replicated.dp_shard == 2 and replicated.coordinates(6)["dp"] == 3
    assert replicated.ranks("dp_replicate", 6) == [2, 6]
    assert replicated.ranks("dp_shard", 6) == [4, 6]
    assert replicated.ranks("dp", 6) == [0, 2, 4, 6]


def test_expert_groups_cut_the_data_ranks() -> None:
    dims = ParallelDims(world=16, tp=2, ep=4)  # 8 data ranks: expert groups of 4
    assert dims.ranks("ep", 1) == [1, 3, 5, 7] and dims.ranks("ep", 9) == [9, 11, 13, 15]
    assert dims.ranks("edp", 3) == [3, 11] and dims.ranks("edp", 8) == [0, 8]
    assert (dims.coordinates(11)["ep"], dims.coordinates(11)["edp"]) == (1, 1)
    with pytest.raises(ValueError, match="alone"):
        dims.ranks(("ep", "tp"), 0)


@pytest.mark.parametrize(
    ("sizes", "key", "fragment"),
    [
        (
            {"world": 4, "tp": 3},
            "tensor_parallel.autotp_size",
            "tensor_parallel.autotp_size=3 does not divide the world size 4: the world is "
            "data-parallel x tensor-parallel ranks",
        ),
        (
            {"world": 2, "pp": 2, "tp": 2},
            "tensor_parallel.autotp_size",
            "pipeline.stages=2 x tensor_parallel.autotp_size=2 = 4 does not divide the world "
            "size 2: the world is pipeline x data-parallel x tensor-parallel ranks",
        ),
        (
            {"world": 6, "pp": 4},
            "pipeline.stages",
            "pipeline.stages: the world size 6 is not divisible by 4 stages",
        ),
        (
            {"world": 8, "cp": 3},
            "context_parallel_size",
            "context_parallel_size=3 = 3 does not divide the world size 8",
        ),
        (
            {"world": 8, "sp": 2, "tp": 3},
            "tensor_parallel.autotp_size",
            "sequence_parallel_size=2 x tensor_parallel.autotp_size=3 = 6 does not divide",
        ),
        (
            {"world": 8, "dp_replicate": 3},
            "data_parallel_replicate_size",
            "data_parallel_replicate_size=3 does not divide the 8 data-parallel ranks",
        ),
        (
            {"world": 8, "dp_replicate": 2, "dp_shard": 3},
            "data_parallel_shard_size",
            "data_parallel_shard_size=3 = 6, but the world size 8 leaves 8 data-parallel",
        ),
        (
            {"world": 8, "tp": 2, "ep": 3},
            "moe.ep_size",
            "moe.ep_size=3 does not divide the 4 data-parallel ranks",
        ),
        ({"world": 8, "tp": 0}, "tensor_parallel.autotp_size", "must be at least 1"),
        ({"world": 8, "dp_shard": -2}, "data_parallel_shard_size", "or -1 for the rest"),
        ({"world": 8, "ep": 0}, "moe.ep_size", "must be at least 1"),
    ],
)
def test_sizes_that_do_not_fit_the_world_name_their_key(
    sizes: dict[str, int], key: str, fragment: str
) -> None:
    with pytest.raises(ConfigError, match=key) as info:
        ParallelDims(**sizes)
    assert info.value.key == key and fragment in str(info.value)


def test_what_the_engines_said_before_is_said_the_same_way() -> None:
    # ParallelMesh.data_parallel_size (the engines' check) and the pipeline's Mesh.build
    with pytest.raises(ValueError, match=r"autotp_size=4 does not divide the world size 1"):
        ParallelMesh.data_parallel_size(1, 4)
    assert ParallelMesh.data_parallel_size(12, 3, 2) == 2


def test_a_layout_refuses_what_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError, match="a layout of 2 ranks over a group of 1"):
        RankLayout(ParallelDims(world=2))
    layout = RankLayout(ParallelDims(world=1))
    with pytest.raises(ValueError, match="in the order pp, dp_replicate"):
        layout.device_mesh("cpu", ("tp", "dp"))
    with pytest.raises(ValueError, match="no parallel dimension 'xp'"):
        layout.group("xp")
    with pytest.raises(ValueError, match="rank 4 is not one of the layout's 4 ranks"):
        ParallelDims(world=4).coordinates(4)


def test_a_world_of_one_has_every_group_without_torch_distributed() -> None:
    layout = RankLayout(ParallelDims(world=1))
    for name in GROUPS:
        comm = layout.comm(name)
        assert (comm.world_size, comm.rank, comm.global_ranks()) == (1, 0, [0])
    assert layout.machine_levels(layout.comm("dp")) is None
    assert layout.cross_stage([0]) is not None and layout.cross_stage([1]) is None


# -- groups on 4 ranks -------------------------------------------------------------------------


def _ranks_of(comm: Any) -> list[int]:
    return list(comm.global_ranks())


def _name(group: dist.ProcessGroup | None) -> str:
    assert group is not None
    return group.group_name


def _layout_worker(rank: int, world: int) -> dict[str, Any]:
    """A RankLayout of 4 ranks with tp=2 (and expert groups of 2) on 2 machines of 2, and
    one with 2 pipeline stages of tp=2: every group's ranks, link and group rank."""
    layout = RankLayout.over(topology=Topology(4, 2), tp=2, ep=2)
    out: dict[str, Any] = {"coordinates": layout.coordinates}
    for name in GROUPS:
        comm = layout.comm(name)
        total = torch.tensor([float(rank)])
        comm.all_reduce(total)  # the group really holds these ranks
        out[name] = (_ranks_of(comm), comm.link, comm.rank, float(total))
    again = layout.comm("tp")
    out["cached"] = again.group is layout.group("tp") and again is not layout.comm("tp")
    mesh = layout.device_mesh("cpu")
    out["mesh"] = (
        mesh.mesh_dim_names,
        list(mesh.get_coordinate() or []),
        mesh["tp"].get_group().group_name == _name(layout.group("tp")),
        mesh["dp"].get_group().group_name == _name(layout.group("dp")),
        layout.device_mesh("cpu") is mesh,
    )
    whole = layout.comm("world")
    levels = layout.machine_levels(whole)
    assert levels is not None
    out["levels"] = [(_ranks_of(c), c.link, c.parent is whole) for c in levels]
    block = layout.blocks(whole, 2)
    replica = layout.strided(whole, 2, parent=block)
    out["blocks"] = (_ranks_of(block), block.link, block.parent is whole)
    out["strided"] = (_ranks_of(replica), replica.link, replica.parent is block)
    side = RankLayout.side(whole)
    out["side"] = (_ranks_of(side), dist.get_backend(side.group), side.link == whole.link)
    pipeline = RankLayout.over(pp=2, tp=2)
    out["pipeline"] = {name: _ranks_of(pipeline.comm(name)) for name in ("pp", "dp", "tp", "stage")}
    out["pipeline_mesh"] = pipeline.device_mesh("cpu").mesh_dim_names
    tied = pipeline.cross_stage([0, 1])
    out["cross_stage"] = _ranks_of(tied) if tied is not None else None
    return out


def _engine_worker(rank: int, world: int) -> dict[str, Any]:
    """An engine's ranks (``EngineBuilder.lay_out``) under MiCS, and under tp=2."""
    from ds_strategy.core.assembly import EngineBuilder, LoopHooks
    from ds_strategy.core.collectives import Comm
    from ds_strategy.demos.gpt import GPT, GPTConfig

    hooks = LoopHooks(lambda: True, lambda: True, lambda: 1.0, lambda: 0, lambda: 0)
    out: dict[str, Any] = {}
    for name, extra in (
        ("mics", {"zero_optimization": {"stage": 2, "mics_shard_size": 2}}),
        ("tp", {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}),
    ):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab=16, d=32, layers=1, heads=4, seq=8))
        config = {**extra, "topology": {"ranks_per_machine": 2}}
        builder = EngineBuilder(
            model, config, Comm(None), process_group=None, pipeline_stage=None, loop=hooks
        )
        ranks = builder.lay_out()
        tp = ranks.tensor_parallel
        out[name] = {
            "dims": (ranks.layout.dims.dp, ranks.layout.dims.tp),
            "comm": (_ranks_of(ranks.comm), ranks.comm.link),
            "shard": _ranks_of(ranks.shard_comm),
            "replica": None if ranks.replica is None else _ranks_of(ranks.replica),
            "replica_is_mics": ranks.replica is getattr(ranks.shard_comm, "replica", None),
            "tp": None if tp is None else (_ranks_of(tp.comm), tp.comm.link),
            "mesh": (ranks.mesh.coordinates, ranks.mesh.layout is ranks.layout),
        }
    return out


@pytest.fixture(scope="module")
def four_ranks() -> tuple[list[Any], list[Any]]:
    """The layouts' and the engines' 4-rank runs, in one spawn."""
    layouts, engines = run_ranks_each([(_layout_worker, ()), (_engine_worker, ())], 4)
    return layouts, engines


@pytest.mark.slow  # 4 ranks, both runs in one spawn of about 25 s
def test_an_engine_takes_its_groups_and_mics_replicas_from_its_layout(
    four_ranks: tuple[list[Any], list[Any]],
) -> None:
    for rank, r in enumerate(four_ranks[1]):
        machine, peers = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        mics = r["mics"]
        assert mics["dims"] == (4, 1) and mics["comm"] == ([0, 1, 2, 3], "inter")
        assert mics["shard"] == machine and mics["replica"] == peers
        assert mics["replica_is_mics"] and mics["tp"] is None
        assert mics["mesh"] == ({"pp": 0, "dp": rank, "tp": 0}, True)
        tp = r["tp"]
        assert tp["dims"] == (2, 2) and tp["comm"] == (peers, "inter")
        assert tp["shard"] == peers and tp["replica"] is None
        assert tp["tp"] == (machine, "intra")
        assert tp["mesh"] == ({"pp": 0, "dp": rank // 2, "tp": rank % 2}, True)


@pytest.mark.slow  # 4 ranks, both runs in one spawn of about 25 s
def test_a_layout_on_four_ranks_creates_every_named_group(
    four_ranks: tuple[list[Any], list[Any]],
) -> None:
    results = four_ranks[0]
    expected = {  # rank -> group -> ranks, for tp=2 x dp=2 (expert groups of both data ranks)
        "world": lambda r: [0, 1, 2, 3],
        "tp": lambda r: [r - r % 2, r - r % 2 + 1],
        "dp": lambda r: [r % 2, r % 2 + 2],
        "dp_shard": lambda r: [r % 2, r % 2 + 2],
        "ep": lambda r: [r % 2, r % 2 + 2],
        "stage": lambda r: [0, 1, 2, 3],
        "edp": lambda r: [r],
        "pp": lambda r: [r],
        "dp_replicate": lambda r: [r],
        "cp": lambda r: [r],
        "sp": lambda r: [r],
    }
    for rank, r in enumerate(results):
        assert r["coordinates"]["tp"] == rank % 2 and r["coordinates"]["dp"] == rank // 2
        for name, ranks_of in expected.items():
            ranks, link, group_rank, total = r[name]
            assert ranks == ranks_of(rank), (rank, name)
            assert group_rank == ranks.index(rank) and total == sum(ranks)
            # machines of 2 ranks: only a group holding ranks of both crosses them
            assert link == ("inter" if {q // 2 for q in ranks} == {0, 1} else "intra")
        assert r["coordinates"]["dp"] == r["dp"][2] and r["coordinates"]["tp"] == r["tp"][2]
        assert r["cached"]
        assert r["mesh"] == (("dp", "tp"), [rank // 2, rank % 2], True, True, True)
        machine = [rank - rank % 2, rank - rank % 2 + 1]
        assert r["levels"] == [(machine, "intra", True), ([rank % 2, rank % 2 + 2], "inter", True)]
        assert r["blocks"] == (machine, "intra", True)
        assert r["strided"] == ([rank % 2, rank % 2 + 2], "inter", True)
        assert r["side"] == ([0, 1, 2, 3], "gloo", True)
        assert r["pipeline"] == {
            "pp": [rank % 2, rank % 2 + 2],
            "dp": [rank],
            "tp": machine,
            "stage": machine,
        }
        assert r["pipeline_mesh"] == ("pp", "dp", "tp")
        assert r["cross_stage"] == [rank % 2, rank % 2 + 2]


# -- only the layout creates groups ----------------------------------------------------------

# what creates a process group or a device mesh in torch
_CREATORS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group"}
_CREATORS |= {"init_device_mesh", "from_group", "DeviceMesh"}
_PRIMITIVES = {"_create_group", "_create_device_mesh"}


def _uses(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(name, enclosing function, line) of every creator and primitive named in ``tree``;
    ``DeviceMesh`` counts only when called (a type annotation creates nothing)."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        if name == "DeviceMesh":
            name = None  # see the Call case
        if isinstance(node, ast.Call):
            callee = node.func
            called = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", None)
            if called == "DeviceMesh":
                name = "DeviceMesh"
        if name in _CREATORS or name in _PRIMITIVES:
            found.append((str(name), func, getattr(node, "lineno", 0)))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def test_only_the_layout_creates_process_groups_and_device_meshes() -> None:
    misplaced = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for name, func, line in _uses(ast.parse(path.read_text(), str(path))):
            inside = where == "core/collectives.py" and func in _PRIMITIVES
            if inside and (name in _CREATORS or name == func):
                continue  # torch's calls inside the primitives, or their own names
            if where == "core/layout.py" and name in _PRIMITIVES:
                continue  # the primitives' only caller
            misplaced.append(f"{where}:{line} {name} in {func}")
    assert misplaced == []
    text = (PACKAGE / "core" / "collectives.py").read_text()
    assert "def _create_group(" in text and "def _create_device_mesh(" in text
    layout = (PACKAGE / "core" / "layout.py").read_text()
    assert "_create_group(" in layout and "_create_device_mesh(" in layout


def test_the_scan_sees_a_group_created_elsewhere() -> None:
    """The scan above on code that breaks the rule, so a scan that finds nothing fails."""
    bad = ast.parse(
        "import torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh, DeviceMesh\n"
        "def f(m: DeviceMesh):\n"
        "    dist.new_group([0])\n"
        "    DeviceMesh('cpu', [0])\n"
        "    _create_group([0])\n"
    )
    names = sorted(name for name, _, _ in _uses(bad))
    assert names == ["DeviceMesh", "_create_group", "init_device_mesh", "new_group"]
