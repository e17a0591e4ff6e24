"""The sharding core. Front ends talk only to :class:`ZeroEngine`."""

from .engine import ZeroEngine

__all__ = ["ZeroEngine"]
