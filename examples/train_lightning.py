"""Train the demo GPT with Lightning's ``Trainer`` under ZeRO (``strategy="zero3"``).

    pip install 'ds_strategy[lightning]'
    python examples/train_lightning.py                      # 2 CPU processes, ZeRO-3
    python examples/train_lightning.py --strategy zero2_offload --precision bf16-mixed

``import ds_strategy`` registers the package's presets as strategy names; everything else is a
plain Lightning script: the Trainer starts the processes, shards the data and the model, and
its checkpoints are sharded directories that resume at another number of devices.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from _text import CharWindows
from torch.utils.data import DataLoader

import ds_strategy  # noqa: F401  (registers zero1 ... zero3_offload with Lightning)
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss


class LitGPT(L.LightningModule):
    def __init__(self, vocab: int, seq: int) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab=vocab, d=64, layers=2, heads=4, seq=seq))

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = gpt_loss(self.model, batch)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="zero3", help="a preset: zero1 ... zero3_offload")
    ap.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    data = CharWindows(seq=64)
    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LitGPT(data.vocab, data.seq), DataLoader(data, batch_size=8, shuffle=True))
    if trainer.is_global_zero:
        loss = float(trainer.callback_metrics["loss"])
        print(f"{args.strategy}: {trainer.global_step} steps, last loss {loss:.3f}")


if __name__ == "__main__":
    main()
