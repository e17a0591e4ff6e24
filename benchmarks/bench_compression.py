"""Gradient compression side by side: dense ZeRO-1 against top-k sparsification with error
feedback (several ratios) on 2 and 4 gloo ranks, the demo GPT on the README's characters
(the recipes' corpus), SGD with momentum (top-k with Deep Gradient Compression's momentum
correction, after 10 dense warm-up steps). Per run: the gradient bytes a rank sends per step,
the median step time, the loss at the end, and what compressing costs in compute.

    python benchmarks/bench_compression.py
    python benchmarks/bench_compression.py --steps 200 --ratios 0.1 0.01

[Note: when compression pays]
A compressed step sends fewer bytes but spends compute selecting the top entries and adding
the received ones (measured here around ``TopK.select`` and ``set_reduced_grad``). It is
faster when the bytes saved take longer on the link than that compute: below a bandwidth of
``(dense bytes - compressed bytes) / compute seconds`` per step, the column "pays below".
Loopback on one machine is far above it, so the step times here show the compute cost, not
the benefit; the bandwidth is what to compare with the links between machines.

DeepSpeed's 1-bit optimizers (``OneBitAdam`` and its relatives) are not in this release.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from ds_strategy.core.compression import TopK  # noqa: E402
from ds_strategy.core.zero.flat_group import FlatParamGroup  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig  # noqa: E402
from recipes.data import CharCorpus  # noqa: E402

WARMUP = 10


class _ComputeTimer:
    """Seconds spent in the local work of compression (selection, applying the result)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for owner, name in ((TopK, "select"), (FlatParamGroup, "set_reduced_grad")):
            self._wrap(owner, name)

    def _wrap(self, owner: type, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)


def _train(rank: int, world: int, ratio: float | None, args: argparse.Namespace) -> dict[str, Any]:
    timer = _ComputeTimer()
    corpus = CharCorpus(Path(__file__).resolve().parent.parent / "README.md", args.seq, 7)
    torch.manual_seed(0)
    model = GPT(GPTConfig(corpus.vocab, args.d, args.layers, args.heads, args.seq))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gc = {"method": "none"}
    if ratio is not None:
        gc = {"method": "topk", "ratio": ratio, "warmup_steps": WARMUP, "momentum_correction": True}
    config = {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
              "gradient_compression": gc}  # fmt: skip
    engine = ds_strategy.initialize(model, opt, config)
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(1))
    per = args.batch // world
    times, losses = [], []
    for step in range(args.steps):
        if step == WARMUP:
            engine.comm_report()
            timer.seconds = 0.0
        rows = order[(step * args.batch + rank * per) % len(order) :][:per]
        batch = torch.stack([corpus[int(i)] for i in rows])
        torch.distributed.barrier()
        t0 = time.perf_counter()
        logits = engine(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    report = engine.comm_report()
    measured = args.steps - WARMUP
    grad = sum(report.get(k, 0) for k in ("all_reduce", "reduce_scatter", "topk")) / measured
    return {
        "grad_bytes": grad,
        "ms": statistics.median(times[WARMUP:]) * 1e3,
        "loss": sum(losses[-10:]) / 10,
        "compute_s": timer.seconds / measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(
        f"demo GPT d={args.d} layers={args.layers} seq={args.seq}, README corpus, SGD(0.9), "
        f"ZeRO-1, global batch {args.batch}, {args.steps} steps ({WARMUP} dense warm-up); "
        "per rank (rank 0), per step after the warm-up:"
    )
    print(
        f"{'ranks':>5} {'method':<12} {'grad KB/step':>13} {'vs dense':>9} {'step ms':>8} "
        f"{'final loss':>11} {'compute ms':>11} {'pays below':>12}"
    )
    for world in args.worlds:
        dense = run(_train, world, None, args)[0]
        rows = [("dense", dense)] + [
            (f"top-k {r:g}", run(_train, world, r, args)[0]) for r in args.ratios
        ]
        for name, r in rows:
            saved = dense["grad_bytes"] - r["grad_bytes"]
            pays = f"{saved / r['compute_s'] / 1e6:>8.0f} MB/s" if name != "dense" else f"{'-':>12}"
            print(
                f"{world:>5} {name:<12} {r['grad_bytes'] / 1e3:>13.1f} "
                f"{r['grad_bytes'] / dense['grad_bytes']:>9.3f} {r['ms']:>8.1f} "
                f"{r['loss']:>11.3f} {r['compute_s'] * 1e3:>11.2f} {pays}"
            )


if __name__ == "__main__":
    main()
