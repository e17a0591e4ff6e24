"""The longest sequence one training step fits, at 1 rank and split over 2 ranks (Ulysses
``sequence_parallel_size=2`` or ring attention ``context_parallel_size=2``), and the step time
of the same tokens either way.

    python benchmarks/bench_long_seq.py                       # budget 1 GiB a rank
    python benchmarks/bench_long_seq.py --budget-mib 2048 --layers 4 --d 256
    python benchmarks/bench_long_seq.py --checkpointing       # with activation checkpointing

"Fits" means the step's peak resident memory above what the rank held before it stays within
``--budget-mib`` on every rank: each trial is a new set of processes, so the peak is this
step's. The search doubles the length until a step no longer fits, then bisects to
``--granularity`` tokens. The demo GPT has one learned position per token, so its positions
grow with the length (a few MiB). Then each layout runs ``--steps`` steps at the 1-rank
limit and the median step time is printed beside the 1-rank one.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run  # noqa: E402

import ds_strategy  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig  # noqa: E402

LAYOUTS = {
    "1 rank": (1, {}),
    "2 ranks, sequence_parallel_size=2": (2, {"sequence_parallel_size": 2}),
    "2 ranks, context_parallel_size=2": (2, {"context_parallel_size": 2}),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _trial(rank: int, world: int, length: int, sizes: dict[str, int], args: Any) -> dict:
    """One or more steps at ``length`` tokens: this rank's peak growth and step times."""
    torch.manual_seed(0)
    config = GPTConfig(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, seq=length)
    model = GPT(config)
    ds_config: dict[str, Any] = {"zero_optimization": {"stage": 1}, **sizes}
    if args.checkpointing:
        ds_config["activation_checkpointing"] = {"enabled": True}
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), ds_config
    )
    tokens = torch.randint(
        0, args.vocab, (1, length + 1), generator=torch.Generator().manual_seed(1)
    )
    before, times = _rss_mib(), []
    for _ in range(args.steps if args.timed else 1):
        start = time.perf_counter()
        if engine.sequence is not None:
            local = engine.sequence.shard(tokens[:, :-1], shift_labels=tokens[:, 1:])
            logits = engine(local["input_ids"], position_ids=local["position_ids"])
            loss = engine.sequence.loss(logits, local["shift_labels"], local["num_items_in_batch"])
        else:
            logits = engine(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[0, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        del logits, loss
    return {"growth": _peak_mib() - before, "times": times}


def _fits(length: int, layout: str, args: Any) -> tuple[bool, float]:
    world, sizes = LAYOUTS[layout]
    args.timed = False
    results = run(_trial, world, length, sizes, args)
    worst = max(r["growth"] for r in results.values())
    return worst <= args.budget_mib, worst


def longest(layout: str, args: Any) -> tuple[int, float]:
    """The longest length (a multiple of the granularity) whose step fits the budget."""
    g = args.granularity
    good, growth = 0, 0.0
    length = args.start
    while True:  # doubling
        ok, used = _fits(length, layout, args)
        print(f"  {layout}: {length} tokens, peak +{used:.0f} MiB: {'fits' if ok else 'no'}")
        if not ok:
            break
        good, growth, length = length, used, 2 * length
    low, high = good, length
    while high - low > g:  # bisect
        mid = (low + high) // 2 // g * g
        if mid in (low, high):
            break
        ok, used = _fits(mid, layout, args)
        print(f"  {layout}: {mid} tokens, peak +{used:.0f} MiB: {'fits' if ok else 'no'}")
        if ok:
            low, good, growth = mid, mid, used
        else:
            high = mid
    return good, growth


def step_time(length: int, layout: str, args: Any) -> float:
    world, sizes = LAYOUTS[layout]
    args.timed = True
    results = run(_trial, world, length, sizes, args)
    return statistics.median(
        max(r["times"][i] for r in results.values()) for i in range(1, args.steps)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=1024)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    print(
        f"demo GPT d={args.d} layers={args.layers} heads={args.heads} vocab={args.vocab}, one "
        f"sequence a step, ZeRO-1, budget {args.budget_mib:.0f} MiB of peak growth a rank"
        + (", activation checkpointing" if args.checkpointing else "")
    )
    found = {layout: longest(layout, args) for layout in LAYOUTS}
    base = found["1 rank"][0]
    times = {layout: step_time(base, layout, args) for layout in LAYOUTS}
    print(
        f"\n| layout | longest sequence | vs 1 rank | peak growth | step at {base} tokens | vs 1 rank |"
    )
    print("|---|---|---|---|---|---|")
    for layout, (length, growth) in found.items():
        t = times[layout]
        print(
            f"| {layout} | {length} | {length / base:.2f}x | {growth:.0f} MiB | {t:.3f} s | "
            f"{t / times['1 rank']:.2f}x |"
        )


if __name__ == "__main__":
    main()
