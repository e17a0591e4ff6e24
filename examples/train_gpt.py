"""Train a small character-level GPT with ZeRO-3 across the ranks that started this script.

    torchrun --nproc-per-node=2 examples/train_gpt.py            # 2 CPU processes (gloo)
    torchrun --nproc-per-node=2 examples/train_gpt.py --stage 1 --steps 100

The corpus is the repository's own README (no download). Each rank reads a different slice
of every global batch; the loss printed is the mean over ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

import ds_strategy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    cfg = GPTConfig(vocab=len(chars), d=128, layers=4, heads=4, seq=args.seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    config = {
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 1000},
        "gradient_clipping": 1.0,
        "train_batch_size": args.batch,
    }
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)
    rank, world = engine.rank, engine.world_size
    micro = engine.config.train_micro_batch_size_per_gpu
    gen = torch.Generator().manual_seed(1234)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        mine = starts[rank * micro : (rank + 1) * micro]
        batch = torch.stack([data[s : s + args.seq + 1] for s in mine])
        loss = gpt_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        if step % 10 == 0 or step == 1:
            mean = loss.detach().clone()
            if dist.is_initialized():
                dist.all_reduce(mean)
                mean /= world
            if rank == 0:
                print(
                    f"step {step:4d}  loss {mean.item():.3f}  {time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
    report = engine.memory_report()
    psi = sum(p.numel() for p in GPT(cfg).parameters())
    formula = {
        0: 16 * psi,
        1: 8 * psi + 8 * psi / world,
        2: 4 * psi + 12 * psi / world,
        3: 16 * psi / world,
    }
    line = (
        f"rank {rank}: model state {report['total'] / 1e6:.2f} MB "
        f"(params {report['params'] / 1e6:.2f}, grads {report['grads'] / 1e6:.2f}, "
        f"optimizer {report['optimizer_state'] / 1e6:.2f}); ZeRO-{args.stage} formula "
        f"{formula[args.stage] / 1e6:.2f} MB for {psi / 1e6:.2f}M parameters on {world} rank(s)"
    )
    print(line, flush=True)


if __name__ == "__main__":
    main()
