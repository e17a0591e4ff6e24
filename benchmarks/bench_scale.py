"""Per-rank peak memory against model size with ZeRO-3 and NVMe offload (ZeRO-Infinity style).

    python benchmarks/bench_scale.py --nvme-path /local_nvme                 # 0.25B and 1B
    python benchmarks/bench_scale.py --nvme-path /local_nvme --sizes 3B --steps 2

Each size is a demo GPT built on the meta device (``param_init_fn``: GPT-2's initialisation),
trained with ZeRO-3 on 2 gloo ranks (one CPU thread each), fp32 AdamW, parameters and
optimizer state offloaded to NVMe (``offload_param`` and ``offload_optimizer`` with
``device: nvme``, ``buffer_size`` from ``--buffer-size``), persistence threshold 0,
micro-batch 1 of 64 tokens. Every size runs in new processes. Per rank it prints the peak RSS while the engine is built and while it trains
(the process's high-water mark from ``/proc/self/status``, reset between the two; where the
reset is not allowed, RSS sampled every 2 ms), both above the RSS the process had before the
model was built (torch and the package imported), the median step time, the losses and
the bytes the rank holds in swap files. The fp32 Adam training state of the model
(16 bytes a parameter: weights, gradients, two moments) is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from benchmarks.bench_offload import PeakRSS, _status_kb  # noqa: E402
from ds_strategy.core.memory import human_bytes  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss, init_weights  # noqa: E402

# name -> (width, layers): the sizes of the demo GPT (vocabulary 8192, 64 tokens)
SIZES = {"0.25B": (1024, 20), "1B": (2048, 20), "3B": (2560, 38)}
VOCAB, SEQ = 8192, 64


def _config(nvme_path: str, buffer_size: int) -> dict:
    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_size": buffer_size}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": dict(nvme),
            "offload_optimizer": dict(nvme),
        },
    }


def _rank(rank: int, world: int, size: str, steps: int, nvme_path: str, buffer_size: int) -> dict:
    width, layers = SIZES[size]
    torch.manual_seed(0)
    before = _status_kb("VmRSS") * 1024
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=VOCAB, d=width, layers=layers, heads=16, seq=SEQ))
    params = sum(p.numel() for p in model.parameters())
    peak = PeakRSS()
    t0 = time.perf_counter()
    engine = ds_strategy.initialize(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        _config(nvme_path, buffer_size),
        param_init_fn=init_weights,
    )
    build_s = time.perf_counter() - t0
    build_peak = peak.stop()
    g = torch.Generator().manual_seed(rank)
    times, losses = [], []
    peak = PeakRSS()
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        t0 = time.perf_counter()
        loss = gpt_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    train_peak = peak.stop()
    report = engine.memory_report()
    engine.destroy()
    return {
        "params": params,
        "before": before,
        "build_peak": build_peak - before,
        "build_s": build_s,
        "train_peak": train_peak - before,
        "step_s": statistics.median(times),
        "losses": losses,
        "nvme": report.get("offloaded_nvme", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["0.25B", "1B"], choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme-path", default=None, help="default: a temporary directory")
    ap.add_argument(
        "--buffer-size",
        type=int,
        default=100_000_000,
        help="offload buffer_size in elements (DeepSpeed's default; the optimizer step holds "
        "up to buffer_count=4 buckets of it: weights and both moments, 12 bytes an element)",
    )
    args = ap.parse_args()
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="bench_scale_")
    print(
        "demo GPT, ZeRO-3, 2 ranks, offload_param + offload_optimizer on NVMe "
        f"({nvme_path}), buffer_size {args.buffer_size:,}"
    )
    print(
        f"{'model':>6} {'params':>14} {'Adam state':>11} {'rank':>4} {'build peak':>11} "
        f"{'build':>7} {'train peak':>11} {'step':>8} {'on NVMe':>10}  losses"
    )
    for size in args.sizes:
        results = run(_rank, 2, size, args.steps, nvme_path, args.buffer_size, timeout=4 * 3600)
        for rank, r in sorted(results.items()):
            losses = " ".join(f"{x:.3f}" for x in r["losses"])
            print(
                f"{size:>6} {r['params']:>14,} {human_bytes(16 * r['params']):>11} {rank:>4} "
                f"{human_bytes(r['build_peak']):>11} {r['build_s']:>6.0f}s "
                f"{human_bytes(r['train_peak']):>11} {r['step_s']:>7.1f}s "
                f"{human_bytes(r['nvme']):>10}  {losses}",
                flush=True,
            )
    print("peaks are RSS above the process's RSS before the model was built")


if __name__ == "__main__":
    main()
