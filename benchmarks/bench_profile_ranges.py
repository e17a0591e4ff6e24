"""What the ``ds_strategy::*`` profiler ranges cost when no profiler runs, side by side.

    python benchmarks/bench_profile_ranges.py                 # 2 CPU ranks, ZeRO-3, tiny GPT
    python benchmarks/bench_profile_ranges.py --world 1 --nvme /tmp/swap --steps 40

Three variants of one engine, timed round-robin step by step (so drift in the machine's load
falls on all of them alike; see [Note: interleaved timing] in ``bench_zero.py``):

- ``without``: the ranges taken out (the phases, collectives, swap and checkpoint calls
  unwrapped to the functions under them);
- ``gated`` (what ships): a range is entered only while a profiler records, otherwise one
  flag test (``core/profiling/ranges.py``);
- ``always``: ``record_function`` entered on every call, profiler or not, which is what the
  gate avoids.

Every weight is sharded (``stage3_param_persistence_threshold: 0``) and the reduce bucket is
small, so a step crosses many ranges. Prints the median step time of each and the ratios to
``without``, and how many ranges one step enters (counted under a profiler).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from ds_strategy.core import collectives, timers  # noqa: E402
from ds_strategy.core.checkpoint import manager  # noqa: E402
from ds_strategy.core.offload import swap  # noqa: E402
from ds_strategy.core.profiling import ranges  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

WRAPPED = [
    (collectives.Comm, "reduce_scatter"),
    (collectives.Comm, "all_gather"),
    (swap.SwappedTensor, "prefetch"),
    (swap.SwappedTensor, "_free_or_write"),
    (manager.CheckpointManager, "save"),
    (manager.CheckpointManager, "load"),
]
GATED = {(cls, name): getattr(cls, name) for cls, name in WRAPPED}


def variant(kind: str) -> None:
    """Install ``kind``'s ranges on the classes and in ``timers.phase``."""
    on = {"without": lambda: False, "gated": ranges.profiling, "always": lambda: True}[kind]
    timers.profiling = on  # the phases' test
    for (cls, name), fn in GATED.items():
        plain = fn.__wrapped__
        if kind == "without":
            setattr(cls, name, plain)
        elif kind == "gated":
            setattr(cls, name, fn)
        else:
            setattr(cls, name, _always(plain, ranges.PREFIX + name))
    swap.profile_range = {
        "without": lambda n: ranges._NULL,
        "gated": ranges.profile_range,
        "always": lambda n: ranges.record_function(ranges.PREFIX + n),
    }[kind]


def _always(fn: Any, name: str) -> Any:
    def inner(*args: Any, **kwargs: Any) -> Any:
        with ranges.record_function(name):
            return fn(*args, **kwargs)

    return inner


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, d=args.d, layers=args.layers, heads=4, seq=32))
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    zero["reduce_bucket_size"] = 4096
    if args.nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme}
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero_optimization": zero}
    )
    tokens = torch.randint(0, 256, (args.batch, 33), generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        start = time.perf_counter()
        engine.backward(gpt_loss(engine, tokens))
        engine.step()
        return time.perf_counter() - start

    for _ in range(3):
        step()
    kinds = ("without", "gated", "always")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.steps):
        for k in kinds[i % 3 :] + kinds[: i % 3]:  # each variant first as often as the others
            variant(k)
            times[k].append(step())
    variant("gated")
    with profile() as prof:
        step()
    entered = sum(1 for e in prof.events() if e.name.startswith(ranges.PREFIX))
    return {
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "min_ms": {k: min(v) * 1e3 for k, v in times.items()},
        "ranges": entered,
        "per_call_ns": per_call_ns(),
    }


def per_call_ns(n: int = 200_000) -> dict[str, float]:
    """One range's cost with no profiler, gated and always (the best of three runs of n)."""

    def gated() -> None:
        with ranges.profile_range("forward"):
            pass

    def always() -> None:
        with ranges.record_function("ds_strategy::forward"):
            pass

    out = {}
    for name, fn in (("gated", gated), ("always", always)):
        out[name] = min(timeit.timeit(fn, number=n) for _ in range(3)) / n * 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--nvme", default=None, help="offload parameters to this directory")
    args = parser.parse_args()
    result = run(bench, args.world, args)[0]
    ms = result["median_ms"]
    print(
        f"ZeRO-3, {args.world} rank(s), GPT d={args.d} x {args.layers} layers, "
        f"nvme={'yes' if args.nvme else 'no'}; {result['ranges']} ranges per step (rank 0)"
    )
    low, ns = result["min_ms"], result["per_call_ns"]
    print(f"{'variant':<10}{'median ms':>12}{'/ without':>11}{'min ms':>10}{'/ without':>11}")
    for k in ("without", "gated", "always"):
        print(
            f"{k:<10}{ms[k]:>12.3f}{ms[k] / ms['without']:>11.4f}"
            f"{low[k]:>10.3f}{low[k] / low['without']:>11.4f}"
        )
    print("one range, no profiler: " + ", ".join(f"{k} {v:.0f} ns" for k, v in ns.items()))
    for k in ("gated", "always"):
        share = result["ranges"] * ns[k] * 1e-6 / ms["without"]
        print(f"{k}: {result['ranges']} ranges x {ns[k]:.0f} ns = {share:.4%} of the step")


if __name__ == "__main__":
    main()
