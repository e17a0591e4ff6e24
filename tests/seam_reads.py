"""What a folder of the package reads of an engine, a flat group or a sharding plan, read from
its source: every attribute chain rooted at one, with the file and line. Tests hold the
checkpoint code (and may hold the inference code) to the seam with it: no underscore
attribute, and an engine read only through its protocol.

A value is taken for an engine, a group or a plan when it is named so (``engine``,
``self.engine``, ``group``; ``groups``: several; not ``plan``, which names DCP's and
tensor parallelism's plans too), when a parameter is annotated with one of their types
(``list[FlatParamGroup]``: several), or when it is bound from one: ``x = engine.plan``,
``for g in engine.plan.groups``, ``for p, g in zip(ps, groups)``. Chains go through subscripts
(``[]``) and calls (``()``): ``engine.plan.groups[0].layout.pieces(r)`` is
``("plan", "groups", "[]", "layout", "pieces", "()")`` rooted at an engine.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ENGINE, GROUP, PLAN = "engine", "group", "plan"


@dataclass(frozen=True)
class _Root:
    """What a name holds: one of the three (or several of them), reached by ``prefix``."""

    kind: str
    prefix: tuple[str, ...] = ()
    several: bool = False  # a list or mapping of them: only its items are one


# names and annotations that make a value one of the three
NAMES = {"engine": _Root(ENGINE), "group": _Root(GROUP), "groups": _Root(GROUP, several=True)}
TYPES = {
    "ZeroEngine": ENGINE,
    "CheckpointedEngine": ENGINE,
    "PipelineEngine": ENGINE,
    "FlatParamGroup": GROUP,
    "ShardingPlan": PLAN,
}
_COLLECTIONS = ("list[", "tuple[", "Sequence[", "Iterable[", "dict[", "Mapping[")


@dataclass(frozen=True)
class Read:
    """One attribute chain read off an engine, a group or a plan."""

    path: Path
    line: int
    kind: str  # ENGINE, GROUP or PLAN: what the chain starts at
    chain: tuple[str, ...]

    @property
    def private(self) -> bool:
        """Whether the chain reads an underscore attribute (not a dunder) on its way."""
        return any(a.startswith("_") and not a.endswith("__") for a in self.chain)

    def __str__(self) -> str:
        return f"{self.path.name}:{self.line}: {self.kind}.{'.'.join(self.chain)}"


Roots = dict[str, _Root]


def _chain(node: ast.AST, roots: Roots) -> _Root | None:
    """What ``node`` reads: the chain of attributes, items and calls from its root."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            parts.append("[]")
            node = node.value
        elif isinstance(node, ast.Call):
            parts.append("()")
            node = node.func
        else:
            break
    if not isinstance(node, ast.Name):
        return None
    if node.id == "self" and parts and parts[-1] in NAMES:  # self.engine, self.groups
        root = NAMES[parts.pop()]
    elif node.id in roots:
        root = roots[node.id]
    else:
        return None
    if root.several:
        if not parts:
            return root  # the collection itself (iterated: its items are one each)
        if parts[-1] != "[]":
            return None  # the collection's own methods (``engines.items()``)
        parts.pop()
    return _Root(root.kind, (*root.prefix, *reversed(parts)))


def _annotated(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Roots:
    roots: Roots = {}
    arguments = fn.args
    for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
        text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        for type_name, kind in TYPES.items():
            if type_name in text:
                roots[arg.arg] = _Root(kind, several=text.startswith(_COLLECTIONS))
    return roots


def _bind(target: ast.AST, value: _Root | None, roots: Roots) -> None:
    if value is not None and isinstance(target, ast.Name):
        roots[target.id] = value


def _iterated(it: ast.AST, target: ast.AST, roots: Roots) -> None:
    """Bind a loop's (or a comprehension's) names to what they iterate over."""
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip":
        sources, targets = it.args, target.elts if isinstance(target, ast.Tuple) else []
    elif isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate":
        sources = it.args[:1]
        targets = target.elts[1:] if isinstance(target, ast.Tuple) else []
    else:
        sources, targets = [it], [target]
    for source, name in zip(sources, targets, strict=False):
        found = _chain(source, roots)
        if found is not None and found.several:
            _bind(name, _Root(found.kind, found.prefix), roots)
        elif found is not None:
            _bind(name, _Root(found.kind, (*found.prefix, "[]")), roots)


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _nodes(scope: ast.AST) -> list[ast.AST]:
    """``scope``'s nodes: a function's, nested functions included (they share its names);
    a module's outside its functions (each function is a scope of its own)."""
    if isinstance(scope, _FUNCTIONS):
        return list(ast.walk(scope))
    out, todo = [], [scope]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, _FUNCTIONS))
    return out


def _roots(scope: ast.AST, nodes: list[ast.AST]) -> Roots:
    roots = dict(NAMES)
    if isinstance(scope, _FUNCTIONS):
        roots.update(_annotated(scope))
    for _ in range(3):  # an alias of an alias, bound later in the source
        for node in nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                value = node.value
                if isinstance(value, ast.IfExp):  # x = engine.a if ... else None
                    value = value.body
                _bind(node.targets[0], _chain(value, roots), roots)
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                _bind(node.target, _chain(node.value, roots), roots)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                _iterated(node.iter, node.target, roots)
    return roots


def reads(folder: Path) -> list[Read]:
    """Every chain the modules of ``folder`` (and its subfolders) read off an engine, a
    group or a plan."""
    found: set[Read] = set()
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, _FUNCTIONS))]:
            nodes = _nodes(scope)
            roots = _roots(scope, nodes)
            for node in nodes:
                if isinstance(node, ast.Attribute):
                    hit = _chain(node, roots)
                    if hit is not None and hit.prefix and not hit.several:
                        found.add(Read(path, node.lineno, hit.kind, hit.prefix))
    return sorted(found, key=lambda r: (str(r.path), r.line, r.chain))


def engine_members(found: list[Read]) -> set[str]:
    """The engine attributes and methods ``found`` reads directly."""
    return {r.chain[0] for r in found if r.kind == ENGINE}
