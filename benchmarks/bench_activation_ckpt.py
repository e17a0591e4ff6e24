"""Activation checkpointing on the benchmark GPT: activation memory and step time, with and
without, side by side (one process, a ZeroEngine world of one).

    python benchmarks/bench_activation_ckpt.py                  # CPU, 6 layers, d=256
    python benchmarks/bench_activation_ckpt.py --device cuda --layers 12 --d 768 --batch 16

Prints, per setting: bytes of activations kept for backward (tensors saved by autograd plus
the inputs held by checkpointed blocks, counted by SavedTensorMeter; deterministic), on CUDA
also the peak allocated memory of a training step, and the median step time; then the ratios
checkpointed / plain. Checkpointing every block should keep about one block input per block
instead of every intermediate, at the cost of one more forward per step (~1.3x step time).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import ds_strategy
from ds_strategy.core.activation_checkpointing import SavedTensorMeter
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Setting:
    """One engine; its steps are timed round-robin with the other settings' (noise hits all)."""

    def __init__(self, base: GPT, ac: dict, tokens: torch.Tensor, device: torch.device) -> None:
        self.model = copy.deepcopy(base).to(device)
        config = {"zero_optimization": {"stage": 0}, "activation_checkpointing": ac}
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.engine = ds_strategy.initialize(self.model, opt, config)
        self.tokens, self.device = tokens, device
        with SavedTensorMeter(self.model) as meter:
            loss = gpt_loss(self.engine, tokens)
        self.engine.backward(loss)
        self.engine.step()
        self.saved = meter.bytes
        self.peak = float("nan")
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _sync(self.device)
        t0 = time.perf_counter()
        self.engine.backward(gpt_loss(self.engine, self.tokens))
        self.engine.step()
        _sync(self.device)
        if timed:
            self.times.append(time.perf_counter() - t0)
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = GPTConfig(args.vocab, args.d, args.layers, args.heads, args.seq)
    base = GPT(cfg)
    settings = {
        "plain": {"enabled": False},
        "every block": {"enabled": True},
        "every 2nd block": {"enabled": True, "every": 2},
    }
    print(
        f"GPT layers={args.layers} d={args.d} seq={args.seq} batch={args.batch} "
        f"params={sum(p.numel() for p in base.parameters()) / 1e6:.1f}M device={device}"
    )
    print(
        f"{'setting':<16}{'activations MiB':>16}{'ratio':>8}{'peak MiB':>10}{'step ms':>10}{'ratio':>8}"
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=g).to(device)
    results = {name: Setting(base, ac, tokens, device) for name, ac in settings.items()}
    for i in range(args.steps + 1):
        for r in results.values():
            r.step(timed=i > 0)  # the first round is a warm-up
    ref = results["plain"]
    ref_time = statistics.median(ref.times)
    for name, r in results.items():
        t = statistics.median(r.times)
        print(
            f"{name:<16}{r.saved / 2**20:>16.1f}{r.saved / ref.saved:>8.2f}"
            f"{r.peak / 2**20:>10.1f}{t * 1e3:>10.1f}{t / ref_time:>8.2f}"
        )


if __name__ == "__main__":
    main()
