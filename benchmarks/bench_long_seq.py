"""The longest sequence one training step fits, at 1 rank and split over 2 ranks (Ulysses
``sequence_parallel_size=2`` or ring attention ``context_parallel_size=2``), and the step time
of the same tokens either way.

    python benchmarks/bench_long_seq.py                       # budget 512 MiB a rank
    python benchmarks/bench_long_seq.py --budget-mib 2048 --layers 6 --d 256
    python benchmarks/bench_long_seq.py --checkpointing       # with activation checkpointing
    python benchmarks/bench_long_seq.py --model gpt           # the demo GPT, no tiling

"Fits" means the step's peak resident memory above what the rank held before it stays within
``--budget-mib`` on every rank: each trial is a new set of processes, so the peak is this
step's. The search doubles the length until a step no longer fits, then bisects to
``--granularity`` tokens. Then each layout runs ``--steps`` steps at the 1-rank
limit and the median step time is printed beside the 1-rank one.

The model is a transformers Llama from a config (grouped-query attention, SwiGLU MLP, a
vocabulary 32x its width, as in the 8B) called with labels, so the engine splits each
sequence itself; ``--model gpt`` runs the demo GPT split by the caller instead. With the
Llama the layouts run again with ``tiling`` (the loss and the MLPs over tiles of
``--tile`` tokens). (The demo GPT has one learned position per token, so its positions grow
with the length, a few MiB.)

The ranks run with a fixed glibc mmap threshold (``MALLOC_MMAP_THRESHOLD_``, 64 KiB):
every tensor's memory then comes from its own mapping and goes back when freed, so the
resident size reads the tensors alive. With glibc's default the threshold rises to the
largest block freed so far, later blocks of that size come from the heap, and freed heap
memory counts as resident until reused: the peak then depends on the order of frees as
much as on the tensors (``--glibc-default`` shows it).
"""

from __future__ import annotations

import argparse
import os
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

SP, CP = {"sequence_parallel_size": 2}, {"context_parallel_size": 2}
LAYOUTS = {
    "1 rank": (1, {}),
    "2 ranks, sequence_parallel_size=2": (2, SP),
    "2 ranks, context_parallel_size=2": (2, CP),
}
TILED = {
    "1 rank, tiled": (1, {"tiling": True}),
    "2 ranks, sequence_parallel_size=2, tiled": (2, {**SP, "tiling": True}),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _model(length: int, args: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.model == "gpt":
        return GPT(
            GPTConfig(vocab=args.vocab, d=args.d, layers=args.layers, heads=args.heads, seq=length)
        )
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d,
        intermediate_size=4 * args.d,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=length,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _loss(engine: Any, tokens: torch.Tensor, args: Any) -> torch.Tensor:
    if args.model == "llama":  # called as transformers' Trainer calls it: the engine splits
        return engine(input_ids=tokens, labels=tokens).loss
    if engine.sequence is not None:  # the demo GPT: split by the caller
        return engine.sequence.next_token_loss(engine, tokens)
    logits = engine(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[0, 1:])


def _trial(rank: int, world: int, length: int, sizes: dict[str, Any], args: Any) -> dict:
    """One or more steps at ``length`` tokens: this rank's peak growth and step times."""
    model = _model(length, args)
    sizes = dict(sizes)
    ds_config: dict[str, Any] = {"zero_optimization": {"stage": 1}}
    if sizes.pop("tiling", False):
        ds_config["tiling"] = {"loss": True, "mlp": True, "tokens": args.tile}
    ds_config.update(sizes)
    if args.checkpointing:
        ds_config["activation_checkpointing"] = {"enabled": True}
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), ds_config
    )
    tokens = torch.randint(
        0,
        args.vocab,
        (1, length + (args.model == "gpt")),
        generator=torch.Generator().manual_seed(1),
    )
    before, times = _rss_mib(), []
    for _ in range(args.steps if args.timed else 1):
        start = time.perf_counter()
        loss = _loss(engine, tokens, args)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        del loss
    return {"growth": _peak_mib() - before, "times": times}


def _fits(length: int, layout: str, args: Any) -> tuple[bool, float]:
    world, sizes = args.layouts[layout]
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
    world, sizes = args.layouts[layout]
    args.timed = True
    results = run(_trial, world, length, sizes, args)
    return statistics.median(
        max(r["times"][i] for r in results.values()) for i in range(1, args.steps)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama", "gpt"), default="llama")
    parser.add_argument("--budget-mib", type=float, default=512)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--tile", type=int, default=1024, help="tokens per tile")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's heap")
    args = parser.parse_args()
    if not args.glibc_default:  # read by each rank's allocator as it starts (spawned)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    args.layouts = {**LAYOUTS, **(TILED if args.model == "llama" else {})}
    name = "transformers Llama (GQA)" if args.model == "llama" else "demo GPT"
    print(
        f"{name} d={args.d} layers={args.layers} heads={args.heads} vocab={args.vocab}, one "
        f"sequence a step, ZeRO-1, budget {args.budget_mib:.0f} MiB of peak growth a rank"
        + (", activation checkpointing" if args.checkpointing else "")
        + (f", tiles of {args.tile} tokens where tiled" if args.model == "llama" else "")
        + (", glibc's default heap" if args.glibc_default else ", glibc mmap threshold 64 KiB")
    )
    found = {layout: longest(layout, args) for layout in args.layouts}
    base = found["1 rank"][0]
    times = {layout: step_time(base, layout, args) for layout in args.layouts}
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
