"""Below sixteen bytes a parameter: model state per rank, the largest model that trains, and
the loss after training, for fp32 AdamW, bf16 masters and states, bf16 states, torchao's
8-bit and 4-bit AdamW, and Muon, each at ZeRO-3 on 2 ranks.

    python benchmarks/bench_lowmem.py                      # all three tables
    python benchmarks/bench_lowmem.py --steps 300 --budget-mib 512 --search-d 512

1. **Model state** of the demo GPT (``--d``, ``--layers``) on 2 ranks at ZeRO-3 after a step:
   ``memory_report()``'s parameters, gradients and optimizer state, beside the formula of the
   row's bytes a parameter, and the worst model state reported during a step (``peak``).
2. **The largest demo GPT that trains** without offload: ``--search-d`` wide, as many layers
   as fit, built on the meta device so a rank never holds the whole model. A size fits when
   the peak resident memory of two steps on one sequence of 16 tokens (``VmHWM``, reset after a one-layer model's step
   run before it: what the option imports and the kernels' first buffers are not the
   model's) above the resident size then stays within ``--budget-mib`` on both ranks (the ranks run with glibc's mmap threshold fixed, see
   bench_long_seq.py). Bisected on the layer count to a 16th, then reported as parameters
   and as a ratio to fp32 AdamW. The search runs as someone fitting the largest model would:
   every block's activations checkpointed (``--no-checkpointing``: kept, about 0.2 MiB a
   layer at d=256, the same for every row), ``stage3_prefetch_bucket_size`` at
   ``--prefetch`` elements and ``stage3_max_reuse_distance`` at 0 (DeepSpeed's defaults,
   5e7 and 1e9 elements, keep the whole of these models gathered: 4 bytes a parameter on
   every rank, more than fp32 AdamW's sharded state).
3. **The loss** after ``--steps`` steps on the docs corpus (tests/data/corpus.txt, characters),
   global batch ``--batch``: the mean of the last 10 steps, and its ratio to fp32 AdamW's.

torchao's optimizers run their step eagerly here (``--torchao-compile`` lets them compile it
per piece shape, as they do by default: minutes of compiling on a CPU).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _ranks import run  # noqa: E402

import ds_strategy  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig, init_weights  # noqa: E402
from recipes.data import CharCorpus  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "corpus.txt"
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}}
BF16 = {"enabled": True}
# name: (config sections, bytes a parameter (P + G + K), or None: counted per parameter)
OPTIONS: dict[str, tuple[dict[str, Any], float | None]] = {
    "fp32 AdamW": ({"optimizer": ADAMW}, 16),
    "bf16 masters + states": (
        {
            "optimizer": ADAMW,
            "bf16": {**BF16, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        },  # fmt: skip
        8,
    ),
    "bf16 states": ({"optimizer": ADAMW, "bf16": {**BF16, "bf16_optimizer_states": True}}, 12),
    "AdamW8bit": ({"optimizer": {**ADAMW, "type": "AdamW8bit"}}, None),
    "AdamW4bit": ({"optimizer": {**ADAMW, "type": "AdamW4bit"}}, None),
    "Muon": (
        {
            "optimizer": {
                "type": "Muon",
                "params": {
                    "lr": 0.02,
                    "momentum": 0.95,
                    "weight_decay": 0.01,
                    "adamw_lr": 3e-3,
                    "adamw_betas": [0.9, 0.95],
                },
            }
        },  # fmt: skip
        None,
    ),
}


def _per_param_bytes(name: str, cfg: GPTConfig) -> float:
    """The row's formula over the model's parameters (P + G + K, each as the row keeps it)."""
    model = GPT(cfg)
    total = 0.0
    for p in model.parameters():
        n = p.numel()
        if name.startswith("AdamW"):  # fp32 weights and gradients; quantized moments
            block, code = (256, 1.0) if name == "AdamW8bit" else (128, 0.5)
            quantized = n >= 4096 and n % block == 0
            total += n * (8 + (2 * (code + 4 / block) if quantized else 8))
        elif name == "Muon":  # one fp32 momentum for a matrix, AdamW's two moments otherwise
            total += n * (8 + (4 if p.ndim == 2 else 8))
        else:
            total += n * (OPTIONS[name][1] or 0)
    return total


def _engine(name: str, cfg: GPTConfig, args: argparse.Namespace, meta: bool) -> Any:
    sections, _ = OPTIONS[name]
    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": args.bucket, "sub_group_size": args.bucket,
                              "stage3_prefetch_bucket_size": args.prefetch,
                              "stage3_max_reuse_distance": 0},
        "gradient_clipping": 1.0,
        **sections,
    }  # fmt: skip
    if meta and args.checkpointing:  # the size search: see the module's docstring
        config["activation_checkpointing"] = {"enabled": True}
    torch.manual_seed(0)
    with torch.device("meta") if meta else nullcontext():
        model = GPT(cfg)
    return ds_strategy.initialize(model, None, config, param_init_fn=init_weights if meta else None)


def _eager(args: argparse.Namespace) -> Any:
    return nullcontext() if args.torchao_compile else mock.patch("torch.compile", lambda f, **k: f)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _state(rank: int, world: int, name: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = GPTConfig(vocab=256, d=args.d, layers=args.layers, heads=4, seq=args.seq)
    with _eager(args):
        engine = _engine(name, cfg, args, meta=False)
        batch = torch.randint(0, 256, (2, args.seq + 1), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            logits = engine(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
    r = engine.memory_report()
    return {"state": r["params"] + r["grads"] + r["optimizer_state"], "peak": r["peak"]}


def _steps(name: str, cfg: GPTConfig, args: argparse.Namespace, steps: int) -> None:
    with _eager(args):
        engine = _engine(name, cfg, args, meta=True)
        # one short sequence: the model's state, not its activations, is what is compared
        batch = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(1))
        # two steps: the optimizer state is made in the first, whose backward comes before
        # it; the second's backward holds it too
        for _ in range(steps):
            logits = engine(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            del logits, loss
        engine.destroy()


def _trial(rank: int, world: int, name: str, layers: int, args: argparse.Namespace) -> float:
    # a step of a one-layer model first: what the option imports on first use (torchao: over
    # 100 MiB) and the kernels' first-call buffers are the process's, not the model's
    _steps(name, GPTConfig(vocab=256, d=args.search_d, layers=1, heads=4, seq=16), args, 1)
    cfg = GPTConfig(vocab=256, d=args.search_d, layers=layers, heads=4, seq=16)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the size now (Linux)
    before = _rss_mib()
    _steps(name, cfg, args, 2)
    return _peak_rss_mib() - before


def _peak_rss_mib() -> float:
    """The process's peak resident size since the last reset (``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _largest(name: str, args: argparse.Namespace) -> int:
    """The most layers whose step fits the budget (doubling, then bisecting to 1/16)."""

    def fits(layers: int) -> bool:
        worst = max(run(_trial, 2, name, layers, args).values())
        print(f"  {name}: {layers} layers, peak +{worst:.0f} MiB", flush=True)
        return worst <= args.budget_mib

    good, layers = 0, 1
    while fits(layers):
        good, layers = layers, 2 * layers
    low, high = good, layers
    while high - low > max(1, low // 16):
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _train(rank: int, world: int, name: str, args: argparse.Namespace) -> float:
    corpus = CharCorpus(CORPUS, args.seq, 7)
    cfg = GPTConfig(vocab=corpus.vocab, d=args.d, layers=args.layers, heads=4, seq=args.seq)
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(1))
    per = args.batch // world
    losses = []
    with _eager(args):
        engine = _engine(name, cfg, args, meta=False)
        for step in range(args.steps):
            rows = order[(step * args.batch + rank * per) % len(order) :][:per]
            batch = torch.stack([corpus[int(i)] for i in rows])
            logits = engine(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / world)
    if rank == 0 and args.curve:
        Path(args.curve).mkdir(parents=True, exist_ok=True)
        out = Path(args.curve) / f"{name.replace(' ', '_').replace('+', 'and')}.csv"
        out.write_text("step,loss\n" + "".join(f"{i},{v:.5f}\n" for i, v in enumerate(losses)))
    return sum(losses[-10:]) / 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bucket", type=int, default=200_000, help="reduce bucket, step chunk")
    parser.add_argument(
        "--prefetch",
        type=int,
        default=200_000,
        help="stage3_prefetch_bucket_size (DeepSpeed's 5e7 gathers the whole of these models)",
    )
    parser.add_argument(
        "--search-d", type=int, default=256, help="width of the largest-model search"
    )
    parser.add_argument("--budget-mib", type=float, default=256, help="peak growth a rank")
    parser.add_argument(
        "--no-checkpointing",
        dest="checkpointing",
        action="store_false",
        help="size search without activation checkpointing",
    )
    parser.add_argument("--only", nargs="*", default=list(OPTIONS), help="rows to run")
    parser.add_argument("--skip", nargs="*", default=[], help="tables to skip: state size loss")
    parser.add_argument("--curve", default="", help="directory for each row's loss curve (csv)")
    parser.add_argument("--torchao-compile", action="store_true")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by each spawned rank
    names = [n for n in OPTIONS if n in args.only]
    if "state" not in args.skip:
        cfg = GPTConfig(vocab=256, d=args.d, layers=args.layers, heads=4, seq=args.seq)
        psi = sum(p.numel() for p in GPT(cfg).parameters())
        print(f"\n1. model state a rank, demo GPT d={args.d} layers={args.layers} "
              f"({psi / 1e6:.2f}M parameters), ZeRO-3 on 2 ranks, after 2 steps")  # fmt: skip
        print(f"{'option':<24}{'bytes/param':>12}{'state MiB':>11}{'formula MiB':>13}"
              f"{'ratio':>7}{'peak MiB':>10}{'vs fp32':>9}")  # fmt: skip
        base = None
        for name in names:
            r = run(_state, 2, name, args)[0]
            formula = _per_param_bytes(name, cfg) / 2
            base = base or r["state"]
            print(f"{name:<24}{2 * formula / psi:>12.2f}{r['state'] / 2**20:>11.2f}"
                  f"{formula / 2**20:>13.2f}{r['state'] / formula:>7.3f}"
                  f"{r['peak'] / 2**20:>10.2f}{r['state'] / base:>9.2f}")  # fmt: skip
    if "size" not in args.skip:
        print(f"\n2. the largest demo GPT d={args.search_d} that trains at ZeRO-3 without offload,"
              f" 2 ranks, budget {args.budget_mib:.0f} MiB of peak growth a rank")  # fmt: skip
        found = {}
        for name in names:
            layers = _largest(name, args)
            cfg = GPTConfig(vocab=256, d=args.search_d, layers=max(layers, 1), heads=4, seq=16)
            found[name] = (layers, sum(p.numel() for p in GPT(cfg).parameters()) if layers else 0)
        base_params = found[names[0]][1] or 1
        for name, (layers, params) in found.items():
            print(f"{name:<24}{layers:>4} layers {params / 1e6:>8.1f}M parameters "
                  f"{params / base_params:>6.2f}x")  # fmt: skip
    if "loss" not in args.skip:
        print(f"\n3. loss after {args.steps} steps on the docs corpus, demo GPT d={args.d} "
              f"layers={args.layers}, ZeRO-3 on 2 ranks, global batch {args.batch} "
              "(mean of the last 10 steps)")  # fmt: skip
        base_loss = None
        for name in names:
            loss = run(_train, 2, name, args)[0]
            base_loss = base_loss or loss
            print(f"{name:<24}{loss:>8.4f}{loss / base_loss:>8.3f}x", flush=True)


if __name__ == "__main__":
    main()
