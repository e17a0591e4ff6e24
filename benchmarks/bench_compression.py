"""Gradient compression side by side on 2 and 4 gloo ranks, the demo GPT on a fixed text
(tests/data/corpus.txt): dense ZeRO-1 SGD with momentum against top-k
sparsification with error feedback (several ratios, Deep Gradient Compression's momentum
correction, after 10 dense warm-up steps); and dense Adam (ZeRO-0, no bias correction)
against DeepSpeed's 1-bit Adam (compressed from step 10) and 0/1 Adam (variance steps at
first, local steps after half the run). Per run: the gradient bytes a rank sends per step,
the median step time, the loss at the end, and what compressing costs in compute; each
compressed row is compared with its own dense row.

    python benchmarks/bench_compression.py
    python benchmarks/bench_compression.py --steps 200 --ratios 0.1 0.01

[Note: when compression pays]
A compressed step sends fewer bytes but spends compute selecting the top entries and adding
the received ones (measured here around ``TopK.select`` and ``set_reduced_grad``). It is
faster when the bytes saved take longer on the link than that compute: below a bandwidth of
``(dense bytes - compressed bytes) / compute seconds`` per step, the column "pays below".
Loopback on one machine is far above it, so the step times here show the compute cost, not
the benefit; the bandwidth is what to compare with the links between machines. For the
1-bit optimizers the compute is the packing and unpacking of signs (``compress_signs``,
``decompress_signs``) and applying the result.
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
from ds_strategy.core.compression import TopK, onebit  # noqa: E402
from ds_strategy.core.zero.flat_group import FlatParamGroup  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig  # noqa: E402
from recipes.data import CharCorpus  # noqa: E402

# the tests' fixed text (this project's README as it was at one release), not the live README
CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus.txt"

WARMUP = 10


class _ComputeTimer:
    """Seconds spent in the local work of compression (selection, applying the result)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for owner, name in (
            (TopK, "select"),
            (FlatParamGroup, "set_reduced_grad"),
            (onebit, "compress_signs"),
            (onebit, "decompress_signs"),
        ):
            self._wrap(owner, name)

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)


def _setup(method: str, args: argparse.Namespace, model: GPT) -> tuple[Any, dict[str, Any]]:
    """The optimizer (or ``None`` for a config section) and the config of one row."""
    if method.startswith("top-k") or method == "dense SGD":
        gc = {"method": "none"}
        if method != "dense SGD":
            ratio = float(method.split()[1])
            gc = {"method": "topk", "ratio": ratio, "warmup_steps": WARMUP,
                  "momentum_correction": True}  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        return opt, {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
                     "gradient_compression": gc}  # fmt: skip
    params: dict[str, Any] = {"lr": args.adam_lr, "weight_decay": 0.01, "bias_correction": False}
    if method == "1-bit Adam":
        section = {"type": "OneBitAdam", "params": {**params, "freeze_step": WARMUP}}
    elif method == "0/1 Adam":
        half = args.steps // 2  # variance steps on the schedule, then local steps
        section = {"type": "ZeroOneAdam", "params": {**params, "var_freeze_step": half,
                   "var_update_scaler": 16, "local_step_scaler": 10, "local_step_clipper": 4}}  # fmt: skip
    else:
        section = {"type": "Adam", "params": params}
    return None, {"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
                  "optimizer": section}  # fmt: skip


def _train(rank: int, world: int, method: str, args: argparse.Namespace) -> dict[str, Any]:
    timer = _ComputeTimer()
    corpus = CharCorpus(CORPUS, args.seq, 7)
    torch.manual_seed(0)
    model = GPT(GPTConfig(corpus.vocab, args.d, args.layers, args.heads, args.seq))
    opt, config = _setup(method, args, model)
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
    kinds = ("all_reduce", "reduce_scatter", "topk", "onebit")
    grad = sum(report.get(k, 0) for k in kinds) / measured
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
    parser.add_argument("--lr", type=float, default=0.1, help="SGD's")
    parser.add_argument("--adam-lr", type=float, default=3e-3, help="the Adam rows'")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print(
        f"demo GPT d={args.d} layers={args.layers} seq={args.seq}, fixed corpus, global batch "
        f"{args.batch}, {args.steps} steps; SGD(0.9) at ZeRO-1 with top-k after {WARMUP} dense "
        f"steps; Adam at ZeRO-0, 1-bit Adam frozen at step {WARMUP}, 0/1 Adam local from step "
        f"{args.steps // 2}; per rank (rank 0), per step after step {WARMUP}:"
    )
    print(
        f"{'ranks':>5} {'method':<12} {'grad KB/step':>13} {'vs dense':>9} {'step ms':>8} "
        f"{'final loss':>11} {'compute ms':>11} {'pays below':>12}"
    )
    families = [["dense SGD"] + [f"top-k {r:g}" for r in args.ratios],
                ["dense Adam", "1-bit Adam", "0/1 Adam"]]  # fmt: skip
    for world in args.worlds:
        for family in families:
            rows = [(name, run(_train, world, name, args)[0]) for name in family]
            dense = rows[0][1]
            for name, r in rows:
                saved = dense["grad_bytes"] - r["grad_bytes"]
                pays = f"{'-':>12}" if r is dense else f"{saved / r['compute_s'] / 1e6:>8.0f} MB/s"
                print(
                    f"{world:>5} {name:<12} {r['grad_bytes'] / 1e3:>13.1f} "
                    f"{r['grad_bytes'] / dense['grad_bytes']:>9.3f} {r['ms']:>8.1f} "
                    f"{r['loss']:>11.3f} {r['compute_s'] * 1e3:>11.2f} {pays}"
                )


if __name__ == "__main__":
    main()
