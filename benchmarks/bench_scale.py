"""Per-rank peak memory against model size with ZeRO-3 and NVMe offload (ZeRO-Infinity style).

    python benchmarks/bench_scale.py --nvme-path /local_nvme                 # 0.25B and 1B
    python benchmarks/bench_scale.py --nvme-path /local_nvme --sizes 3B --steps 2
    python benchmarks/bench_scale.py --nvme-path /local_nvme --largest            # part (1)

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

With ``--largest``, the largest demo GPT of width ``--width`` that trains 2 steps on this
machine with each strategy: torch's DistributedDataParallel (fp32 AdamW, built in memory),
ZeRO-3, ZeRO-3 with the optimizer offloaded to the CPU and ZeRO-3 with parameters and
optimizer state on NVMe (all three built on the meta device). The search is over depth:
``ds-strategy estimate``'s host peak gives the first depth to try (the deepest whose peak,
plus the process's working memory, fits a rank's share of the memory), then one layer at a
time up while a trial trains and down while it fails. With NVMe offload a rank's memory does
not grow with depth (the table shows it), so the drive sets the limit: the search goes to
the deepest model whose swap files (both ranks') fit in 90% of its free space, and down from
there if that fails. Each rank runs under an address-space limit for data (``RLIMIT_DATA``, its
share of the machine's memory less a margin), so a trial that does not fit fails with an
allocation error instead of taking the machine down; the engine's own room check stops an
NVMe trial whose swap files would not fit the drive.

Then the step time against its bound: the disk's read and write bandwidth, measured first
with direct I/O (1 GiB through 16 MiB buffers), gives the time both ranks' swap bytes of a
step need at the disk's speed; the compute time is the step less the time the rank waited
for swap I/O; the bound is the larger of the two.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import queue as queue_mod
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import _entry, free_port, run  # noqa: E402
from benchmarks.bench_offload import PeakRSS, _status_kb  # noqa: E402
from ds_strategy.core.memory import human_bytes  # noqa: E402
from ds_strategy.core.offload.swap import io_bytes  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss, init_weights  # noqa: E402
from ds_strategy.estimate import Knobs, model_facts, step_peak  # noqa: E402

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


# -- part (1): the largest model each strategy trains ----------------------------------------

STRATEGIES = {  # name -> (stage, offload) for the estimate; "ddp" is torch's own
    "DDP": (0, "none"),
    "ZeRO-3": (3, "none"),
    "ZeRO-3 + CPU offload": (3, "cpu"),
    "ZeRO-3 + NVMe offload": (3, "nvme"),
}
WORKING_MEMORY = 0.5 * 2**30  # a rank's own memory beside the model (torch, gloo, autograd)


def _gpt(width: int, layers: int) -> GPT:
    return GPT(GPTConfig(vocab=VOCAB, d=width, layers=layers, heads=16, seq=SEQ))


def _trial(
    rank: int, world: int, strategy: str, width: int, layers: int, nvme: str, limit: int
) -> dict:
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    torch.manual_seed(0)
    before = _status_kb("VmRSS") * 1024
    peak = PeakRSS()
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    if strategy == "DDP":
        model = _gpt(width, layers)
        model.apply(init_weights)
        engine = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = optimizer(engine.parameters())
    else:
        zo: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
        if strategy.endswith("CPU offload"):
            zo["offload_optimizer"] = {"device": "cpu"}
        if strategy.endswith("NVMe offload"):
            zo["offload_param"] = {"device": "nvme", "nvme_path": nvme}
            zo["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        with torch.device("meta"):
            model = _gpt(width, layers)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zo}
        engine = ds_strategy.initialize(model, optimizer, config, param_init_fn=init_weights)
        opt = None
    g = torch.Generator().manual_seed(rank)
    times, losses = [], []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        t0 = time.perf_counter()
        loss = gpt_loss(engine, tokens)
        if opt is None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    nvme_bytes = engine.memory_report().get("offloaded_nvme", 0) if opt is None else 0
    out = {
        "peak": peak.stop() - before,
        "step_s": times[-1],
        "losses": losses,
        "nvme": nvme_bytes,
    }
    if opt is None:
        engine.destroy()
    return out


def _run_trial(*args: object, world: int = 2, timeout: float = 3 * 3600) -> dict | str:
    """``{rank: result}`` of one trial, or why it failed; the first rank to fail ends the
    others (a rank out of memory would leave its peer waiting in a collective)."""
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, _trial, args, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout
    failure = None
    while len(got) < world and failure is None:
        try:
            rank, value = results.get(timeout=2)
        except queue_mod.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                failure = f"a rank exited with code {dead[0].exitcode}"
            elif time.monotonic() > deadline:
                failure = "timed out"
            continue
        if isinstance(value, BaseException):
            failure = str(value).splitlines()[0][:160]
        else:
            got[rank] = value
    for p in procs:
        if failure is not None and p.is_alive():
            p.kill()
        p.join()
    return failure if failure is not None else got


def _first_guess(strategy: str, width: int, limit: int, nvme: str) -> int:
    """The deepest model whose estimated peak (or, on NVMe, swap files) fits."""
    stage, offload = STRATEGIES[strategy]
    knobs = Knobs(reduce_scratch=True, cpu_only=True)

    def fits(layers: int) -> bool:
        facts = model_facts(lambda: _gpt(width, layers), persistence_threshold=0)
        pk = step_peak(facts, 2, stage, offload, "fp32", knobs=knobs)
        if offload == "nvme":
            return 2 * pk.peak("nvme") * 1.1 <= shutil.disk_usage(nvme).free
        build = 8 * facts.params if strategy == "DDP" else 0  # weights and their init
        return max(pk.host_peak, build) + WORKING_MEMORY <= limit

    layers = 1
    while fits(layers * 2):
        layers *= 2
    step = layers // 2
    while step:
        if fits(layers + step):
            layers += step
        step //= 2
    return layers


def largest(args: argparse.Namespace, nvme_path: str) -> None:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = int((total - 2 * 2**30) / 2)  # a rank's share, less a margin for the system
    print(
        f"largest demo GPT of width {args.width} (vocabulary {VOCAB}) that trains 2 steps, "
        f"2 ranks, fp32 AdamW; each rank limited to {human_bytes(limit)} of data "
        f"(RLIMIT_DATA); NVMe at {nvme_path} ({human_bytes(shutil.disk_usage(nvme_path).free)} free)"
    )
    rows = []
    for strategy in args.strategies:
        layers = _first_guess(strategy, args.width, limit, nvme_path)
        best: tuple[int, dict] | None = None
        tried: dict[int, dict | str] = {}
        while layers >= 1 and layers not in tried:
            result = _run_trial(strategy, args.width, layers, nvme_path, limit)
            tried[layers] = result
            ok = not isinstance(result, str)
            print(
                f"  {strategy}: {layers} layers " + ("trains" if ok else f"fails ({result})"),
                flush=True,
            )
            if ok:
                best = (layers, result) if best is None or layers > best[0] else best
                if STRATEGIES[strategy][1] == "nvme":  # memory is no limit here: the drive is
                    print(f"  {strategy}: deeper needs more than 90% of the drive's free space")
                    break
                layers += 1
            elif best is None:
                layers -= 1
            else:
                break
        rows.append((strategy, best))
    print(
        f"{'strategy':>22} {'layers':>6} {'params':>14} {'peak RSS r0/r1':>20} {'step':>8} "
        f"{'on NVMe':>10}  losses"
    )
    for strategy, best in rows:
        if best is None:
            print(f"{strategy:>22}  nothing trains")
            continue
        layers, r = best
        peaks = "/".join(human_bytes(r[k]["peak"]) for k in sorted(r))
        step = max(x["step_s"] for x in r.values())
        nvme = sum(x["nvme"] for x in r.values())
        losses = " ".join(f"{x:.3f}" for x in r[0]["losses"])
        params = model_facts(lambda: _gpt(args.width, layers)).params  # noqa: B023
        print(
            f"{strategy:>22} {layers:>6} {params:>14,} {peaks:>20} {step:>7.1f}s "
            f"{human_bytes(nvme):>10}  {losses}"
        )
    print("peak RSS: above the rank's RSS before the model was built; on NVMe: both ranks")


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
    ap.add_argument(
        "--largest", action="store_true", help="part (1): the largest model per strategy"
    )
    ap.add_argument("--width", type=int, default=2048, help="with --largest: the model's width")
    ap.add_argument(
        "--strategies",
        nargs="+",
        default=list(STRATEGIES),
        choices=list(STRATEGIES),
        help="with --largest: the strategies to search",
    )
    args = ap.parse_args()
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="bench_scale_")
    if args.largest:
        largest(args, nvme_path)
        return
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
