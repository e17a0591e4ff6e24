"""What a flat group is built with, read from the package's source and checked on one process:
its transport and store are chosen when it is built and nothing sets them afterwards, zero
never imports compression, and inference runs ZeRO-3 through zero's public seam only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_strategy.core.collectives import Comm
from ds_strategy.core.memory import ModelStateMeter
from ds_strategy.core.precision.policy import PrecisionPolicy
from ds_strategy.core.zero.flat_group import FlatParamGroup, GroupMaker, GroupPolicy
from ds_strategy.core.zero.forward import ForwardSharding
from ds_strategy.core.zero.stores import DeviceStore
from ds_strategy.core.zero.transports import (
    PlainGather,
    PlainReduceScatter,
    QuantizedGather,
    Transport,
)

PACKAGE = Path(__file__).resolve().parents[1] / "ds_strategy"
STAGE3 = GroupPolicy(shard_optimizer=True, shard_grads=True, shard_params=True)
GROUP_NAMES = {"g", "group", "grp"}  # how the package names a flat group


def _trees(folder: Path) -> dict[Path, ast.AST]:
    return {p: ast.parse(p.read_text()) for p in sorted(folder.rglob("*.py"))}


def _group_attributes() -> set[str]:
    """Every attribute ``FlatParamGroup`` sets on itself."""
    tree = ast.parse((PACKAGE / "core" / "zero" / "flat_group.py").read_text())
    cls = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "FlatParamGroup"
    )
    out = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                owner = el.value if isinstance(el, ast.Attribute) else None
                if isinstance(owner, ast.Name) and owner.id == "self":
                    out.add(el.attr)  # type: ignore[union-attr]
    return out


def _assigned_attributes(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, owner, attribute) of every ``owner.attribute = ...`` and
    ``setattr(owner, "attribute", ...)`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute):
                    owner = el.value
                    name = owner.id if isinstance(owner, ast.Name) else ast.unparse(owner)
                    out.append((node.lineno, name, el.attr))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            owner, attr = node.args[0], node.args[1]
            if isinstance(attr, ast.Constant):
                out.append((node.lineno, ast.unparse(owner), str(attr.value)))
    return out


def test_the_walker_sees_assignments_and_setattr() -> None:
    tree = ast.parse("g.store = s\nsetattr(group, 'meter', m)\na.b, g.comm = 1, 2\n")
    assert sorted(_assigned_attributes(tree)) == [
        (1, "g", "store"),
        (2, "group", "meter"),
        (3, "a", "b"),
        (3, "g", "comm"),
    ]
    assert {"transport", "store", "meter", "shard", "master"} <= _group_attributes()


def test_nothing_sets_a_group_attribute_from_outside() -> None:
    """A group's transport, store, meter and tensors are the group's own: built with it."""
    mine = _group_attributes()
    found = []
    for path, tree in _trees(PACKAGE).items():
        if path.name == "flat_group.py":
            continue
        for line, owner, attr in _assigned_attributes(tree):
            if owner in GROUP_NAMES and attr in mine:
                found.append(f"{path.relative_to(PACKAGE)}:{line} {owner}.{attr}")
            if attr == "on_scratch":  # a comm's scratch sink: given when the comm is built
                found.append(f"{path.relative_to(PACKAGE)}:{line} {owner}.{attr}")
    assert found == []


def _imports(tree: ast.AST, module: str) -> set[str]:
    """The package modules ``module`` imports (relative imports resolved)."""
    package = module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_zero_imports_nothing_from_compression() -> None:
    for path, tree in _trees(PACKAGE / "core" / "zero").items():
        bad = [m for m in _imports(tree, _module(path)) if ".compression" in m]
        assert bad == [], f"{path.name} imports {bad}"


def test_inference_uses_zeros_public_seam_only() -> None:
    """Inference imports from zero only its forward-only seam (``zero/forward.py``), the unit
    plan and the group's type: none of the training runtime (``Stage3Runtime``, the
    reduction queue, the group builders). That it reads no underscore attribute of an
    engine, group or plan is ``test_core_interfaces``'s walk."""
    allowed = {"forward", "units", "flat_group"}
    seen = set()
    for path, tree in _trees(PACKAGE / "core" / "inference").items():
        for m in _imports(tree, _module(path)):
            if m.startswith("ds_strategy.core.zero."):
                assert m.split(".")[3] in allowed, f"{path.name} imports {m}"
                seen.add(m.split(".")[3])
    assert "forward" in seen


# -- built with its transport and store ------------------------------------------------------------


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(7))]


