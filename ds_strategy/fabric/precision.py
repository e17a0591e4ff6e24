"""Fabric's precision plugin under ZeRO: only the flag (the config's ``bf16``/``fp16``)."""

from __future__ import annotations

from lightning.fabric.plugins.precision import Precision

from ..frontends.lightning_base import FlagPrecision

__all__ = ["ZeroFabricPrecision"]


class ZeroFabricPrecision(FlagPrecision, Precision):
    """Carries ``Fabric(precision=...)`` to the ZeRO strategy, which maps it onto its config::

    fabric = Fabric(strategy="zero3", precision="32-true")
    assert fabric.strategy.precision.precision == "32-true"
    """

    front = "Fabric"
