"""Models, data and helpers shared by the scripts the Lightning/Fabric tests launch.

The scripts run as ``python script.py OUT_DIR``, one process per rank started at once with
the launcher's environment (``launch.py``), so the Trainer and Fabric start none.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ZERO3_SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def out_dir() -> Path:
    path = Path(sys.argv[1])
    path.mkdir(parents=True, exist_ok=True)
    return path


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def regression_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g))


def loader(n: int, seed: int = 0, shuffle: bool = True, batch_size: int = 4) -> DataLoader:
    return DataLoader(regression_data(n, seed), batch_size=batch_size, shuffle=shuffle)


def mlp() -> nn.Module:
    # blocks in a Sequential become ZeRO-3 units; the head belongs to the root unit
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())


class Regressor(L.LightningModule):
    """SGD with momentum (scale-sensitive, unlike Adam), two param groups, a per-step lr
    schedule, train/val/test/predict steps logging with ``sync_dist``."""

    def __init__(self, param_groups: int = 2) -> None:
        super().__init__()
        self.param_groups = param_groups
        self.body = mlp()
        self.head = nn.Linear(32, 1)
        self.norms: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_train_batch_end(self, *args: Any) -> None:
        if not hasattr(self.trainer.strategy, "engine"):
            return  # DDP, the reference
        norm = self.trainer.strategy.engine.get_global_grad_norm()
        if norm is not None:
            self.norms.append(norm)

    def configure_optimizers(self) -> Any:
        groups: list[dict[str, Any]] = [
            {"params": self.body.parameters(), "weight_decay": 0.01},
            {"params": self.head.parameters(), "lr": 0.1},
        ]
        if self.param_groups == 1:
            groups = [{"params": self.parameters()}]
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def full_weights(trainer: L.Trainer, model: L.LightningModule) -> dict[str, torch.Tensor]:
    """Consolidated weights keyed like ``model.state_dict()`` (collective under ZeRO-3)."""
    if not hasattr(trainer.strategy, "engine"):  # DDP, the reference
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = trainer.strategy.engine.full_state_dict()
    assert list(state) == list(model.state_dict()), "the engine's names are not the module's"
    return state


def local_numel(model: torch.nn.Module) -> int:
    """Elements of the parameters this rank holds right now (0 for released ZeRO-3 shards)."""
    return sum(p.numel() for p in model.parameters())


def trainer(strategy: Any, root: Path, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=1.5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)
