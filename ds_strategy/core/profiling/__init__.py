"""Observability of a training step: named ``torch.profiler`` ranges around every phase
(``ranges``) and DeepSpeed's flops profiler (``flops``: per-module parameters, FLOPs, MACs
and latency at one step, the totals, achieved TFLOPS and MFU, printed in DeepSpeed's layout)
and DeepSpeed's comms logger (``comms``: per collective kind, count, message size, time,
bandwidths and the straggler gap between ranks)."""

from .ranges import PREFIX, RANGES, profile_range, ranged

__all__ = ["PREFIX", "RANGES", "profile_range", "ranged"]
