"""A GAN with a frozen prior under ``accelerate launch``: one ``prepare`` with the generator,
the discriminator, their optimizers, a frozen model, the loader and a scheduler;
``accumulate(generator, discriminator)`` over two batches; the generator's loss runs backward
through the discriminator. ZeroAccelerator at stages 1/2/3 against a plain ``Accelerator``;
the ZeRO-3 run also saves its state half-way, which a fresh ZeroAccelerator at stage 2 loads
to finish the run, as a plain run does with its own. (The discriminator's gradients from the
generator's last backward before the save are in no checkpoint, in either; so a resumed run
is compared with a resumed plain run.) Rank 0 saves the weights of every run.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        tests/accelerate_scripts/gan.py --out results.pt
"""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import arguments, save_on_main
from torch import nn
from torch.nn import functional as F

NOISE, DATA, ROWS, BATCH, ACCUMULATION, HALF = 8, 16, 48, 4, 2, 4


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def build() -> tuple[Any, ...]:
    set_seed(0)
    generator = nn.Sequential(nn.Linear(NOISE, 32), nn.Tanh(), nn.Linear(32, DATA))
    discriminator = nn.Sequential(nn.Linear(DATA, 32), nn.Tanh(), nn.Linear(32, 1))
    prior = nn.Sequential(nn.Linear(NOISE, NOISE), nn.Tanh()).requires_grad_(False)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-2, betas=(0.5, 0.99))
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=1, gamma=0.95)
    g = torch.Generator().manual_seed(5)
    real = torch.randn(ROWS, DATA, generator=g) * 0.5 + 1.0
    data = torch.utils.data.TensorDataset(real, torch.randn(ROWS, NOISE, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    return generator, opt_g, discriminator, opt_d, prior, loader, sched_d


def train(acc: Accelerator, objs: tuple[Any, ...], start: int = 0, stop: int | None = None) -> list:
    g, opt_g, d, opt_d, prior, loader, sched_d = objs
    norms = []
    batches = acc.skip_first_batches(loader, start) if start else loader
    for i, (real, z) in enumerate(batches, start=start):
        if stop is not None and i >= stop:
            break
        with acc.accumulate(g, d):
            with torch.no_grad():
                z = prior(z)
            fake = g(z)
            acc.backward(bce(d(real), 1.0) + bce(d(fake.detach()), 0.0))
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(d.parameters(), 1.0)))
            opt_d.step()
            sched_d.step()
            opt_d.zero_grad()
            acc.backward(bce(d(fake), 1.0))  # through the discriminator, left there
            opt_g.step()
            opt_g.zero_grad()
    return norms


def weights(acc: Accelerator, objs: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    g, _, d, _, prior, _, _ = objs
    return {
        f"{name}.{k}": v
        for name, model in (("g", g), ("d", d), ("prior", prior))
        for k, v in acc.get_state_dict(model).items()
    }


def zero(stage: int) -> Any:
    from ds_strategy.accelerate import ZeroAccelerator

    config = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return ZeroAccelerator(config=config, gradient_accumulation_steps=ACCUMULATION)


def zero_run(stage: int, ckpt: str) -> dict[str, Any]:
    acc = zero(stage)
    objs = acc.prepare(*build())
    norms = train(acc, objs, stop=HALF)
    if stage == 3:
        acc.save_state(ckpt)
    norms += train(acc, objs, start=HALF)
    out = {"weights": weights(acc, objs), "norms": norms}
    engines = acc._front.engines()
    out["stages"] = [e.stage for e in engines.values()]
    out["memory"] = {name: e.memory_report()["params"] for name, e in engines.items()}
    acc.free_memory()
    return out


def resumed_run(ckpt: str) -> dict[str, Any]:
    acc = zero(2)
    objs = acc.prepare(*build())
    acc.load_state(ckpt)
    norms = train(acc, objs, start=HALF)
    out = {"weights": weights(acc, objs), "norms": norms}
    acc.free_memory()
    return out


def plain_run(ckpt: str, resume: bool = False) -> dict[str, Any]:
    """Plain Accelerate; saves half-way, or (``resume``) loads that and finishes the run."""
    acc = Accelerator(gradient_accumulation_steps=ACCUMULATION)
    g, opt_g, d, opt_d, prior, loader, sched_d = build()  # DDP takes no frozen model
    g, opt_g, d, opt_d, loader, sched_d = acc.prepare(g, opt_g, d, opt_d, loader, sched_d)
    objs = (g, opt_g, d, opt_d, prior, loader, sched_d)
    if resume:
        acc.load_state(ckpt)
        norms = train(acc, objs, start=HALF)
    else:
        norms = train(acc, objs, stop=HALF)
        acc.save_state(ckpt)
        norms += train(acc, objs, start=HALF)
    return {"weights": weights(acc, objs), "norms": norms}


def main() -> None:
    args = arguments()
    ckpt = os.path.join(os.path.dirname(os.path.abspath(args.out)), "ckpt")
    results = {f"zero{stage}": zero_run(stage, ckpt) for stage in (1, 2, 3)}
    results["resumed"] = resumed_run(ckpt)
    # after the ZeroAccelerators, as in parity.py
    results["plain"] = plain_run(ckpt + "_plain")
    results["plain_resumed"] = plain_run(ckpt + "_plain", resume=True)
    save_on_main(Accelerator(), results, args.out)


if __name__ == "__main__":
    main()