def test_a_group_keeps_the_transport_store_and_meter_it_was_built_with() -> None:
    comm, meter = Comm(), ModelStateMeter()
    transport = Transport(QuantizedGather(comm), PlainReduceScatter(comm))
    make = GroupMaker(comm, torch.device("cpu"), PrecisionPolicy(), meter)
    g = make(_params(), STAGE3, transport=transport)
    assert g.transport is transport and g.meter is meter
    assert isinstance(g.store, DeviceStore) and g.grad_store is None
    plain = make(_params(), STAGE3)
    assert plain.transport == Transport(PlainGather(comm), PlainReduceScatter(comm))
    assert make.store() is not make.store()  # one store per group


def test_the_built_values_are_not_counted_and_gathers_are() -> None:
    """The full buffer a group is built with is freed by its first release without entering
    the meter (no gather allocated it); a gather's full buffer is counted until released."""
    meter = ModelStateMeter()
    params = _params()
    want = [p.detach().clone() for p in params]
    g = FlatParamGroup(params, Comm(), STAGE3, meter=meter)
    g.load_from_params()
    g.broadcast_and_bind()
    assert meter.transient == 0 and params[0].numel() == 0  # released
    g.gather(async_op=False)
    g.wait_gathered()
    assert meter.transient == g.full_nbytes
    assert all(torch.equal(p, w) for p, w in zip(params, want, strict=True))
    g.release()
    assert meter.transient == 0 and meter.peak == g.full_nbytes


def test_forward_sharding_builds_units_and_runs_them() -> None:
    meter = ModelStateMeter()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    want = model(x)
    values = {id(p): p.detach().clone() for p in model.parameters()}
    sharding = ForwardSharding(Comm(), torch.device("cpu"), torch.float32, meter, 1 << 20)

    def fill(g: FlatParamGroup) -> None:
        g.load_shard(lambda i, lo, hi: values[id(g.params[i])].reshape(-1)[lo:hi])

    for layer in model:
        sharding.add_unit(layer, list(layer.parameters()), fill)
    sharding.add_unit(model, [], fill)  # the root, last (no parameters of its own)
    sharding.start(prefetch_numel=1 << 20, max_live_numel=1 << 20)
    try:
        assert len(sharding.units) == 3 and len(sharding.groups) == 2
        assert all(p.numel() == 0 for p in model.parameters())  # sharded until used
        with torch.no_grad():
            got = model(x)
        assert torch.allclose(got, want)
        # the first pass records the order and prefetches nothing: one layer at a time
        assert sharding.peak_live_numel == max(u.numel for u in sharding.units) == 20
        assert all(p.numel() == 0 for p in model.parameters())  # released after use
        with pytest.raises(RuntimeError, match="after start"):
            sharding.add_unit(model[0], list(model[0].parameters()), fill)
    finally:
        sharding.stop()


def test_a_host_store_places_the_master_and_shard_on_the_host_from_the_start() -> None:
    """On an accelerator (here the meta device stands in for one: nothing is computed), a
    group built with a host store allocates its fp32 master and stage-3 shard in host memory,
    and its gradients and full buffer where it computes; on the CPU it moves nothing."""
    from ds_strategy.core.offload.cpu import HostStore

    meta = torch.device("meta")
    g = FlatParamGroup(
        _params(), Comm(), STAGE3, device=meta, store=HostStore(pin=False, params=True)
    )
    assert g.shard.device.type == "cpu" and g.shard.dtype == torch.float32
    assert g.master is not None and g.master.device.type == "cpu"
    assert g.grad_shard is not None and g.grad_shard.device == meta
    assert g.full_tensor(0).device == meta
    assert g.store.for_gather(g.shard, meta).device == meta  # a device copy for the gather
    # optimizer offload only: the master on the host, the shard where the group computes
    opt_only = FlatParamGroup(
        _params(), Comm(), STAGE3, device=meta, store=HostStore(pin=False, params=False)
    )
    assert opt_only.shard.device == meta and opt_only.master is not None
    assert opt_only.master.device.type == "cpu"
    frozen = FlatParamGroup(
        _params(),
        Comm(),
        STAGE3,
        trainable=False,
        device=meta,
        store=HostStore(pin=False, params=True),
    )
    assert frozen.master is None and frozen.shard.device.type == "cpu"
    on_cpu = FlatParamGroup(_params(), Comm(), STAGE3, store=HostStore(pin=False, params=True))
    assert on_cpu.master is None  # fp32 on the CPU: the optimizer steps the shard itself
    assert on_cpu.store.for_gather(on_cpu.shard, on_cpu.device) is on_cpu.shard
