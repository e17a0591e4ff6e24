"""Which modules become ZeRO-3 units, and which unit owns each parameter.

A *unit* is a module whose parameters are gathered together just before its forward (and
its backward) and released right after. Pure module-tree logic: no process group needed.

[Note: choosing units]
The default policy makes a unit of every module that is an element of an ``nn.ModuleList``
or ``nn.Sequential`` (the repeated blocks of nearly every model), plus the root, which owns
whatever no block owns (embeddings, final norm, head). A root that is an ``nn.ModuleDict``
has no forward (the loop calls its members, as Lightning's several optimizers do through
their parts), so each member is a unit too. Modules inside an
``nn.MultiheadAttention`` never become units: its forward reads ``out_proj.weight`` without
calling ``out_proj``, so the parameters must be gathered by the attention module (or above).
``unit_types`` replaces the default with "every module of these class names".

A parameter reachable from two units (a weight shared by two blocks) belongs to the root,
whose parameters stay gathered for the whole forward, so every user sees it. Parameters
of at most ``persistence_threshold`` elements are not sharded at all: gathering them would cost
more latency than the memory it saves (DeepSpeed's ``stage3_param_persistence_threshold``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["UnitPlan", "plan_units"]

_NO_UNITS_INSIDE = (nn.MultiheadAttention,)


@dataclass
class UnitPlan:
    units: list[nn.Module]  # root last
    params: dict[int, list[nn.Parameter]] = field(default_factory=dict)  # id(unit) -> params
    owned_modules: dict[int, list[nn.Module]] = field(default_factory=dict)
    persistent: list[nn.Parameter] = field(default_factory=list)


def _default_units(root: nn.Module, unit_types: tuple[str, ...] | None) -> list[nn.Module]:
    chosen: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module, inside_blocked: bool) -> None:
        for child in m.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if unit_types is not None:
                is_unit = type(child).__name__ in unit_types
            else:
                is_unit = isinstance(m, (nn.ModuleList, nn.Sequential)) and not inside_blocked
            if is_unit and any(True for _ in child.parameters()):
                chosen.append(child)
            visit(child, inside_blocked or isinstance(child, _NO_UNITS_INSIDE))

    if not isinstance(root, nn.ModuleDict):
        visit(root, isinstance(root, _NO_UNITS_INSIDE))
        return chosen
    for member in root.values():  # no forward of its own: the loop calls each member
        if id(member) not in seen and any(True for _ in member.parameters()):
            seen.add(id(member))
            chosen.append(member)
            visit(member, isinstance(member, _NO_UNITS_INSIDE))
    return chosen


def plan_units(
    root: nn.Module,
    persistence_threshold: int = 0,
    unit_types: tuple[str, ...] | None = None,
) -> UnitPlan:
    """Split ``root``'s parameters into units (see the note at the top of this module)."""
    units = _default_units(root, unit_types) + [root]
    unit_ids = {id(u) for u in units}
    owners: dict[int, set[int]] = {}
    param_of: dict[int, nn.Parameter] = {}
    order: list[int] = []
    owned_modules: dict[int, list[nn.Module]] = {id(u): [] for u in units}

    def visit(m: nn.Module, owner: nn.Module) -> None:
        if id(m) in unit_ids:
            owner = m
        owned_modules[id(owner)].append(m)
        for p in m.parameters(recurse=False):
            if id(p) not in param_of:
                param_of[id(p)] = p
                order.append(id(p))
            owners.setdefault(id(p), set()).add(id(owner))
        for child in m.children():
            visit(child, owner)

    visit(root, root)
    plan = UnitPlan(units=units, owned_modules=owned_modules)
    for u in units:
        plan.params[id(u)] = []
    for pid in order:
        p = param_of[pid]
        if p.numel() <= persistence_threshold:  # DeepSpeed's test: ds_numel <= threshold
            plan.persistent.append(p)
            continue
        owner_ids = owners[pid]
        owner_id = next(iter(owner_ids)) if len(owner_ids) == 1 else id(root)
        plan.params[owner_id].append(p)
    return plan
