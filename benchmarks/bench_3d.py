"""Data, tensor and pipeline parallelism on 4 ranks, side by side: the same demo GPT trained as
D=4 (ZeRO-1), D=2 x T=2 (ZeRO-1 over 2 data-parallel ranks, each layer split over 2),
P=2 x D=2 (two pipeline stages, each ZeRO-1 over 2) and P=2 x T=2 (two pipeline stages, each
layer split over 2). Per layout: the median step time (the slowest rank), each rank's model state, and
the bytes each rank sends per optimizer step in each group.

    python benchmarks/bench_3d.py
    python benchmarks/bench_3d.py --d 256 --layers 8 --steps 10

[Note: how the bytes are counted]
All bytes are ``engine.comm_report()``: the data-parallel group's collectives (gradient
reductions, parameter all-gathers, the small norm reductions); filed as ``tp_*``, the
activations the tensor-parallel layers all-reduce; filed as ``pp_*``, the activations and
gradients a pipeline stage sends to its neighbour and the pipeline's small loss and norm
reductions. A ring all-reduce counts 2(n-1)/n of the tensor per rank, a send its whole size.

On a CPU with fewer cores than ranks the step times measure the contention as much as the
layout; the bytes and the memory do not depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig, as_sequential, gpt_loss  # noqa: E402

LAYOUTS = ("D=4", "D=2 x T=2", "P=2 x D=2", "P=2 x T=2")
ACCUM = 2


def _config(layout: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "zero_optimization": {"stage": 1},
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0,
    }
    if "T=2" in layout:
        cfg["tensor_parallel"] = {"autotp_size": 2}
    if "P=2" in layout:
        cfg["pipeline"] = {"stages": 2, "schedule": "1f1b"}
    return cfg


def _run(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = GPTConfig(args.vocab, args.d, args.layers, args.heads, args.seq, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    pipeline = "P=2" in layout
    if pipeline:
        net = as_sequential(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

        engine = ds_strategy.initialize(net, opt, _config(layout), loss_fn=loss_fn)
        dp, dp_size = engine.data_parallel_rank, engine.data_parallel_size
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = ds_strategy.initialize(model, opt, _config(layout))
        dp, dp_size = engine.mesh.coordinates["dp"], engine.mesh.dp
    gen = torch.Generator().manual_seed(1)
    per = args.batch // dp_size

    def step() -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        mine = tokens[dp * per : (dp + 1) * per]
        if pipeline:
            engine.train_batch(mine[:, :-1], mine[:, 1:])
            return
        for micro in mine.chunk(ACCUM):
            engine.backward(gpt_loss(engine, micro))
            engine.step()

    step()  # warm-up: optimizer state appears, buffers are allocated
    engine.comm_report()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    comm = engine.comm_report()
    tp = sum(v for k, v in comm.items() if k.startswith("tp_"))
    pp = sum(v for k, v in comm.items() if k.startswith("pp_"))
    result = {
        "ms": statistics.median(times) * 1e3,
        "state": engine.memory_report()["total"],
        "dp": (comm["total"] - tp - pp) / args.steps,
        "tp": tp / args.steps,
        "pp": pp / args.steps,
    }
    engine.destroy()
    return result


def _all_layouts(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    done = {}
    for layout in LAYOUTS:
        done[layout] = _run(layout, args)
        if args.verbose and rank == 0:
            print(f"done {layout}: {done[layout]}", flush=True)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    parser.add_argument("--verbose", action="store_true", help="each layout's figures as done")
    args = parser.parse_args()
    world = 4
    results = run(_all_layouts, world, args)
    params = sum(
        p.numel()
        for p in GPT(
            GPTConfig(args.vocab, args.d, args.layers, args.heads, args.seq, tie_embeddings=False)
        ).parameters()
    )
    print(
        f"demo GPT d={args.d} layers={args.layers} heads={args.heads} seq={args.seq} "
        f"({params / 1e6:.2f}M parameters), AdamW, ZeRO-1, global batch {args.batch}, "
        f"accumulation {ACCUM}, 4 gloo ranks; per rank (the largest over ranks), per step:"
    )
    print(
        f"{'layout':<12} {'step ms':>9} {'model state MB':>15} "
        f"{'DP MB/step':>11} {'TP MB/step':>11} {'PP MB/step':>11}"
    )
    for layout in LAYOUTS:
        per_rank = [results[r][layout] for r in range(world)]

        def worst(key: str, ranks: list[dict[str, Any]] = per_rank) -> float:
            return max(r[key] for r in ranks)

        print(
            f"{layout:<12} {worst('ms'):>9.1f} {worst('state') / 1e6:>15.2f} "
            f"{worst('dp') / 1e6:>11.3f} {worst('tp') / 1e6:>11.3f} {worst('pp') / 1e6:>11.3f}"
        )


if __name__ == "__main__":
    main()
