"""A GAN under Fabric: the generator and the discriminator each ``fabric.setup`` with their own
Adam, under ``ddp`` and the ZeRO strategy at stages 1-3 (each model its own engine); the
generator's loss runs backward through the discriminator. Rank 0 writes ``OUT/results.pt``.

Usage: ``MASTER_PORT=... python fabric_gan.py OUT`` (Fabric starts rank 1).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from _common import ZERO3_SHARD_ALL, out_dir, rank
from torch import nn
from torch.nn import functional as F

import ds_strategy  # noqa: F401  (registers the strategies)
from ds_strategy.fabric import ZeroStrategy

ROOT = out_dir()
ROWS, STEPS, NOISE, DATA = 4, 6, 8, 16
results: dict[str, Any] = {}


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def weights(fabric: L.Fabric, model: Any, index: int) -> dict[str, torch.Tensor]:
    if isinstance(fabric.strategy, ZeroStrategy):
        return fabric.strategy.engines[index].full_state_dict()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy: Any) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(NOISE, 32), nn.Tanh(), nn.Linear(32, DATA))
    discriminator = nn.Sequential(nn.Linear(DATA, 32), nn.Tanh(), nn.Linear(32, 1))
    g, opt_g = fabric.setup(generator, torch.optim.Adam(generator.parameters(), lr=1e-3))
    d, opt_d = fabric.setup(discriminator, torch.optim.Adam(discriminator.parameters(), lr=1e-3))
    rows = slice(fabric.global_rank * ROWS, (fabric.global_rank + 1) * ROWS)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        real = torch.randn(2 * ROWS, DATA, generator=gen)[rows] * 0.5 + 1.0
        fake = g(torch.randn(2 * ROWS, NOISE, generator=gen)[rows])
        opt_d.zero_grad()  # drops what the generator's loss left in the discriminator
        fabric.backward(bce(d(real), 1.0) + bce(d(fake.detach()), 0.0), model=d)
        opt_d.step()
        opt_g.zero_grad()
        fabric.backward(bce(d(fake), 1.0), model=g)
        opt_g.step()
    out = {"g": weights(fabric, g, 0), "d": weights(fabric, d, 1)}
    if isinstance(fabric.strategy, ZeroStrategy):
        out["engines"] = [e.stage for e in fabric.strategy.engines]
        try:  # the engine cannot be guessed with two models set up
            fabric.backward(bce(d(fake), 1.0))
        except ValueError as err:
            out["no_model"] = str(err)
    return out


results["ddp"] = train("ddp")
for stage in (1, 2, 3):
    results[f"zero{stage}"] = train(ZeroStrategy(stage=stage, config=ZERO3_SHARD_ALL))

if rank() == 0:
    torch.save(results, ROOT / "results.pt")
