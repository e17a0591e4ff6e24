"""Expert parallelism against ZeRO alone: a transformers Mixtral on 2 ranks with its experts
sharded by ZeRO (``moe.ep_size=1``: every rank gathers every expert at stage 3, or keeps
them all at stage 1) and spread over the ranks (``moe.ep_size=2``: each rank holds half of
them whole and tokens travel to them by all-to-all).

    python benchmarks/bench_moe.py                     # 8 experts top-2, 4 layers, 2 ranks
    python benchmarks/bench_moe.py --experts 16 --steps 8

For each layout: tokens per second (median step over ``--steps`` after 2 warm-up steps;
the layouts run twice, in one order then the other, and the two medians are averaged),
model state per rank and the experts' part of it (``memory_report()`` after a step), the
peak model state within a step, and the bytes each rank sent per step (``comm_report()``:
ZeRO's gathers and reductions, and the tokens' all-to-all). One CPU thread per rank. (At
``ep=1`` the experts share flat groups with the dense layers, so their part is not shown.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run  # noqa: E402

import ds_strategy  # noqa: E402

LAYOUTS = {
    "ep=1, ZeRO-1": (1, 1),
    "ep=2, ZeRO-1": (1, 2),
    "ep=1, ZeRO-3": (3, 1),
    "ep=2, ZeRO-3": (3, 2),
}
MIB = 2**20


def _model(args: Any) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.d,
        intermediate_size=2 * args.d,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
        output_router_logits=True,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def _run(rank: int, world: int, stage: int, ep: int, args: Any) -> dict[str, Any]:
    model = _model(args)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    config = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": args.batch,
        "moe": {"ep_size": ep},
    }
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    gen = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()

    for _ in range(2):
        step()
    engine.comm_report()  # from here on: the timed steps' bytes
    engine.reset_peak_memory()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    memory, sent = engine.memory_report(), engine.comm_report()
    per_step = {k: v / args.steps for k, v in sent.items()}
    return {
        "params": params,
        "experts": experts,
        "step_s": statistics.median(times),
        "total": memory["total"],
        "expert_state": sum(
            memory.get(f"expert_{k}", 0) for k in ("params", "grads", "optimizer_state")
        ),
        "peak": memory["peak"],
        "sent": per_step["total"],
        "all_to_all": per_step.get("ep_expert_all_to_all", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    world = 2
    order = list(LAYOUTS) + list(reversed(LAYOUTS))
    results: dict[str, list[dict[int, Any]]] = {name: [] for name in LAYOUTS}
    for name in order:
        stage, ep = LAYOUTS[name]
        results[name].append(run(_run, world, stage, ep, args))
    first = results[order[0]][0][0]
    print(
        f"transformers Mixtral: {first['params'] / 1e6:.1f}M parameters, "
        f"{first['experts'] / 1e6:.1f}M of them in experts ({args.experts} a layer, top-2), "
        f"{args.layers} layers, d={args.d}; {world} ranks x {args.batch} x {args.seq} tokens, "
        f"fp32, AdamW"
    )
    header = (
        f"{'layout':<14} {'tokens/s':>9} {'vs ep=1':>8} {'state MiB':>10} {'experts':>8} "
        f"{'peak MiB':>9} {'sent MiB/step':>14} {'all-to-all':>11}"
    )
    print(header)
    print("-" * len(header))
    speed: dict[str, float] = {}
    for name, runs in results.items():
        step_s = statistics.mean(max(r[k]["step_s"] for k in r) for r in runs)
        speed[name] = world * args.batch * args.seq / step_s
        r0 = runs[0]
        worst = max(r0.values(), key=lambda r: r["total"])
        base = name.replace("ep=2", "ep=1")
        experts = f"{worst['expert_state'] / MIB:.1f}" if LAYOUTS[name][1] > 1 else "-"
        print(
            f"{name:<14} {speed[name]:>9.0f} {speed[name] / speed.get(base, speed[name]):>7.2f}x "
            f"{worst['total'] / MIB:>10.1f} {experts:>8} "
            f"{max(r['peak'] for r in r0.values()) / MIB:>9.1f} "
            f"{max(r['sent'] for r in r0.values()) / MIB:>14.1f} "
            f"{max(r['all_to_all'] for r in r0.values()) / MIB:>11.2f}"
        )


if __name__ == "__main__":
    main()
