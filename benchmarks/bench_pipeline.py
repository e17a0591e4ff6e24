"""Pipeline bubble: each stage's measured idle fraction of a training step next to the
schedule's theoretical one, for GPipe, 1F1B and interleaved 1F1B, on 4 CPU ranks (gloo).

    python benchmarks/bench_pipeline.py
    python benchmarks/bench_pipeline.py --forward-ms 40 --micro-batches 4 8 16

[Note: simulated compute]
Four processes on a small, shared CPU would measure the scheduler, not the schedule: real
matrix multiplies on four ranks compete for the cores and every stage looks busy. So each
layer is a small Linear followed by a timed sleep (``--forward-ms`` per stage per
micro-batch forward, twice that in backward), which costs the same on every rank however
many cores there are. A stage's busy time is the time it really spent in those sleeps;
everything else in ``train_batch`` (waiting for its neighbours, send/recv, the optimizer
step, the loss broadcast) is idle. Theory: ``(P-1)/(M+P-1)`` for GPipe and 1F1B,
``((P-1)/v)/(M+(P-1)/v)`` for interleaved 1F1B with ``v`` chunks per rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import free_port  # noqa: E402
from ds_strategy.core.pipeline import bubble_fraction  # noqa: E402

WIDTH, LAYERS, MICRO = 16, 16, 2


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, busy: list[float]) -> torch.Tensor:
        ctx.seconds, ctx.busy = seconds, busy
        t0 = time.perf_counter()
        time.sleep(seconds)
        busy.append(time.perf_counter() - t0)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        t0 = time.perf_counter()
        time.sleep(2 * ctx.seconds)
        ctx.busy.append(time.perf_counter() - t0)
        return grad, None, None


class TimedLayer(nn.Module):
    def __init__(self, seconds: float, busy: list[float]) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seconds, self.busy = seconds, busy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.lin(x), self.seconds, self.busy)


def run_case(stages: int, schedule: str, micro: int, args: argparse.Namespace) -> list[float]:
    """Idle fraction of this rank's stage, one per measured step."""
    busy: list[float] = []
    # every rank's layers together take forward_ms per micro-batch, whatever the chunking
    seconds = args.forward_ms / 1e3 * stages / LAYERS
    torch.manual_seed(0)
    model = nn.Sequential(*[TimedLayer(seconds, busy) for _ in range(LAYERS)])
    config = {
        "pipeline": {"stages": stages, "schedule": schedule, "partition_method": "uniform"},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": micro,
        "zero_optimization": {"stage": 1},
    }
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = ds_strategy.initialize(model, opt, config, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(micro * MICRO, WIDTH), torch.randn(micro * MICRO, WIDTH)
    idle = []
    for i in range(args.steps + 1):
        busy.clear()
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(x, y)
        total = time.perf_counter() - t0
        if i > 0:  # the first step also infers shapes and warms up
            idle.append(1.0 - sum(busy) / total)
    engine.destroy()
    return idle


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        for stages in args.stages:
            for micro in args.micro_batches:
                for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
                    if schedule == "interleaved_1f1b" and micro % stages:
                        continue
                    idle = run_case(stages, schedule, micro, args)
                    queue.put((rank, stages, micro, schedule, statistics.median(idle)))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--forward-ms", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, args.world, port, args, queue))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows: dict[tuple[int, int, str], dict[int, float]] = {}
    while not queue.empty():
        rank, stages, micro, schedule, idle = queue.get()
        rows.setdefault((stages, micro, schedule), {})[rank] = idle
    print(
        f"{args.world} ranks, {args.forward_ms:g} ms forward + {2 * args.forward_ms:g} ms "
        "backward per stage per micro-batch; idle fraction of a train_batch step (median of "
        f"{args.steps} steps)"
    )
    print(
        f"{'P x D':<7}{'M':>3}  {'schedule':<17}{'theory':>8}{'measured':>10}{'ratio':>7}"
        "   per stage"
    )
    for (stages, micro, schedule), by_rank in sorted(rows.items()):
        dp = args.world // stages
        per_stage = [statistics.mean(by_rank[s * dp + d] for d in range(dp)) for s in range(stages)]
        measured = statistics.mean(per_stage)
        theory = bubble_fraction(schedule, stages, micro, 2 if "interleaved" in schedule else 1)
        print(
            f"{stages}x{dp:<5}{micro:>3}  {schedule:<17}{theory:>8.3f}{measured:>10.3f}"
            f"{measured / theory:>7.2f}   " + " ".join(f"{v:.3f}" for v in per_stage)
        )


if __name__ == "__main__":
    main()
