"""Train the demo GPT with Lightning Fabric under ZeRO (``Fabric(strategy="zero3")``).

    pip install 'ds_strategy[lightning]'
    python examples/train_fabric.py                # 2 CPU processes, ZeRO-3
    python examples/train_fabric.py --strategy zero1 --precision bf16-mixed

Your own loop, with Fabric's three calls: ``setup``, ``backward``, and the optimizer's
``step`` (which steps the engine at each accumulation boundary).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from _text import CharWindows
from torch.utils.data import DataLoader

import ds_strategy  # noqa: F401  (registers zero1 ... zero3_offload with Fabric)
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="zero3", help="a preset: zero1 ... zero3_offload")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    fabric = L.Fabric(
        strategy=args.strategy, accelerator="cpu", devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(0)
    data = CharWindows(seq=64)
    model = GPT(GPTConfig(vocab=data.vocab, d=64, layers=2, heads=4, seq=data.seq))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))
    step = 0
    while step < args.steps:
        for batch in loader:
            loss = gpt_loss(model, batch)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0:
                fabric.print(f"step {step}  loss {fabric.all_reduce(loss).item():.3f}")
            if step == args.steps:
                break
    fabric.print(f"{args.strategy}: {step} steps, last loss {fabric.all_reduce(loss).item():.3f}")


if __name__ == "__main__":
    main()
