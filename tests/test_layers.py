"""The package's layers, read from its source: no import cycle anywhere, and each layer imports
only what the layer table (docs/concepts/layering.md) allows (the front ends never import each other)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ds_strategy"
FRONT_ENDS = ("lightning", "fabric", "accelerate")
HF = "hf"  # Hugging Face's Trainer, which runs on Accelerate: built on the Accelerate front end


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path], typing: bool) -> set[str]:
    """The package modules ``name`` imports (at any depth of its code, lazy imports included;
    ``typing=False`` leaves out imports made only for annotations under TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{a.name}" for a in node.names} & set(modules)
            found.update(submodules)  # `from . import module` needs the module, not the package
            if len(submodules) < len(node.names):
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def _graph(typing: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, typing) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ds_strategy"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_relative_and_lazy_imports() -> None:
    graph = _graph(typing=False)
    assert "ds_strategy.core.engine" in graph["ds_strategy"]  # from .core.engine import ...
    assert "ds_strategy.fabric.strategy" in graph["ds_strategy._lightning_hook"]  # in a function


def test_no_import_cycles() -> None:
    """Counting imports made only for annotations too: checkpoint code names the engine
    through its protocol (``checkpoint/seam.py``), a reduction its group through
    ``ReducingGroup``, and the inference save takes the parts it writes."""
    assert _cycles(_graph(typing=True)) == []


def test_front_ends_import_the_layer_and_core_never_each_other() -> None:
    # annotations included: a front end may not even name another front end's types
    for module, imports in _graph(typing=True).items():
        layer = _layer(module)
        for target in imports:
            other = _layer(target)
            if layer in FRONT_ENDS:
                assert other == layer or other not in (*FRONT_ENDS, HF), (
                    f"{module} imports {target}"
                )
            if layer == HF:
                assert other not in ("lightning", "fabric"), f"{module} imports {target}"
            if layer == "frontends":
                assert other not in (*FRONT_ENDS, HF), f"{module} imports {target}"
            if layer in ("core", "config", "demos"):
                assert other not in (*FRONT_ENDS, HF, "frontends"), f"{module} imports {target}"
            if layer == "config":
                assert other == "config", f"{module} imports {target}: config is a leaf"


@pytest.mark.parametrize("front", [*FRONT_ENDS, HF, "frontends"])
def test_each_front_end_uses_the_front_end_layer(front: str) -> None:
    graph = _graph(typing=False)
    used = {t for m, ts in graph.items() if _layer(m) == front for t in ts}
    if front != "frontends":
        assert any(_layer(t) == "frontends" for t in used), f"{front} bypasses the layer"


def _code_lines(path: Path) -> int:
    """Lines of ``path`` that hold code: not blank, not a comment, not a docstring. A budget
    on adapters counts what they do; the documentation every public method carries
    (``Args:``, ``tests/test_docstrings.py``) is not held against it."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_leave_out_docstrings_comments_and_blanks(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        '"""Doc."""\n\n# note\ndef f(x):\n    """Doc\n    more."""\n    return (x +\n        1)\n'
    )
    assert _code_lines(path) == 3  # def, and the two lines of the return


def test_front_end_size_budget() -> None:
    """The front ends stay adapters that map each framework's hooks onto the engines: the
    Trainer's and Fabric's strategies with their precision plugins, the Trainer's pipeline
    steps and model summary, Accelerate's accelerator (``prepare`` of several models,
    ``save_state`` and where it writes, the pipeline loop), the front-end layer and the lazy
    registration (``_lightning_hook.py``, over the generic ``_after_import.py``), within
    2,000 lines of code. (Counted with docstrings and comments the budget was 3,000 lines;
    2,963 of them held 1,917 lines of code when every public method got its ``Args:``.)

    What needs no framework is the core's, shared with plain PyTorch loops
    (``core/loop.py``, ``core/job.py``, ``core/several.py``, ``core/root.py``,
    ``core/pipeline/loop.py``), and so are the reading, merging and gathering behind
    fine-tuning (``core/checkpoint/consolidate.py``, ``core/zero/gathered.py``); the
    loop-flag policy is the config's (``config/loop.py``)."""
    paths = [PACKAGE / "_lightning_hook.py"]
    paths += [p for d in (*FRONT_ENDS, "frontends") for p in (PACKAGE / d).rglob("*.py")]
    lines = sum(_code_lines(p) for p in paths)
    assert lines <= 2000, f"the front ends are {lines} lines of code"


def test_hf_front_end_size_budget() -> None:
    """The Trainer front end is a thin subclass over the Accelerate one, plus what the Hugging
    Face stack needs around it: any Trainer subclass made one (TRL's, ``zero()``), the check
    that no ZeRO variable goes unheeded by a plain Trainer, and a pretrained model built on the
    meta device for the engine to load: 420 lines of code (750 lines with docstrings and
    comments before; 730 of them held 400 lines of code)."""
    lines = sum(_code_lines(p) for p in (PACKAGE / HF).rglob("*.py"))
    assert lines <= 420, f"ds_strategy/hf is {lines} lines of code"


def test_only_ds_strategy_hf_imports_transformers() -> None:
    """transformers is the optional ``hf`` extra: nothing else may need it."""
    for path in PACKAGE.rglob("*.py"):
        if (PACKAGE / HF) in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            assert not any(n.split(".")[0] == "transformers" for n in names), path


def test_no_function_in_the_package_is_over_80_lines() -> None:
    """Long functions are parts waiting for names: the engine is assembled in named steps,
    the CLIs parse, check and print in separate functions. A docstring is not code: the
    lines of one (a public function's ``Args:``) are not counted."""
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    lines -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
                if lines > 80:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def test_the_engine_takes_no_private_arguments() -> None:
    """A pipeline hands its stage engines a public StageContext, nothing private."""
    import inspect

    from ds_strategy import ZeroEngine

    params = inspect.signature(ZeroEngine.__init__).parameters
    assert [p for p in params if p.startswith("_")] == []
    assert "pipeline_stage" in params
