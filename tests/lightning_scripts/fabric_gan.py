"""A GAN under Fabric, under ``ddp`` and the ZeRO strategy at stages 1-3: set up as two models
(``fabric.setup(generator, opt_g)``, ``fabric.setup(discriminator, opt_d)``, an engine each)
and as one model with two optimizers (``fabric.setup(gan, opt_g, opt_d)``, an engine per
optimizer); the generator's loss runs backward through the discriminator. Each run saves
every model and optimizer in one ``fabric.save`` half-way, and a fresh model set up the same
way loads it and finishes the run. Rank 0 writes ``OUT/results.pt``.

Usage: ``MASTER_PORT=... python fabric_gan.py OUT`` (one process per rank: see launch.py).
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
ROWS, STEPS, HALF, NOISE, DATA = 4, 6, 3, 8, 16
results: dict[str, Any] = {}


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights as the two models below
        self.generator = nn.Sequential(nn.Linear(NOISE, 32), nn.Tanh(), nn.Linear(32, DATA))
        self.discriminator = nn.Sequential(nn.Linear(DATA, 32), nn.Tanh(), nn.Linear(32, 1))


def set_up(fabric: L.Fabric, one_model: bool) -> dict[str, Any]:
    """The models, optimizers and what ``fabric.save`` gets, for either shape."""
    gan = GAN()
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=1e-3)
    if one_model:
        model, opt_g, opt_d = fabric.setup(gan, opt_g, opt_d)
        g, d = model.generator, model.discriminator
        state = {"model": model, "opt_g": opt_g, "opt_d": opt_d}
    else:
        g, opt_g = fabric.setup(gan.generator, opt_g)
        d, opt_d = fabric.setup(gan.discriminator, opt_d)
        model = None
        state = {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d}
    return {"g": g, "d": d, "opt_g": opt_g, "opt_d": opt_d, "model": model, "state": state}


def run(fabric: L.Fabric, s: dict[str, Any], steps: range) -> None:
    rows = slice(fabric.global_rank * ROWS, (fabric.global_rank + 1) * ROWS)
    g, d, opt_g, opt_d = s["g"], s["d"], s["opt_g"], s["opt_d"]
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        real = torch.randn(2 * ROWS, DATA, generator=gen)[rows] * 0.5 + 1.0
        fake = g(torch.randn(2 * ROWS, NOISE, generator=gen)[rows])
        opt_d.zero_grad()  # drops what the generator's loss left in the discriminator
        loss_d = bce(d(real), 1.0) + bce(d(fake.detach()), 0.0)
        fabric.backward(loss_d, model=s["model"] or d)
        opt_d.step()
        opt_g.zero_grad()
        fabric.backward(bce(d(fake), 1.0), model=s["model"] or g)
        opt_g.step()


def weights(fabric: L.Fabric, s: dict[str, Any]) -> dict[str, torch.Tensor]:
    if not isinstance(fabric.strategy, ZeroStrategy):
        return {
            f"{name}.{k}": v.detach().clone()
            for name in ("generator", "discriminator")
            for k, v in s["g" if name == "generator" else "d"].state_dict().items()
        }
    start = len(fabric.strategy.engines) - 2  # the last model set up
    out: dict[str, torch.Tensor] = {}
    last_two = fabric.strategy.engines[start:]
    for name, engine in zip(("generator", "discriminator"), last_two, strict=True):
        for k, v in engine.full_state_dict().items():
            out[k if s["model"] is not None else f"{name}.{k}"] = v
    return out


def train(strategy: Any, one_model: bool) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    s = set_up(fabric, one_model)
    run(fabric, s, range(HALF))
    tag = f"{strategy if isinstance(strategy, str) else strategy.stage}_{one_model}"
    fabric.save(ROOT / tag, {**s["state"], "step": HALF})
    run(fabric, s, range(HALF, STEPS))
    out: dict[str, Any] = {"weights": weights(fabric, s)}
    if isinstance(fabric.strategy, ZeroStrategy):
        out["engines"] = [e.stage for e in fabric.strategy.engines]
        if not one_model:
            try:  # the engine cannot be guessed with two models set up
                fabric.backward(bce(s["d"](torch.zeros(1, DATA)), 1.0))
            except ValueError as err:
                out["no_model"] = str(err)
        # a fresh model set up the same way resumes from the one checkpoint
        fresh = set_up(fabric, one_model)
        state = {**fresh["state"], "step": 0}
        fabric.load(ROOT / tag, state)
        out["resumed_step"] = state["step"]
        run(fabric, fresh, range(HALF, STEPS))
        out["resumed"] = weights(fabric, fresh)
    return out


results["ddp"] = train("ddp", one_model=False)
for stage in (1, 2, 3):
    strategy = ZeroStrategy(stage=stage, config=ZERO3_SHARD_ALL)
    results[f"zero{stage}"] = train(strategy, one_model=False)
    strategy = ZeroStrategy(stage=stage, config=ZERO3_SHARD_ALL)
    results[f"zero{stage}_one_model"] = train(strategy, one_model=True)

if rank() == 0:
    torch.save(results, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
