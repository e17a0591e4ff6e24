"""The script of the tutorial (docs/tutorials/first-steps.md): train the demo GPT with ZeRO,
read its memory, save a checkpoint, resume it on another number of processes and ZeRO stage,
and consolidate it into one file plain PyTorch loads.

    torchrun --nproc-per-node=2 examples/first_steps.py --stage 3 --save ckpt
    python examples/first_steps.py --stage 1 --resume ckpt --steps 10
"""

from __future__ import annotations

import argparse

import torch
from _text import CharWindows
from torch.utils.data import DataLoader, DistributedSampler

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=3, help="ZeRO stage 0-3")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save", default=None, help="save a checkpoint here at the end")
    ap.add_argument("--resume", default=None, help="resume from this checkpoint first")
    args = ap.parse_args()

    # 1. A model, an optimizer and a config make an engine.
    torch.manual_seed(0)
    data = CharWindows(seq=64)
    model = GPT(GPTConfig(vocab=data.vocab, d=64, layers=2, heads=4, seq=data.seq))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = {
        # a small model: shard every parameter (by default, stage 3 keeps those under
        # 100,000 elements whole on every rank, which would be most of this one's)
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
    }
    engine = ds_strategy.initialize(model, optimizer, config)
    say = print if engine.rank == 0 else (lambda *a: None)

    # 2. Resuming: any checkpoint, whatever world size and stage wrote it.
    if args.resume:
        engine.load_checkpoint(args.resume)
        say(f"resumed {args.resume} at step {engine.global_steps}")

    # 3. The loop: each rank reads its share of every batch.
    sampler = DistributedSampler(data, engine.world_size, engine.rank, seed=engine.global_steps)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    for batch, _ in zip(loader, range(args.steps), strict=False):
        loss = gpt_loss(engine, batch)  # the forward runs through engine(...)
        engine.backward(loss)
        engine.step()
        if engine.global_steps % 10 == 0:
            say(f"step {engine.global_steps}  loss {loss.item():.3f}")

    # 4. What each rank holds: parameters, gradients and optimizer state, in bytes.
    memory = engine.memory_report()
    say(f"ZeRO-{args.stage} on {engine.world_size} rank(s): {memory['total'] / 2**20:.2f} MiB")

    # 5. A sharded checkpoint (every rank writes its part), then one file of its weights.
    if args.save:
        engine.save_checkpoint(args.save)
        if engine.rank == 0:
            path = ds_strategy.consolidate(args.save, f"{args.save}/model.safetensors")
            plain = GPT(GPTConfig(vocab=data.vocab, d=64, layers=2, heads=4, seq=data.seq))
            from safetensors.torch import load_model

            load_model(plain, path)  # plain PyTorch from here on (tied weights stored once)
            say(f"saved {args.save} at step {engine.global_steps}; {path} loads into GPT")
    engine.destroy()


if __name__ == "__main__":
    main()
