"""Tensor parallelism: which layers are split (``plan.py``) and torch's DTensor tensor
parallelism applied with ZeRO-compatible local parameters (``apply.py``)."""

from .apply import TensorParallel, TPParam
from .plan import resolve_plan

__all__ = ["TPParam", "TensorParallel", "resolve_plan"]
