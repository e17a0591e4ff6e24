"""torch.compile under the engine: which units are compiled (:func:`compile_units`), the
backend named in the config (:func:`compile_backend`), and what Dynamo compiled since the
engine was built (:class:`CompileWatch`, read through ``engine.compile_report()``).

The gather and release that ZeRO-3 runs around a unit stay eager between the unit's compiled
graphs (see [Note: compiled units] in ``zero/stage3.py``), so the unit of compilation is the
unit of gathering: each block ZeRO-3 gathers as one.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch import nn

from ..config import ConfigError
from .warnings import PerformanceWarning
from .zero.units import plan_units

__all__ = [
    "CompileBackend",
    "CompileReport",
    "CompileWatch",
    "check_skipped_compiles",
    "compile_backend",
    "compile_units",
    "compiled_units",
]

COMPILE_KWARGS = frozenset({"fullgraph", "dynamic", "mode", "options", "disable"})

# torch.compile's backend: a registered name, or a callable compiling an FX graph
CompileBackend = str | Callable[..., object]


class CompileReport(TypedDict):
    """What :meth:`CompileWatch.report` counts (see ``ZeroEngine.compile_report``)."""

    compiled_units: int
    graphs: int
    graph_breaks: int
    break_reasons: dict[str, int]
    last_new_graph_step: int | None


def compile_backend(backend: object) -> CompileBackend:
    """torch.compile's ``backend``: a callable, a registered name, or
    ``"package.module.function"`` imported (as DeepSpeed reads ``compile.backend``)."""
    if callable(backend):
        return backend
    if not isinstance(backend, str) or not backend:
        raise ConfigError(
            f"compile.backend: expected a backend name or a callable, got {backend!r}",
            key="compile.backend",
        )
    if backend in torch._dynamo.list_backends(exclude_tags=()):
        return backend
    module_name, _, name = backend.rpartition(".")
    if module_name:
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError):
            pass
    raise ConfigError(
        f"compile.backend: {backend!r} is neither one of torch.compile's backends "
        f"({', '.join(torch._dynamo.list_backends())}) nor an importable "
        "'package.module.function'",
        key="compile.backend",
    )


def check_compile_kwargs(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - COMPILE_KWARGS)
    if unknown:
        raise ConfigError(
            f"compile.kwargs.{unknown[0]}: not an argument of torch.compile (it takes "
            f"{', '.join(sorted(COMPILE_KWARGS))})",
            key=f"compile.kwargs.{unknown[0]}",
        )


def compile_units(module: nn.Module, backend: CompileBackend, kwargs: dict[str, Any]) -> None:
    """Compile each outermost block that ZeRO-3 gathers as one (the same blocks at every
    stage), or ``module`` whole when it has none; a unit whose ``forward`` is torch's own and
    holds units of its own (an ``nn.Sequential`` block of layers that are units too) is
    passed over for those, so that no unit's hooks fall inside a compiled one (each would be
    a graph break). A unit compiled already, or a model compiled as a whole, is left as it is.

    A unit is compiled with ``unit.compile()`` (torch.compile of its ``_call_impl``: Dynamo
    starts at its ``forward``, the hooks around it stay eager), except where ``forward`` is
    torch's own (``nn.Sequential``, ``nn.TransformerEncoderLayer``): Dynamo never starts in
    torch's files, so ``compile()`` there compiles nothing, and the bound ``forward`` is
    compiled instead (an attribute of the instance: parameter names do not change)."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return  # torch.compile(model) before initialize: compiled as a whole already
    units = [u for u in plan_units(module).units if u is not module]
    unit_ids = {id(u) for u in units}

    def outermost(candidates: list[nn.Module]) -> list[nn.Module]:
        inside = {id(m) for c in candidates for m in c.modules() if m is not c}
        return [c for c in candidates if id(c) not in inside]

    chosen: list[nn.Module] = []

    def pick(unit: nn.Module) -> None:
        inner = outermost([m for m in unit.modules() if m is not unit and id(m) in unit_ids])
        if inner and _torch_forward(unit):
            for u in inner:
                pick(u)
        else:
            chosen.append(unit)

    for unit in outermost(units) or [module]:
        pick(unit)
    for unit in chosen:
        if _runs_compiled(unit):
            continue
        if _torch_forward(unit):
            unit.forward = torch.compile(unit.forward, backend=backend, **kwargs)  # type: ignore[method-assign]
        else:
            unit.compile(backend=backend, **kwargs)


