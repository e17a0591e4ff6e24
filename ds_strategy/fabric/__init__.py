"""Lightning Fabric front end: ``Fabric(strategy="zero3")`` (``import ds_strategy`` registers
``zero1`` ... ``zero3_offload``) or :class:`ZeroStrategy` over a :class:`~ds_strategy.ZeroEngine`.

>>> import lightning as L
>>> import ds_strategy
>>> L.Fabric(strategy="zero2", accelerator="cpu", devices=1).strategy.stage
2
"""

from __future__ import annotations

from .precision import ZeroFabricPrecision
from .strategy import ZeroStrategy

__all__ = ["ZeroFabricPrecision", "ZeroStrategy"]
