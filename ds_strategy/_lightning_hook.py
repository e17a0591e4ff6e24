"""Register the Lightning strategies without importing Lightning up front.

``import ds_strategy`` must make ``Trainer(strategy="zero3")`` work, and
``LightningModule.load_from_checkpoint`` read the checkpoint directories that strategy saves
(``lightning/_load_from_checkpoint.py``), but importing Lightning
costs seconds in every process (each rank of every launch), most of which never use it. So
they are registered now if ``lightning`` is already imported, else right after the first
``import lightning`` (which ``from lightning.pytorch import Trainer`` also triggers; see
``_after_import.py``). A machine without Lightning never triggers it.
"""

from __future__ import annotations

import sys
import warnings

from ._after_import import after_import

__all__ = ["register_strategies", "register_when_lightning_is_imported"]

_PACKAGE = "lightning"


def register_strategies() -> None:
    """Make ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")`` work (also ``zero1``,
    ``zero2``, ``zero2_offload``, ``zero3_offload``), and ``load_from_checkpoint`` read their
    checkpoint directories; calling it again is harmless.

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
    _read_checkpoint_directories()


def _read_checkpoint_directories() -> None:
    """The strategies work without it: a Lightning whose reader moved keeps its own (a
    directory then fails as before), with a warning."""
    from .lightning._load_from_checkpoint import read_checkpoint_directories

    try:
        read_checkpoint_directories()
    except AttributeError as e:
        warnings.warn(
            f"ds_strategy could not route LightningModule.load_from_checkpoint ({e!r}): it will "
            "not read ZeroStrategy's checkpoint directories; write a file with "
            "ds_strategy.consolidate(directory, 'model.ckpt') and load that",
            RuntimeWarning,
            stacklevel=2,
        )


def _importing_ours() -> bool:
    """A module of ours is being imported (and imports Lightning): registering now would import
    it half-done. Our Lightning front ends register at the end of their own import instead."""
    ours = [m for n, m in list(sys.modules.items()) if n.startswith("ds_strategy.")]
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False) for m in ours)


def _register_after_import() -> None:
    """After the user's ``import lightning`` (or at ``import ds_strategy`` when it was loaded):
    a failure to register must fail neither import."""
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


def register_when_lightning_is_imported() -> None:
    """Register now if Lightning is loaded, else as soon as it is imported."""
    after_import(_PACKAGE, _register_after_import)
