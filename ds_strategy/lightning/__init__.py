"""Lightning ``Trainer`` front end: :class:`ZeroStrategy` over the :class:`~ds_strategy.ZeroEngine`.

``import ds_strategy`` registers ``zero1``, ``zero2``, ``zero2_offload``, ``zero3`` and
``zero3_offload`` in Lightning's strategy registries, for ``Trainer(strategy=...)`` and
``Fabric(strategy=...)`` alike, as soon as Lightning is imported. Without lightning installed
it registers nothing and ``import ds_strategy`` still works.

>>> import lightning as L
>>> import ds_strategy
>>> trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False)
>>> type(trainer.strategy).__name__, trainer.strategy.stage
('ZeroStrategy', 3)
"""

from __future__ import annotations

from typing import Any

__all__ = ["PipelineModule", "ZeroPrecision", "ZeroStrategy"]

try:
    import lightning  # noqa: F401  (only this import is optional; errors below are ours)
except ImportError:

    def __getattr__(name: str) -> Any:
        if name in __all__:
            raise ImportError(
                f"ds_strategy.lightning.{name} needs the 'lightning' package: pip install lightning"
            )
        raise AttributeError(f"module 'ds_strategy.lightning' has no attribute {name!r}")

else:
    from ._pipeline import PipelineModule
    from .precision import ZeroPrecision
    from .strategy import ZeroStrategy
