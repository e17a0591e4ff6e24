"""DDP vs FSDP2 vs ZeRO stages 1/2/3 on one GPT, side by side in one run.

    python benchmarks/bench_zero.py                      # 2 CPU ranks (gloo), ~30M parameters
    python benchmarks/bench_zero.py --fused-everywhere   # every engine on torch's fused AdamW
    python benchmarks/bench_zero.py --steps 8 --layers 4
    python benchmarks/bench_zero.py --engines ddp zero1 zero1-bf16 zero2 zero2-bf16 zero3 zero3-bf16
    python benchmarks/bench_zero.py --world 1 --device cuda   # on a GPU
    python benchmarks/bench_zero.py --plot docs/images        # and draw the two tables
    python benchmarks/bench_zero.py --json run.json           # and every reading, exact bytes

Prints two tables. Memory: per-rank model state (counted from live tensors, activations
excluded) after forward, inside backward (the worst of every gradient hook and block
backward), after backward, inside the optimizer step and after it, each as a ratio to the
engine's ZeRO formula, and, for ds_strategy, ``memory_report()["peak"]`` next to the worst
live reading. Speed: median step time and its ratio to DDP and to FSDP2, bytes sent per
optimizer step (ours and DDP's counted the same way; FSDP2's are not instrumented).
DDP keeps its gradient buckets in C++, where the live-tensor count cannot see them.
``--plot DIR`` also draws both tables (matplotlib): ``bench_zero_memory.png``, each engine's
model state at each point as a multiple of its formula, and ``bench_zero_speed.png``, step
time and bytes sent per step beside DDP's and FSDP2's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import queue as queue_mod
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ds_strategy
from ds_strategy.core.memory import StepMemoryProbe
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss

# None: each engine runs AdamW as torch picks it for a user who wrote AdamW(params, lr)
# (ds_strategy then picks torch's fused kernel for its shards); True: every engine fused.
FUSED: bool | None = None


def formula(name: str, psi: int, n: int) -> float:
    if name.endswith(("-bf16", "-fp16")):  # K=12: 16-bit params and grads, fp32 master + Adam
        stage = int(name.split("-")[0][-1])
        return {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    return {
        "ddp": 16 * psi,
        "fsdp2": 16 * psi / n,
        "zero1": 8 * psi + 8 * psi / n,
        "zero2": 4 * psi + 12 * psi / n,
        "zero3": 16 * psi / n,
    }[name]


Step = Callable[[torch.Tensor], None]
Sent = Callable[[], float]  # bytes sent since the previous call (nan: not instrumented)
POINTS = StepMemoryProbe.POINTS


class Probed:
    """The probe of the engine being measured (None while timing: no probe runs then)."""

    probe: StepMemoryProbe | None = None

    @classmethod
    def forward(cls) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if cls.probe is None else cls.probe.forward()

    @classmethod
    def mark(cls, point: str) -> None:
        if cls.probe is not None:
            cls.probe.mark(point)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer) -> Step:
    if Probed.probe is not None:
        Probed.probe.watch_optimizer(opt)

    def step(batch: torch.Tensor) -> None:
        with Probed.forward():
            loss = gpt_loss(model, batch)
        Probed.mark("after_forward")
        loss.backward()
        del loss
        Probed.mark("after_backward")
        opt.step()
        opt.zero_grad(set_to_none=False)
        Probed.mark("after_step")

    return step


def setup_ddp(model: nn.Module, n: int) -> tuple[Step, Sent]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    sent = {"bytes": 0.0}

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        buf = bucket.buffer()
        sent["bytes"] += 2 * (n - 1) / n * buf.numel() * buf.element_size()
        return default_hooks.allreduce_hook(None, bucket)

    def take() -> float:
        out, sent["bytes"] = sent["bytes"], 0.0
        return out

    ddp = DDP(model)
    ddp.register_comm_hook(None, hook)
    return plain_step(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=FUSED)), take


def setup_fsdp2(model: nn.Module, n: int) -> tuple[Step, Sent]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(next(model.parameters()).device.type, (n,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=FUSED)
    return plain_step(model, opt), lambda: float("nan")


def setup_zero(
    stage: int, model: nn.Module, extra: dict | None = None, reuse: bool = False
) -> tuple[Step, Sent, ds_strategy.ZeroEngine]:
    """``reuse``: DeepSpeed's default ``stage3_max_reuse_distance`` (the last units of forward
    stay gathered into backward) instead of 0 (every unit is gathered again for its backward,
    as FSDP2 reshards after forward)."""
    block = sum(p.numel() for p in model.blocks[0].parameters())
    config = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 6_250_000,  # DDP's 25 MB buckets
            "stage3_param_persistence_threshold": 1e4,
            "stage3_prefetch_bucket_size": block,  # one block ahead, as FSDP2 prefetches
            **({} if reuse else {"stage3_max_reuse_distance": 0}),
        },
        **(extra or {}),
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=FUSED)
    engine = ds_strategy.initialize(model, opt, config)
    if Probed.probe is not None:
        Probed.probe.watch_optimizer(engine.optimizer)

    def step(batch: torch.Tensor) -> None:
        with Probed.forward():
            loss = gpt_loss(engine, batch)
        Probed.mark("after_forward")
        engine.backward(loss)
        del loss
        Probed.mark("after_backward")
        engine.step()
        Probed.mark("after_step")

    return step, lambda: float(engine.comm_report()["total"]), engine


def timed(step: Step, batch: torch.Tensor) -> float:
    sync = torch.cuda.synchronize if batch.is_cuda else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    step(batch)
    sync()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, n: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    """[Note: interleaved timing]
    Every engine is built and warmed up in turn (its model state at each point of a step is
    what the live tensors grew by since just before its model was built, read by a
    ``StepMemoryProbe`` over two probed steps; its bytes per step what one more step sent),
    then all engines stay alive and the timed steps go round-robin, engine after engine, so
    a slow minute on a shared machine slows every engine alike instead of whichever happened
    to run then.
    """
    global FUSED
    FUSED = True if args.fused_everywhere else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=600),
    )
    c = GPTConfig(layers=args.layers, d=args.d)
    torch.manual_seed(0)
    base = GPT(c).to(device)
    psi = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1 + rank)
    data = [
        torch.randint(0, c.vocab, (args.micro, c.seq + 1), generator=g).to(device) for _ in range(4)
    ]
    steps: dict[str, Step] = {}
    memory: dict[str, dict[str, int]] = {}
    sent: dict[str, float] = {}
    for name in args.engines:
        memory[name], steps[name], sent[name] = measure_engine(name, base, data, n, args)
    times: dict[str, list[float]] = {name: [] for name in args.engines}
    for i in range(args.steps):
        for name in args.engines:
            times[name].append(timed(steps[name], data[i % len(data)]))
    rows = [
        (name, statistics.median(times[name]), memory[name], sent[name]) for name in args.engines
    ]
    if rank == 0:
        queue.put((psi, rows))
    dist.destroy_process_group()


def measure_engine(
    name: str, base: nn.Module, data: list[torch.Tensor], n: int, args: argparse.Namespace
) -> tuple[dict[str, int], Step, float]:
    """Build one engine, warm it up, read its memory over two probed steps and its bytes
    over one more; returns (readings per point, the step, bytes per step)."""
    device_type = data[0].device.type
    StepMemoryProbe.exclude_existing()  # earlier engines and the data are not this one's
    model = copy.deepcopy(base)
    probe = StepMemoryProbe(model, modules=list(model.blocks), baseline=0, device_type=device_type)
    probe.armed = False
    Probed.probe = probe
    engine = None
    if name == "ddp":
        step, take = setup_ddp(model, n)
    elif name == "fsdp2":
        step, take = setup_fsdp2(model, n)
    else:  # zeroN or zeroN-bf16 / zeroN-fp16
        stage_name, _, prec = name.partition("-")
        extra = {prec: {"enabled": True}} if prec else None
        step, take, engine = setup_zero(int(stage_name[-1]), model, extra)
    del model
    for i in range(args.warmup):  # stage 3 records its unit order on the first step
        step(data[i % len(data)])
    if engine is not None:
        engine.reset_peak_memory()
    probe.armed = True
    for i in range(2):
        step(data[i % len(data)])
    readings = dict(probe.readings)
    if engine is not None:
        readings["reported_peak"] = engine.memory_report()["peak"]
    probe.close()
    Probed.probe = None
    take()
    step(data[0])
    return readings, step, take()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--engines", nargs="+", default=["ddp", "fsdp2", "zero1", "zero2", "zero3"])
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    ap.add_argument(
        "--fused-everywhere",
        action="store_true",
        help="give DDP and FSDP2 torch's fused AdamW too (isolates the sharding engine)",
    )
    ap.add_argument("--plot", type=Path, help="also draw the tables as PNGs into this directory")
    ap.add_argument(
        "--json", type=Path, help="also write every reading (bytes, seconds) to this JSON file"
    )
    args = ap.parse_args()
    if args.plot is not None:
        from ds_strategy.cli.plot import new_figure

        new_figure()  # matplotlib's absence fails now, not after the run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(r, args.world, port, args, queue))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    while True:  # a rank that died would otherwise leave the parent waiting forever
        try:
            psi, rows = queue.get(timeout=5)
            break
        except queue_mod.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                sys.exit(f"a rank failed (exit codes {failed}); its traceback is above")
    for p in procs:
        p.join()
    print(
        f"GPT {psi / 1e6:.1f}M parameters, {args.world} ranks x {args.threads} thread(s) on "
        f"{args.device}, micro-batch {args.micro}x{GPTConfig().seq}, median of {args.steps} "
        f"steps, AdamW {'fused for every engine' if args.fused_everywhere else 'as torch picks it'}"
    )
    print_memory(rows, psi, args.world)
    print()
    print_speed(rows)
    if args.plot is not None:
        for path in plot_rows(rows, psi, args.world, args.plot):
            print(f"wrote {path}")
    if args.json is not None:  # exact bytes, to compare two builds reading for reading
        readings = {name: {"step_s": t, "memory": mem, "sent": s} for name, t, mem, s in rows}
        args.json.write_text(json.dumps({"psi": psi, "engines": readings}, indent=1))
        print(f"wrote {args.json}")


def print_memory(rows: list, psi: int, world: int) -> None:
    print("Model state per rank at each point of a step, MB (x the engine's formula):")
    print(f"| engine | formula | {' | '.join(POINTS)} | worst | reported peak |")
    print("|---|---|" + "---|" * (len(POINTS) + 2))
    for name, _, mem, _ in rows:
        f = formula(name, psi, world)
        cells = [f"{mem[p] / 1e6:.1f} ({mem[p] / f:.2f}x)" for p in POINTS]
        worst = max(mem[p] for p in POINTS)
        reported = mem.get("reported_peak")
        rep_cell = (
            "n/a" if reported is None else f"{reported / 1e6:.1f} ({reported / worst:.3f}x worst)"
        )
        print(f"| {name} | {f / 1e6:.1f} | {' | '.join(cells)} | {worst / f:.2f}x | {rep_cell} |")


def plot_rows(rows: list, psi: int, world: int, out: Path) -> list[Path]:
    """The two tables as figures in ``out`` (see the module docstring)."""
    from ds_strategy.cli.plot import new_figure, save_figure

    out.mkdir(parents=True, exist_ok=True)
    fig = new_figure()
    ax = fig.add_subplot()
    for name, _, mem, _ in rows:
        f = formula(name, psi, world)
        ax.plot(range(len(POINTS)), [mem[p] / f for p in POINTS], marker="o", label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="ZeRO formula")
    ax.set_xticks(range(len(POINTS)), [p.replace("_", " ") for p in POINTS], fontsize="small")
    ax.set_ylabel("model state / the engine's formula")
    ax.set_title(f"Model state per rank through a step ({psi / 1e6:.0f}M params, {world} ranks)")
    ax.legend(fontsize="small", ncol=3)
    ax.grid(alpha=0.3)
    memory = out / "bench_zero_memory.png"
    save_figure(fig, memory)

    fig = new_figure()
    names = [name for name, *_ in rows]
    time_ax, sent_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    time_ax.bar(names, [t for _, t, _, _ in rows], color="tab:blue")
    time_ax.set_ylabel("median step time (s)")
    time_ax.set_title("Step time")
    sent = [(name, s / 1e6) for name, _, _, s in rows if s == s]  # FSDP2's: not counted
    sent_ax.bar([n for n, _ in sent], [mb for _, mb in sent], color="tab:orange")
    sent_ax.set_ylabel("MB sent per step, per rank")
    sent_ax.set_title("Bytes sent")
    for ax in (time_ax, sent_ax):
        ax.tick_params(axis="x", labelrotation=30, labelsize="small")
        ax.grid(alpha=0.3, axis="y")
    speed = out / "bench_zero_speed.png"
    save_figure(fig, speed)
    return [memory, speed]


def print_speed(rows: list) -> None:
    ddp_time = next((t for name, t, _, _ in rows if name == "ddp"), float("nan"))
    fsdp_time = next((t for name, t, _, _ in rows if name == "fsdp2"), float("nan"))
    ddp_sent = next((s for name, _, _, s in rows if name == "ddp"), float("nan"))
    print("| engine | step (s) | vs DDP | vs FSDP2 | sent / step (MB) | vs DDP |")
    print("|---|---|---|---|---|---|")
    for name, t, _, sent in rows:
        sent_s = "n/a" if sent != sent else f"{sent / 1e6:.1f}"
        sent_r = "n/a" if sent != sent else f"{sent / ddp_sent:.2f}x"
        print(
            f"| {name} | {t:.3f} | {t / ddp_time:.2f}x | {t / fsdp_time:.2f}x | {sent_s} | {sent_r} |"
        )


if __name__ == "__main__":
    main()
