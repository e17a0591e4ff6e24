"""Train the demo GPT with Accelerate under ZeRO: ``ZeroAccelerator`` in place of
``Accelerator``, started by ``accelerate launch`` with a standard accelerate config.

    pip install 'ds_strategy[accelerate]'
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/train_accelerate.py
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        examples/train_accelerate.py --config zero2 --accumulation 2

The loop is plain Accelerate's: ``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``
at the boundary, the optimizer's ``step``; ``save_state`` writes a sharded checkpoint.
"""

from __future__ import annotations

import argparse

import torch
from _text import CharWindows
from torch.utils.data import DataLoader

from ds_strategy.accelerate import ZeroAccelerator
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="zero3", help="a preset or a DeepSpeed JSON")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps")
    ap.add_argument("--save", default=None, help="save_state() here at the end")
    args = ap.parse_args()
    accelerator = ZeroAccelerator(config=args.config, gradient_accumulation_steps=args.accumulation)
    torch.manual_seed(0)
    data = CharWindows(seq=64)
    model = GPT(GPTConfig(vocab=data.vocab, d=64, layers=2, heads=4, seq=data.seq))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = 0
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = gpt_loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 20 == 0:
                    mean = accelerator.reduce(loss.detach(), "mean").item()
                    accelerator.print(f"step {step}  loss {mean:.3f}")
                if step == args.steps:
                    break
    if args.save:
        accelerator.save_state(args.save)
    mean = accelerator.reduce(loss.detach(), "mean").item()
    accelerator.print(f"{args.config}: {step} steps, last loss {mean:.3f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
