"""A GAN LightningModule with manual optimization and two Adam optimizers (and a frozen
submodule) under ``ddp_find_unused_parameters_true`` and ZeroStrategy: ``toggle_optimizer``,
the discriminator accumulating two batches by hand and clipped, a scheduler per optimizer;
and the same loop without toggling, zeroing each optimizer's gradients before its backward.
Rank 0 writes ``OUT/results.pt``.

Usage: ``MASTER_PORT=... python trainer_gan.py OUT`` (one process per rank: see launch.py), then
``python trainer_gan.py OUT resume``: one process resumes the ZeRO-3 run's epoch-0
checkpoint under ZeRO-2, validates its final checkpoint (every engine's weights read into
one evaluation engine) and consolidates it, and writes ``OUT/resumed.pt``.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from _common import ZERO3_SHARD_ALL, out_dir, rank, trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy
from ds_strategy.lightning import ZeroStrategy

ROOT = out_dir()
NOISE, DATA, ROWS, ACC = 8, 16, 32, 2
results: dict[str, Any] = {}


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def data(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    real = torch.randn(ROWS, DATA, generator=g) * 0.5 + 1.0
    return DataLoader(TensorDataset(real, torch.randn(ROWS, NOISE, generator=g)), batch_size)


class GAN(L.LightningModule):
    def __init__(self, toggle: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        torch.manual_seed(0)
        self.prior = nn.Linear(NOISE, NOISE)  # frozen: in no optimizer
        self.prior.requires_grad_(False)
        self.generator = nn.Sequential(nn.Linear(NOISE, 32), nn.Tanh(), nn.Linear(32, DATA))
        self.discriminator = nn.Sequential(nn.Linear(DATA, 32), nn.Tanh(), nn.Linear(32, 1))
        self.before_steps = 0  # on_before_optimizer_step calls, as Lightning makes them

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.before_steps += 1

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        fake = self.generator(self.prior(z))
        # the discriminator, accumulating ACC batches by hand
        if self.toggle:
            self.toggle_optimizer(opt_d)
        else:
            opt_d.zero_grad()  # drops what the generator's loss left there
        d_loss = bce(self.discriminator(real), 1.0) + bce(self.discriminator(fake.detach()), 0.0)
        self.manual_backward(d_loss / (ACC if self.toggle else 1))
        if not self.toggle or (batch_idx + 1) % ACC == 0:
            self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt_d.step()
            opt_d.zero_grad()
            sched_d.step()
        if self.toggle:
            self.untoggle_optimizer(opt_d)
            self.toggle_optimizer(opt_g)
        else:
            opt_g.zero_grad()
        g_loss = bce(self.discriminator(fake), 1.0)  # through the discriminator
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        sched_g.step()
        if self.toggle:
            self.untoggle_optimizer(opt_g)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        self.log("val_d", bce(self.discriminator(real), 1.0), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=1e-2)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-2, betas=(0.5, 0.99))
        scheds = [
            torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9) for o in (opt_g, opt_d)
        ]
        return [opt_g, opt_d], scheds


def weights(t: L.Trainer, model: GAN) -> dict[str, torch.Tensor]:
    if not isinstance(t.strategy, ZeroStrategy):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for engine in t.strategy.engines:
        state.update(engine.full_state_dict())
    return state


def zero(stage: int) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, config=ZERO3_SHARD_ALL)


def fit(tag: str, strategy: Any, toggle: bool = True, **kwargs: Any) -> dict[str, Any]:
    model = GAN(toggle)
    defaults: dict[str, Any] = dict(accumulate_grad_batches=1, gradient_clip_val=None)
    t = trainer(strategy, ROOT / tag, **{**defaults, **kwargs})
    t.fit(model, data(4), data(4))
    return {
        "weights": weights(t, model),
        "global_step": t.global_step,
        "before_steps": model.before_steps,
        "lr": [s.get_last_lr()[0] for s in model.lr_schedulers()],
        "val_d": float(t.callback_metrics["val_d"]),
        "engines": len(t.strategy.engines) if isinstance(t.strategy, ZeroStrategy) else 0,
        "offloaded": [
            (
                e.config.zero_optimization.offload_param.device,
                e.config.zero_optimization.offload_optimizer.device,
            )
            for e in (t.strategy.engines if isinstance(t.strategy, ZeroStrategy) else [])
        ],
    }


if sys.argv[2:] == ["resume"]:
    ckpt = next((ROOT / "zero3" / "ckpt").glob("epoch=0-*"))
    model = GAN(toggle=True)
    t = trainer(
        zero(2), ROOT / "resume", devices=1, accumulate_grad_batches=1, gradient_clip_val=None
    )
    t.fit(model, data(8), data(8), ckpt_path=str(ckpt))
    resumed = {
        "weights": weights(t, model),
        "global_step": t.global_step,
        "lr": [s.get_last_lr()[0] for s in model.lr_schedulers()],
    }
    # the final checkpoint's weights, read into one engine for evaluation, and consolidated
    final = next((ROOT / "zero3" / "ckpt").glob("epoch=1-*"))
    t = trainer(
        zero(3), ROOT / "validate", devices=1, accumulate_grad_batches=1, gradient_clip_val=None
    )
    resumed["validated"] = t.validate(GAN(toggle=True), data(8), ckpt_path=str(final))[0]
    ds_strategy.consolidate(final, ROOT / "gan.safetensors")
    resumed["consolidated"] = load_file(ROOT / "gan.safetensors")
    torch.save(resumed, ROOT / "resumed.pt")
    sys.exit(0)

results["ddp"] = fit("ddp", "ddp_find_unused_parameters_true")
for stage in (1, 2):
    results[f"zero{stage}"] = fit(f"zero{stage}", zero(stage))
every_epoch = ModelCheckpoint(dirpath=ROOT / "zero3" / "ckpt", save_top_k=-1, every_n_epochs=1)
results["zero3"] = fit("zero3", zero(3), callbacks=[every_epoch], enable_checkpointing=True)
offload = ZeroStrategy(
    stage=3, offload_optimizer=True, offload_parameters=True, config=ZERO3_SHARD_ALL
)
results["zero3_offload"] = fit("zero3_offload", offload)
results["ddp_plain"] = fit("ddp_plain", "ddp_find_unused_parameters_true", toggle=False)
results["zero3_plain"] = fit("zero3_plain", zero(3), toggle=False)
results["ddp_bf16"] = fit("ddp_bf16", "ddp_find_unused_parameters_true", precision="bf16-mixed")
results["zero3_bf16"] = fit("zero3_bf16", zero(3), precision="bf16-mixed")
FP16 = {**ZERO3_SHARD_ALL, "fp16": {"enabled": True, "initial_scale_power": 8}}
try:  # fp16 without toggling: a backward would reach two loss scales
    fit("zero2_fp16", ZeroStrategy(stage=2, config=FP16), toggle=False)
except ValueError as e:
    results["fp16_untoggled"] = str(e)
results["zero2_fp16"] = fit("zero2_fp16_toggled", ZeroStrategy(stage=2, config=FP16))

if rank() == 0:
    torch.save(results, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
