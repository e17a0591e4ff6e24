"""Trainer features under ZeRO: ``configure_model`` and ``trainer.init_module()`` on the meta
device, ``nn.MultiheadAttention`` under stage 3, manual optimization, and LightningCLI with
the strategy given in YAML. Rank 0 writes ``OUT/results.pt``; every rank writes its own
consolidated weights where the test compares ranks.

Usage: ``MASTER_PORT=... python trainer_features.py OUT`` (one process per rank: see launch.py).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from _common import (
    ZERO3_SHARD_ALL,
    Regressor,
    full_weights,
    loader,
    local_numel,
    out_dir,
    rank,
    trainer,
)
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy  # noqa: F401  (registers the strategies)
from ds_strategy.lightning import ZeroStrategy

ROOT = out_dir()
results: dict[str, Any] = {}


def zero3() -> ZeroStrategy:
    return ZeroStrategy(stage=3, config=ZERO3_SHARD_ALL)


# -- configure_model(): built on the meta device, materialised by the engine -------------------
class Configured(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.devices_seen: list[str] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 1))
        self.devices_seen.append(next(self.net.parameters()).device.type)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


L.seed_everything(1)
model = Configured()
t = trainer(zero3(), ROOT / "configured", max_epochs=3, accumulate_grad_batches=1)
t.fit(model, loader(64))
weights = full_weights(t, model)
torch.save(weights, ROOT / f"configured_rank{rank()}.pt")
results["configured"] = {
    "devices_seen": model.devices_seen,
    "local_numel": local_numel(model),
    "full_numel": sum(v.numel() for v in weights.values()),
    "memory": t.strategy.engine.memory_report(),
    "first_loss": sum(model.losses[:4]) / 4,
    "last_loss": sum(model.losses[-4:]) / 4,
}

# -- trainer.init_module(): the same for a model built before fit ------------------------------
L.seed_everything(1)
t = trainer(zero3(), ROOT / "init_module", max_epochs=1)
with t.init_module():
    model = Regressor()
device_at_init = next(model.parameters()).device.type
t.fit(model, loader(64))
weights = full_weights(t, model)
results["init_module"] = {
    "device_at_init": device_at_init,
    "local_numel": local_numel(model),
    "finite": all(bool(torch.isfinite(v).all()) for v in weights.values()),
    "val": t.validate(model, loader(16, seed=1, shuffle=False), verbose=False),
}


# -- nn.MultiheadAttention (its forward reads out_proj's weight) under stage 3 vs DDP ----------
class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ff = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + torch.tanh(self.ff(x))


class Attention(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.out(self.blocks(self.embed(x))).mean(1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def sequences() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=(1, 2)).unsqueeze(1).tanh()), batch_size=4)


for tag, strategy in (("attn_ddp", "ddp"), ("attn_zero3", zero3())):
    L.seed_everything(1)
    model = Attention()
    t = trainer(strategy, ROOT / tag, max_epochs=2)
    t.fit(model, sequences())
    results[tag] = {"weights": full_weights(t, model), "local_numel": local_numel(model)}


# -- manual optimization: manual_backward, clip_gradients, opt.step, sched.step -----------------
class Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        sched = self.lr_schedulers()
        opt.zero_grad()
        loss = self._loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        sched.step()
        self.log("train_loss", loss, sync_dist=True)


for tag, strategy in (("manual_ddp", "ddp"), ("manual_zero3", zero3())):
    L.seed_everything(1)
    model = Manual()
    t = trainer(strategy, ROOT / tag, accumulate_grad_batches=1, gradient_clip_val=None)
    t.fit(model, loader(64))
    results[tag] = {
        "weights": full_weights(t, model),
        "global_step": t.global_step,
        "train_loss": float(t.callback_metrics["train_loss"]),
    }


# -- LightningCLI with the strategy class and its config in YAML -------------------------------
class CLIModel(Regressor):
    def train_dataloader(self) -> DataLoader:
        return loader(32)


yaml = ROOT / "cli.yaml"
yaml.write_text(
    f"""
seed_everything: 1
trainer:
  accelerator: cpu
  devices: 2
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {ROOT / "cli"}
  strategy:
    class_path: ds_strategy.lightning.ZeroStrategy
    init_args:
      stage: 2
      config:
        zero_optimization:
          reduce_bucket_size: 1000
"""
)
cli = LightningCLI(CLIModel, args=["fit", "--config", str(yaml)], save_config_callback=None)
strategy = cli.trainer.strategy
results["cli"] = {
    "strategy": type(strategy).__qualname__,
    "module": type(strategy).__module__,
    "stage": strategy.engine.stage,
    "reduce_bucket_size": strategy.engine.config.zero_optimization.reduce_bucket_size,
    "global_step": cli.trainer.global_step,
}

if rank() == 0:
    torch.save(results, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
