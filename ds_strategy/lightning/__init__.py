"""Lightning ``Trainer`` front end: :class:`ZeroStrategy`, or ``Trainer(strategy="zero3")``
(``import ds_strategy`` registers ``zero1`` ... ``zero3_offload`` once Lightning is imported).

>>> import lightning as L
>>> import ds_strategy
>>> L.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False).strategy.stage
3
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
    from .._lightning_hook import register_strategies
    from ._pipeline import PipelineModule
    from .precision import ZeroPrecision
    from .strategy import ZeroStrategy

    register_strategies()  # when this import is what imported Lightning
