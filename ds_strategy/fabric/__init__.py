"""Lightning Fabric front end: :class:`ZeroStrategy` over the :class:`~ds_strategy.ZeroEngine`.

``import ds_strategy`` registers ``zero1``, ``zero2``, ``zero2_offload``, ``zero3`` and
``zero3_offload`` for ``Fabric(strategy=...)`` (see :mod:`ds_strategy.lightning`).

>>> import lightning as L
>>> import ds_strategy
>>> fabric = L.Fabric(strategy="zero2", accelerator="cpu", devices=1)
>>> type(fabric.strategy).__module__, fabric.strategy.stage
('ds_strategy.fabric.strategy', 2)
"""

from __future__ import annotations

from .precision import ZeroFabricPrecision
from .strategy import ZeroStrategy

__all__ = ["ZeroFabricPrecision", "ZeroStrategy"]
