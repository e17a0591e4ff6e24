"""The sharding core. Front ends talk only to :class:`ZeroEngine`; a pipeline hands each stage's
engine a :class:`StageContext`."""

from .engine import ZeroEngine
from .stage_context import StageContext

__all__ = ["StageContext", "ZeroEngine"]
