"""Register the Lightning strategies without importing Lightning up front.

``import ds_strategy`` must make ``Trainer(strategy="zero3")`` work, but importing Lightning
costs seconds in every process (each rank of every launch), most of which never use it. So:
if ``lightning`` is already imported, the strategies are registered now; otherwise a finder
on ``sys.meta_path`` waits for the first ``import lightning`` (which ``from lightning.pytorch
import Trainer`` also triggers) and registers them as soon as that import has finished. A
machine without Lightning never triggers it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["register_strategies", "register_when_lightning_is_imported"]

_PACKAGE = "lightning"


def register_strategies() -> None:
    """Make ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")`` work (also ``zero1``,
    ``zero2``, ``zero2_offload``, ``zero3_offload``); calling it again is harmless.

    >>> import ds_strategy
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "zero3" in StrategyRegistry
    True
    """
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from .fabric.strategy import ZeroStrategy as FabricZeroStrategy
    from .lightning.strategy import ZeroStrategy

    ZeroStrategy.register_strategies(StrategyRegistry)
    FabricZeroStrategy.register_strategies(STRATEGY_REGISTRY)


def _importing_ours() -> bool:
    """A module of ours is being imported (and imports Lightning): registering now would import
    it half-done. Our Lightning front ends register at the end of their own import instead."""
    ours = [m for n, m in list(sys.modules.items()) if n.startswith("ds_strategy.")]
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False) for m in ours)


def _register_after_import() -> None:
    """Inside the user's ``import lightning``: a failure to register must not fail that import."""
    if _importing_ours():
        return
    try:
        register_strategies()
    except Exception as e:  # noqa: BLE001 - reported, and the names stay unregistered
        warnings.warn(
            f"ds_strategy could not register its Lightning strategies ({e!r}); "
            "Trainer(strategy='zero3') will not find them, ds_strategy.lightning.ZeroStrategy "
            "can still be passed directly",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``lightning``, then registers the strategies."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register_after_import()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _LightningFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _PACKAGE:
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
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def register_when_lightning_is_imported() -> None:
    """Register now if Lightning is loaded, else as soon as it is imported."""
    if _PACKAGE in sys.modules:
        if sys.modules[_PACKAGE] is not None:  # None: imports of it are blocked
            register_strategies()
    elif not any(isinstance(f, _LightningFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningFinder())
