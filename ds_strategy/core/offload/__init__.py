"""CPU and NVMe tiers for optimizer state and parameters (ZeRO-Offload / ZeRO-Infinity)."""

from .runtime import Offload

__all__ = ["Offload"]
