"""Each engine against the no-communication floor, side by side in one run, two orders.

    python benchmarks/bench_floor.py                       # 2 CPU ranks, demo GPT 29.5M
    python benchmarks/bench_floor.py --steps 4 --layers 2  # a quick look
    python benchmarks/bench_floor.py --json floor.json     # and every reading

The floor is the same per-rank work with no collective at all: on every rank the same model,
the same micro-batch and torch's fused AdamW over every parameter, as one process alone would
run it (world 1), while the other ranks do the same on their cores, so the machine is as
busy as it is for the engines. DDP and ZeRO stages 1-3 each run the same steps with
their communication. Every engine is built and warmed up first; then the timed steps
interleave, in two orders (see [Note: balanced orders]).

Prints, per engine: the median step time in each order; in each order the median of its
steps' ratios to the floor's step nearest it in time, and the worse of the two; the ratio of
the median steps, the worse order's; and the CPU time a step takes on rank 0, its
communication threads included. Where every core is busy (two ranks on two cores),
time spent moving bytes cannot overlap anything: the step's wall-time ratio then follows
its CPU-time ratio. Then memory, which the speed of an engine must not be bought with: the
model state per rank after a step (live tensors; DDP's buckets are in C++, out of sight)
against the engine's formula, and for ZeRO the engine's own peak of model state over each
order's steps (``memory_report()["peak"]``: buckets and gathered parameters included),
which must be the same in both orders to the byte.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _ranks  # noqa: E402
import bench_zero  # noqa: E402
from bench_zero import Step, plain_step, setup_ddp, setup_zero  # noqa: E402

from ds_strategy import ZeroEngine  # noqa: E402
from ds_strategy.core.memory import live_tensor_bytes  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig  # noqa: E402

ENGINES = ("floor", "ddp", "zero1", "zero2", "zero3")


def formula(name: str, psi: int, n: int) -> float:
    """Model state per rank with fp32 AdamW: bench_zero's, the floor holding all of it as
    DDP does."""
    return bench_zero.formula("ddp" if name == "floor" else name, psi, n)


def timed(step: Step, batch: torch.Tensor) -> tuple[float, float]:
    """(wall seconds of the step, every rank in step; CPU seconds this process spent in it,
    its communication threads included)."""
    dist.barrier()
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    step(batch)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    dist.barrier()
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return time.perf_counter() - t0, cpu


def balanced_order(names: list[str]) -> list[str]:
    """[Note: balanced orders]
    A step runs a little faster or slower after some engines than after others (what the
    one before left in the allocator and the caches): a fixed round-robin gives each engine
    one predecessor for the whole run, and in one measured run the floor took 1.48 s a step
    after ZeRO-3 and 1.32 s after DDP, which moved every ratio of that order. So the timed
    steps follow a cycle through every ordered pair of engines once (an Eulerian circuit of
    the complete directed graph, found by Hierholzer's walk): every engine runs ``n - 1``
    times in it, once after each other engine. The second order is the same cycle reversed,
    also balanced, so the two orders differ only in noise.

    Returns the cycle, one entry per timed step; its last entry precedes its first.
    """
    n = len(names)
    if n == 1:
        return list(names)
    best: list[int] = []
    best_gap = 0
    for seed in range(200):  # the spread-out one: no engine's runs bunched in the cycle
        order = random.Random(seed)
        unused = {a: order.sample([b for b in range(n) if b != a], n - 1) for a in range(n)}
        stack, cycle = [0], []
        while stack:
            a = stack[-1]
            if unused[a]:
                stack.append(unused[a].pop())
            else:
                cycle.append(stack.pop())
        cycle = cycle[:-1]  # a closed walk: first == last
        gap = _widest_gap(cycle)
        if not best or gap < best_gap:
            best, best_gap = cycle, gap
    return [names[i] for i in best]


def _widest_gap(cycle: list[int]) -> int:
    """The most steps between two runs of one engine, round the cycle."""
    widest = 0
    for a in set(cycle):
        at = [i for i, b in enumerate(cycle) if b == a]
        widest = max(
            widest, *(j - i for i, j in zip(at, at[1:] + [at[0] + len(cycle)], strict=True))
        )
    return widest


def build(name: str, model: nn.Module, n: int) -> tuple[Step, ZeroEngine | None]:
    if name == "floor":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return plain_step(model, opt), None
    if name == "ddp":
        return setup_ddp(model, n)[0], None
    step, _, engine = setup_zero(int(name[-1]), model, reuse=True)  # the engine's default
    return step, engine


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    c = GPTConfig(layers=args.layers, d=args.d)
    torch.manual_seed(0)
    base = GPT(c)
    psi = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1 + rank)
    data = [torch.randint(0, c.vocab, (args.micro, c.seq + 1), generator=g) for _ in range(4)]
    steps, engines, state = {}, {}, {}
    for name in args.engines:
        before = live_tensor_bytes()
        steps[name], engines[name] = build(name, copy.deepcopy(base), world)
        for i in range(args.warmup):  # stage 3 records its unit order on the first step
            steps[name](data[i % len(data)])
        state[name] = live_tensor_bytes() - before  # its parameters, gradients, Adam state
    cpu: dict[str, list[float]] = {name: [] for name in args.engines}
    peaks: dict[str, list[int]] = {name: [] for name, e in engines.items() if e is not None}
    cycle = balanced_order(list(args.engines))
    rounds = -(-args.steps // max(1, len(args.engines) - 1))  # each engine >= steps times
    sequences = [cycle * rounds, cycle[::-1] * rounds]
    walls: list[list[float]] = [[], []]  # every timed step of each order, in turn
    for order, sequence in enumerate(sequences):
        steps[sequence[-1]](data[0])  # the first timed step's predecessor, as in the cycle
        for engine in engines.values():
            if engine is not None:
                engine.reset_peak_memory()
        for i, name in enumerate(sequence):
            wall, used = timed(steps[name], data[i % len(data)])
            walls[order].append(wall)
            cpu[name].append(used)
        for name in peaks:
            peaks[name].append(engines[name].memory_report()["peak"])
    return {
        "psi": psi,
        "cpu": cpu,
        "state": state,
        "peaks": peaks,
        "sequence": sequences,
        "walls": walls,
    }


def paired_ratios(sequence: list[str], walls: list[float], name: str) -> list[float]:
    """Each of ``name``'s steps over the floor's step nearest it in time (the earlier on a
    tie), so a machine that slows down for a minute slows both sides of each ratio."""
    floors = [i for i, n in enumerate(sequence) if n == "floor"]
    return [
        walls[i] / walls[min(floors, key=lambda j: (abs(i - j), j))]
        for i, n in enumerate(sequence)
        if n == name
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument(
        "--steps",
        type=int,
        default=8,
        help="timed steps per engine per order, rounded up to whole cycles (each engine n-1 "
        "times a cycle)",
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--json", type=Path, help="also write every reading to this JSON file")
    args = ap.parse_args()
    if args.engines[0] != "floor":
        args.engines = ["floor", *[e for e in args.engines if e != "floor"]]
    results = _ranks.run(worker, args.world, args)
    report(results, args)


def step_ratios(
    results: dict[int, dict], names: list[str]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per engine and order: the median step time, and the median of its steps' ratios to
    the floor's nearest step (:func:`paired_ratios`). A step's time is its slowest rank's:
    every rank waits for it at the barrier."""
    sequences = results[0]["sequence"]
    med: dict[str, list[float]] = {name: [] for name in names}
    paired: dict[str, list[float]] = {name: [] for name in names}
    for o, sequence in enumerate(sequences):
        walls = [max(results[r]["walls"][o][i] for r in results) for i in range(len(sequence))]
        for name in names:
            med[name].append(
                statistics.median(w for w, n in zip(walls, sequence, strict=True) if n == name)
            )
            paired[name].append(statistics.median(paired_ratios(sequence, walls, name)))
    return med, paired


def report(results: dict[int, dict], args: argparse.Namespace) -> None:
    psi, n = results[0]["psi"], args.world
    med, paired = step_ratios(results, list(args.engines))
    print(
        f"demo GPT {psi / 1e6:.1f}M parameters, {n} CPU ranks x 1 thread, micro-batch "
        f"{args.micro}x{GPTConfig().seq}, {results[0]['sequence'][0].count('floor')} steps per "
        "engine per order, each engine after each other equally often"
    )
    # CPU time a step, rank 0's process (its communication threads included), both orders
    cpu = {name: statistics.median(results[0]["cpu"][name]) for name in args.engines}
    print(
        "vs floor: the median of each step's ratio to the floor's step nearest it in time; "
        "medians' ratio: the ratio of the median steps, the worse order's"
    )
    print(
        "| engine | step, order 1 (s) | step, order 2 (s) | vs floor, order 1 | order 2 | worst "
        "| medians' ratio | CPU a step (s) | vs floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.engines:
        r = max(med[name][o] / med["floor"][o] for o in (0, 1))
        p = paired[name]
        print(
            f"| {name} | {med[name][0]:.3f} | {med[name][1]:.3f} | {p[0]:.3f}x | {p[1]:.3f}x | "
            f"{max(p):.3f}x | {r:.3f}x | {cpu[name]:.3f} | {cpu[name] / cpu['floor']:.3f}x |"
        )
    print()
    print("Model state per rank after a step, and ZeRO's peak over each order's steps (bytes):")
    print("| engine | formula | after a step | vs formula | peak, order 1 | peak, order 2 | same |")
    print("|---|---|---|---|---|---|---|")
    for name in args.engines:
        f = formula(name, psi, n)
        got = max(results[r]["state"][name] for r in results)
        peaks = [results[r]["peaks"].get(name) for r in results]
        if peaks[0] is None:
            cells = "n/a | n/a | n/a"
        else:
            worst = [max(p[o] for p in peaks) for o in (0, 1)]
            same = all(p[0] == p[1] for p in peaks)
            cells = f"{worst[0]} | {worst[1]} | {'yes' if same else 'NO'}"
        print(f"| {name} | {f:.0f} | {got} | {got / f:.4f}x | {cells} |")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"psi": psi, "median": med, "vs_floor": paired, "ranks": results}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
