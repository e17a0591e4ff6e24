"""Per-rank peak memory against model size with ZeRO-3 and NVMe offload (ZeRO-Infinity style).

    python benchmarks/bench_scale.py --nvme-path /local_nvme                 # 0.25B and 1B
    python benchmarks/bench_scale.py --nvme-path /local_nvme --sizes 3B --steps 2

Each size is a demo GPT built on the meta device (``param_init_fn``: GPT-2's initialisation),
trained with ZeRO-3 on 2 gloo ranks (one CPU thread each), fp32 AdamW, parameters and
optimizer state offloaded to NVMe (``offload_param`` and ``offload_optimizer`` with
``device: nvme``, ``buffer_size`` from ``--buffer-size``), persistence threshold 0,
micro-batch 1 of 64 tokens. Every size runs in new processes. Per rank it prints the peak
RSS while the engine is built and while it trains (the process's high-water mark from
``/proc/self/status``, reset between the two; where the reset is not allowed, RSS sampled
every 2 ms), both above the RSS the process had before the model was built (torch and the
package imported), the median step time, the swap bytes read and written in a step, the
losses and the bytes the rank holds in swap files. The fp32 Adam training state of the model
(16 bytes a parameter: weights, gradients, two moments) is printed beside it.

Then the step time against its bound: the disk's read and write bandwidth, measured first
with direct I/O (1 GiB through 16 MiB buffers), gives the time both ranks' swap bytes of a
step need at the disk's speed; the compute time is the step less the time the rank waited
for swap I/O; the bound is the larger of the two.
"""

from __future__ import annotations

import argparse
import mmap
import os
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
from ds_strategy.core.offload.swap import io_bytes  # noqa: E402
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
    times, losses, moved, waited = [], [], [], []
    peak = PeakRSS()
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        io0 = io_bytes()
        t0 = time.perf_counter()
        loss = gpt_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        io1 = io_bytes()
        moved.append((io1["read"] - io0["read"], io1["written"] - io0["written"]))
        waited.append(io1["waited"] - io0["waited"])
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
        "read": statistics.median(m[0] for m in moved),
        "written": statistics.median(m[1] for m in moved),
        "waited": statistics.median(waited),
        "losses": losses,
        "nvme": report.get("offloaded_nvme", 0),
    }


def disk_bandwidth(path: str, size: int = 1 << 30, chunk: int = 16 << 20) -> tuple[float, float]:
    """(write, read) bytes/s of ``path``'s disk: ``size`` bytes in ``chunk``s through direct
    I/O (the page cache bypassed; plain writes with fsync and a dropped cache where the file
    system refuses O_DIRECT)."""
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))
    fd_, name = tempfile.mkstemp(dir=path, prefix="bench_disk_")
    os.close(fd_)
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | direct)
        except OSError:
            direct = 0
            fd = os.open(name, os.O_WRONLY)
        t0 = time.perf_counter()
        for _ in range(size // chunk):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(name, os.O_RDONLY | direct)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) == chunk:
            pass
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        os.unlink(name)
    return size / write_s, size / read_s


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
        f"{'build':>7} {'train peak':>11} {'step':>8} {'I/O a step':>11} {'on NVMe':>10}  losses"
    )
    write_bw, read_bw = disk_bandwidth(nvme_path)
    print(f"disk at {nvme_path}: write {write_bw / 1e6:.0f} MB/s, read {read_bw / 1e6:.0f} MB/s")
    bounds = []
    for size in args.sizes:
        results = run(_rank, 2, size, args.steps, nvme_path, args.buffer_size, timeout=4 * 3600)
        for rank, r in sorted(results.items()):
            losses = " ".join(f"{x:.3f}" for x in r["losses"])
            print(
                f"{size:>6} {r['params']:>14,} {human_bytes(16 * r['params']):>11} {rank:>4} "
                f"{human_bytes(r['build_peak']):>11} {r['build_s']:>6.0f}s "
                f"{human_bytes(r['train_peak']):>11} {r['step_s']:>7.1f}s "
                f"{human_bytes(r['read'] + r['written']):>11} "
                f"{human_bytes(r['nvme']):>10}  {losses}",
                flush=True,
            )
        # both ranks share the disk: their bytes at its speed, against the slower rank's
        # compute (its step less the time it waited for swap I/O)
        io_s = sum(r["read"] for r in results.values()) / read_bw
        io_s += sum(r["written"] for r in results.values()) / write_bw
        compute_s = max(r["step_s"] - r["waited"] for r in results.values())
        step_s = max(r["step_s"] for r in results.values())
        bounds.append((size, step_s, compute_s, io_s))
    print("peaks are RSS above the process's RSS before the model was built")
    print(f"{'model':>6} {'step':>8} {'compute':>8} {'I/O at disk speed':>18} {'step / bound':>13}")
    for size, step_s, compute_s, io_s in bounds:
        ratio = step_s / max(compute_s, io_s)
        print(f"{size:>6} {step_s:>7.1f}s {compute_s:>7.1f}s {io_s:>17.1f}s {ratio:>12.2f}x")
    print(
        "compute: the slower rank's step less the time it waited for swap I/O; I/O at disk "
        "speed: both ranks' swap bytes of a step at the measured bandwidth; bound: the larger"
    )


if __name__ == "__main__":
    main()
