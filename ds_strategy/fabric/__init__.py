"""Lightning Fabric front end: :class:`ZeroStrategy`, or ``Fabric(strategy="zero3")``.

>>> import lightning as L
>>> import ds_strategy
>>> L.Fabric(strategy="zero2", accelerator="cpu", devices=1).strategy.stage
2
"""

from __future__ import annotations

from .._extras import require_extra

require_extra("ds_strategy.fabric", "lightning", "lightning")

from .._lightning_hook import register_strategies  # noqa: E402
from .strategy import ZeroFabricPrecision, ZeroStrategy  # noqa: E402

register_strategies()  # when this import is what imported Lightning

__all__ = ["ZeroFabricPrecision", "ZeroStrategy"]