def _torch_forward(m: nn.Module) -> bool:
    return type(m).forward.__module__.startswith("torch.")


def _runs_compiled(m: nn.Module) -> bool:
    forward = m.__dict__.get("forward")
    if forward is not None and hasattr(forward, "_torchdynamo_orig_callable"):
        return True  # its bound forward compiled
    return getattr(m, "_compiled_call_impl", None) is not None and not _torch_forward(m)


def compiled_units(module: nn.Module) -> int:
    """Modules of ``module`` that run compiled: ``module.compile()``'d ones (but not those
    whose ``forward`` is torch's own, which Dynamo skips), ones whose bound ``forward`` was
    compiled, and ``torch.compile(module)`` as one."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return 1
    return sum(_runs_compiled(m) for m in module.modules())


def check_skipped_compiles(module: nn.Module) -> None:
    """Warn about modules ``.compile()``'d that will run eagerly: torch's own modules, whose
    frames Dynamo does not trace."""
    skipped = [
        f"{name or 'the model'} ({type(m).__name__})"
        for name, m in module.named_modules()
        if getattr(m, "_compiled_call_impl", None) is not None and _torch_forward(m)
    ]
    if skipped:
        warnings.warn(
            f"torch.compile: {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''} "
            "were compiled with Module.compile(), which compiles nothing for a module whose "
            "forward is torch's own (Dynamo does not start in torch's files): they run "
            "eagerly. Compile the model with torch.compile(model), or set the config's "
            "compile.enabled (the engine compiles such units' forward)",
            PerformanceWarning,
            stacklevel=4,
        )


def _dynamo_counts() -> tuple[int, dict[str, int]]:
    """Graphs Dynamo has compiled in this process, and its graph breaks by reason."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


class CompileWatch:
    """What Dynamo compiled while an engine trained: graphs, graph breaks with their reasons,
    and the step after which the last new graph appeared (a model whose guards hold compiles
    nothing after its first steps: a train step, an evaluation, an accumulation boundary).

    Dynamo counts per process, so the figures are the process's since the engine was built:
    with two engines in one process each sees the other's compilation too."""

    def __init__(self, module: nn.Module) -> None:
        check_skipped_compiles(module)
        self._module = module
        self._graphs0, self._breaks0 = _dynamo_counts()
        self._seen = self._graphs0
        self.last_new_graph_step: int | None = None

    def after_step(self, global_steps: int) -> None:
        graphs = _dynamo_counts()[0]
        if graphs != self._seen:
            self._seen = graphs
            self.last_new_graph_step = global_steps
        elif global_steps == 1 and graphs == self._graphs0:
            # nothing compiled by the first step: reused graphs (compiled for an earlier
            # engine in this process), or Dynamo gave up on the units for a break it records
            report = self.report()
            if report["compiled_units"] and report["graph_breaks"]:
                warnings.warn(
                    f"torch.compile: {report['compiled_units']} module(s) are compiled but "
                    "the first step compiled no graph: they ran eagerly. Dynamo's reasons: "
                    f"{report['break_reasons']} (engine.compile_report())",
                    PerformanceWarning,
                    stacklevel=3,
                )

    def report(self) -> CompileReport:
        """The counts since the engine was built (see :class:`CompileReport`)."""
        graphs, breaks = _dynamo_counts()
        reasons: dict[str, int] = {}
        for reason, n in breaks.items():
            n -= self._breaks0.get(reason, 0)
            if n > 0:  # the reason's first line names it; the rest are hints
                short = reason.strip().splitlines()[0] if reason.strip() else "unknown"
                reasons[short] = reasons.get(short, 0) + n
        return {
            "compiled_units": compiled_units(self._module),
            "graphs": graphs - self._graphs0,
            "graph_breaks": sum(reasons.values()),
            "break_reasons": reasons,
            "last_new_graph_step": self.last_new_graph_step,
        }
