"""CPU and NVMe tiers for optimizer state and parameters (ZeRO-Offload / ZeRO-Infinity)."""

from .runtime import Offload, check_offload_config

__all__ = ["Offload", "check_offload_config"]
