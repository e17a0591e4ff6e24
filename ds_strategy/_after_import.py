"""Run a function once a package has been imported, without importing it: if it is loaded,
now; otherwise a finder on ``sys.meta_path`` waits for its first import and calls the function
as soon as that import has finished. A process that never imports the package never runs it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["after_import"]


class _CallingLoader(importlib.abc.Loader):
    """Runs the real loader of the package, then the function."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader, self._then = loader, then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _WaitingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str, then: Callable[[], None]) -> None:
        self.package, self.then = package, then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.package:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = None
        for finder in sys.meta_path:  # whichever finder would have found it (site-packages,
            find = getattr(finder, "find_spec", None)  # an editable install's finder, ...)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallingLoader(spec.loader, self.then)
        return spec


def after_import(package: str, then: Callable[[], None]) -> None:
    """Call ``then()`` now if ``package`` is loaded, else right after its first import (once
    per package: a second call while one waits does nothing; blocked imports never call it)."""
    if package in sys.modules:
        if sys.modules[package] is not None:  # None: imports of it are blocked
            then()
    elif not any(isinstance(f, _WaitingFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, _WaitingFinder(package, then))
