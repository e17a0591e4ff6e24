"""Fabric's precision plugin under the ZeRO strategy: it only records the flag.

The engine owns precision (``Fabric(precision=...)`` becomes the config's ``bf16``/``fp16``
section), so this plugin neither autocasts the forward nor converts the module or inputs.
"""

from __future__ import annotations

from lightning.fabric.plugins.precision import Precision

from ..lightning._config import PRECISION_KEYS

__all__ = ["ZeroFabricPrecision"]

_STOCK = ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision")


class ZeroFabricPrecision(Precision):
    """Carries ``Fabric(precision=...)`` to the ZeRO strategy, which maps it onto its config.

    Example::

        fabric = Fabric(strategy="zero3", precision="32-true")
        assert fabric.strategy.precision.precision == "32-true"
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISION_KEYS:
            raise ValueError(
                f"Fabric(precision={precision!r}) is not supported by the ZeRO strategy; use one "
                f"of {', '.join(repr(p) for p in PRECISION_KEYS if '-' in p)}"
            )
        self.precision = precision  # type: ignore[assignment]

    @classmethod
    def from_plugin(cls, plugin: Precision) -> ZeroFabricPrecision:
        """The equivalent of the plugin Fabric built from its ``precision`` flag."""
        if isinstance(plugin, ZeroFabricPrecision):
            return plugin
        if type(plugin).__name__ in _STOCK and type(plugin).__module__.startswith("lightning."):
            return cls(str(plugin.precision))
        raise ValueError(
            f"the ZeRO strategy owns precision, so the precision plugin {type(plugin).__name__} "
            "cannot be combined with it; remove it and pass Fabric(precision=...) instead"
        )
