"""Register the ZeRO strategies under their short names in Lightning's two registries."""

from __future__ import annotations

__all__ = ["register_strategies"]


def register_strategies() -> None:
    """Make ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")`` work (also ``zero1``,
    ``zero2``, ``zero2_offload``, ``zero3_offload``). ``import ds_strategy`` calls this when
    lightning is installed; calling it again is harmless.

    >>> import ds_strategy
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "zero3" in StrategyRegistry
    True
    """
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from ..fabric.strategy import ZeroStrategy as FabricZeroStrategy
    from .strategy import ZeroStrategy

    ZeroStrategy.register_strategies(StrategyRegistry)
    FabricZeroStrategy.register_strategies(STRATEGY_REGISTRY)
