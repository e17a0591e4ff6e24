"""Eager vs torch.compile'd ZeRO-1/2/3 and FSDP2 on one GPT, side by side in one run.

    python benchmarks/bench_compile.py                    # 2 CPU ranks (gloo), inductor
    python benchmarks/bench_compile.py --backend aot_eager --steps 6
    python benchmarks/bench_compile.py --engines zero3 fsdp2 --layers 4 --d 256

Every engine trains the same GPT (each block compiled, as ``compile.enabled`` does for ZeRO
and as torchtitan does for FSDP2: ``block.compile()`` per transformer block) with AdamW. All
engines are built and warmed up first (compilation happens then), then the timed steps go
round-robin, engine after engine (see [Note: interleaved timing] in ``bench_zero.py``).
Prints the median step time of each, compiled over eager for each engine, and each ZeRO
engine's ratio to FSDP2 in the same mode; plus what ``compile_report()`` says (graphs,
graph breaks) and the largest weight difference between each compiled run and its eager
twin after the warm-up steps.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402


def build(name: str, compiled: bool, base: nn.Module, world: int, backend: str) -> tuple[Any, Any]:
    """(step function, what reports the engine's compilation or None)."""
    model = copy.deepcopy(base)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            if compiled:
                block.compile(backend=backend)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def fsdp_step(batch: torch.Tensor) -> None:
            gpt_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()

        return fsdp_step, None
    block = sum(p.numel() for p in model.blocks[0].parameters())
    config: dict[str, Any] = {
        "zero_optimization": {
            "stage": int(name[-1]),
            "reduce_bucket_size": 6_250_000,
            "stage3_param_persistence_threshold": 0,  # every block weight sharded
            "stage3_prefetch_bucket_size": block,
        },
        "compile": {"enabled": compiled, "backend": backend},
    }
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)

    def zero_step(batch: torch.Tensor) -> None:
        engine.backward(gpt_loss(engine, batch))
        engine.step()

    return zero_step, engine


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    c = GPTConfig(layers=args.layers, d=args.d)
    torch.manual_seed(0)
    base = GPT(c)
    psi = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1 + rank)
    data = [torch.randint(0, c.vocab, (args.micro, c.seq + 1), generator=g) for _ in range(4)]
    steps, reports, warm_s, gaps = {}, {}, {}, {}
    finals: dict[str, dict[str, torch.Tensor]] = {}
    for name in args.engines:
        for compiled in (False, True):
            key = f"{name}{'-compiled' if compiled else ''}"
            t0 = time.perf_counter()
            step, engine = build(name, compiled, base, world, args.backend)
            for i in range(args.warmup):
                step(data[i % len(data)])
            warm_s[key] = time.perf_counter() - t0
            steps[key] = step
            if engine is not None:
                finals[key] = engine.full_state_dict()
                if compiled:
                    reports[key] = engine.compile_report()
                    eager = finals[name]
                    gaps[key] = max((finals[key][k] - eager[k]).abs().max().item() for k in eager)
    times: dict[str, list[float]] = {key: [] for key in steps}
    for i in range(args.steps):
        for key, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(data[i % len(data)])
            dist.barrier()
            times[key].append(time.perf_counter() - t0)
    return {
        "psi": psi,
        "median": {k: statistics.median(v) for k, v in times.items()},
        "warm_s": warm_s,
        "reports": reports,
        "gaps": gaps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per engine")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--engines", nargs="+", default=["zero1", "zero2", "zero3", "fsdp2"])
    args = ap.parse_args()
    res = run(worker, args.world, args)[0]
    med = res["median"]
    print(
        f"GPT {res['psi'] / 1e6:.1f}M parameters ({args.layers} blocks, d={args.d}), "
        f"{args.world} ranks x 1 thread on cpu, micro-batch {args.micro}, backend "
        f"{args.backend}, median of {args.steps} interleaved steps after {args.warmup} warm-up"
    )
    print(
        "| engine | eager step (s) | compiled step (s) | compiled / eager | "
        "eager vs FSDP2 | compiled vs compiled FSDP2 | new graphs | breaks | warm-up (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    fsdp = (med.get("fsdp2", float("nan")), med.get("fsdp2-compiled", float("nan")))
    for name in args.engines:
        e, c = med[name], med[f"{name}-compiled"]
        rep = res["reports"].get(f"{name}-compiled")
        graphs = "n/a" if rep is None else str(rep["graphs"])
        breaks = "n/a" if rep is None else str(rep["graph_breaks"])
        print(
            f"| {name} | {e:.3f} | {c:.3f} | {c / e:.2f}x | {e / fsdp[0]:.2f}x | "
            f"{c / fsdp[1]:.2f}x | {graphs} | {breaks} | "
            f"{res['warm_s'][f'{name}-compiled']:.0f} |"
        )
    for key, gap in res["gaps"].items():
        print(f"{key}: weights after warm-up within {gap:.1e} of eager")


if __name__ == "__main__":
    main()
