"""The peak the MFU is measured against: the config's ``flops_profiler.peak_tflops``, or a
timed matmul on the engine's device in its compute dtype, measured once per profile."""

from __future__ import annotations

import time

import torch

__all__ = ["measure_peak_tflops", "peak_tflops"]


def measure_peak_tflops(
    device: torch.device, dtype: torch.dtype, n: int | None = None, repeat: int = 5
) -> float:
    """TFLOPS of the best of ``repeat`` ``n x n`` matmuls (``2·n³`` FLOPs each) after one
    warm-up: what this device reaches on the densest work, not its data-sheet figure.

    >>> measure_peak_tflops(torch.device("cpu"), torch.float32, n=64, repeat=2) > 0
    True
    """
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeat + 1):  # the first is the warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def peak_tflops(
    configured: float | None, device: torch.device, dtype: torch.dtype
) -> tuple[float, str]:
    """(peak TFLOPS, where it came from) for the report."""
    if configured is not None:
        return float(configured), "flops_profiler.peak_tflops"
    n = 8192 if device.type == "cuda" else 1024
    measured = measure_peak_tflops(device, dtype, n)
    name = str(dtype).removeprefix("torch.")
    return measured, f"measured: best {n}x{n} {name} matmul on {device.type}"
