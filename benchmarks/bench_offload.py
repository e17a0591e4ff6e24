"""Peak resident memory with the optimizer state swapped to NVMe vs kept in memory.

    python benchmarks/bench_offload.py                     # GPT ~67M parameters, 1 rank
    python benchmarks/bench_offload.py --layers 8 --d 1024 --steps 4 --nvme-path /local_nvme

Each configuration trains the same GPT (AdamW, ZeRO stage 1 in a world of one, fp32) in a
fresh process. The peak RSS is the process's high-water mark over the training steps only
(reset through ``/proc/self/clear_refs`` after the engine is built; where that is not
possible, ``/proc/self/status`` VmRSS is sampled every 2 ms instead). Printed side by side:
peak RSS, its drop against no offload, the drop as a fraction of the optimizer-state bytes
(Adam's two fp32 moments, from ``memory_report()`` of the run without offload) and the median
step time with its ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRSS:
    """High-water mark of resident memory from now on."""

    def __init__(self) -> None:
        self.method = "VmHWM after clear_refs"
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            self.method = "VmRSS sampled every 2 ms"
        self.peak = _status_kb("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_kb("VmRSS"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        peak = self.peak
        if self.method.startswith("VmHWM"):
            peak = max(peak, _status_kb("VmHWM"))
        return peak * 1024


def child(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = GPTConfig(vocab=args.vocab, d=args.d, layers=args.layers, heads=8, seq=args.seq)
    model = GPT(cfg)
    zo: dict = {"stage": 1}
    if args.child == "nvme":
        zo["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": args.nvme_path,
            "buffer_size": args.buffer_size,
            "buffer_count": 4,
        }
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), {"zero_optimization": zo}
    )
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=g) for _ in range(3)]
    engine.backward(gpt_loss(engine, data[0]))  # warm-up: state allocated, pages touched
    engine.step()
    report = engine.memory_report()
    before = _status_kb("VmRSS") * 1024
    peak = PeakRSS()
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        engine.backward(gpt_loss(engine, data[i % len(data)]))
        engine.step()
        times.append(time.perf_counter() - t0)
    out = {
        "peak_rss": peak.stop(),
        "rss_before": before,
        "method": peak.method,
        "step_s": statistics.median(times),
        "optimizer_state": report["optimizer_state"],
        "offloaded": report.get("offloaded_nvme", 0),
        "params": sum(p.numel() for p in model.parameters()),
    }
    engine.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration")
    ap.add_argument("--buffer-size", type=int, default=5_000_000, help="elements per bucket")
    ap.add_argument("--nvme-path", default=None, help="default: a temporary directory")
    ap.add_argument("--child", choices=["none", "nvme"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as swap:
        results: dict[str, dict] = {}
        for name in ["none", "nvme"] * args.repeats:  # alternated: noise hits both alike
            cmd = [sys.executable, __file__, "--child", name, "--nvme-path", swap]
            for k in ["layers", "d", "vocab", "seq", "batch", "steps", "threads", "buffer_size"]:
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if name not in results:
                results[name] = r
            else:  # the faster run's time; the larger run's peak
                results[name]["step_s"] = min(results[name]["step_s"], r["step_s"])
                results[name]["peak_rss"] = max(results[name]["peak_rss"], r["peak_rss"])
    base, off = results["none"], results["nvme"]
    state = base["optimizer_state"]
    mib = 2**20
    print(
        f"GPT {base['params'] / 1e6:.1f}M parameters, AdamW fp32, 1 rank, {args.steps} steps "
        f"x {args.repeats} runs (step: best median; peak: largest); "
        f"optimizer state {state / mib:.0f} MiB; bucket {args.buffer_size:,} elements; "
        f"peak RSS by {base['method']}"
    )
    print(f"{'':<22} {'no offload':>12} {'NVMe optimizer':>15}")
    print(f"{'peak RSS (MiB)':<22} {base['peak_rss'] / mib:12.0f} {off['peak_rss'] / mib:15.0f}")
    print(
        f"{'optimizer state in RAM':<22} {base['optimizer_state'] / mib:12.0f} "
        f"{off['optimizer_state'] / mib:15.0f}"
    )
    print(f"{'in files (MiB)':<22} {0:12.0f} {off['offloaded'] / mib:15.0f}")
    print(f"{'step time (s)':<22} {base['step_s']:12.2f} {off['step_s']:15.2f}")
    drop = base["peak_rss"] - off["peak_rss"]
    print(
        f"peak RSS drop {drop / mib:.0f} MiB = {drop / state:.0%} of the optimizer-state bytes; "
        f"step time x{off['step_s'] / base['step_s']:.2f} with NVMe offload"
    )


if __name__ == "__main__":
    main()
