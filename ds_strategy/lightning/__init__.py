"""Lightning ``Trainer`` front end: :class:`ZeroStrategy`, or ``Trainer(strategy="zero3")``
(``import ds_strategy`` registers ``zero1`` ... ``zero3_offload`` once Lightning is imported).

>>> import lightning as L
>>> import ds_strategy
>>> L.Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False).strategy.stage
3
"""

from __future__ import annotations

from .._extras import require_extra

require_extra("ds_strategy.lightning", "lightning", "lightning")

from .._lightning_hook import register_strategies  # noqa: E402
from ._pipeline import PipelineModule  # noqa: E402
from .precision import ZeroPrecision  # noqa: E402
from .strategy import ZeroStrategy  # noqa: E402

__all__ = ["PipelineModule", "ZeroPrecision", "ZeroStrategy"]

register_strategies()  # when this import is what imported Lightning
