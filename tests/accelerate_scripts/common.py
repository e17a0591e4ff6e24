"""Model, data and a plain Accelerate training loop shared by the scripts that the accelerate
tests start with ``accelerate launch`` (this folder is on ``sys.path`` when they run).

The loop is written for ``accelerate.Accelerator`` and is run unchanged with
``ZeroAccelerator``: that is what the tests compare.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

D_IN, HIDDEN, D_OUT = 6, 12, 3
SAMPLES = 88  # 2 ranks x batch 4 -> 11 batches per rank: an odd tail for accumulation 2
BATCH = 4
ACCUMULATION = 2
MAX_NORM = 0.3
EPOCHS = 2


class TinyNet(nn.Module):
    """Blocks in a ModuleList (ZeRO-3 units) with uneven sizes, so shards straddle parameters;
    ``config.hidden_size`` as Hugging Face models have it (DeepSpeed "auto" sizes use it)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=HIDDEN)
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Dropout(dropout))
            for _ in range(3)
        )
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, D_IN, generator=g)
    w = torch.randn(D_IN, D_OUT, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(SAMPLES, D_OUT, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def param_groups(params: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """Two groups with their own weight decay, as real training scripts have."""
    return [
        {"params": [p for n, p in params if p.ndim >= 2]},
        {"params": [p for n, p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build(seed: int = 0, dropout: float = 0.0) -> tuple[nn.Module, Any, Any, Any]:
    """Model, AdamW (two groups), a shuffled-free loader and a LambdaLR, seeded."""
    set_seed(seed)
    model = TinyNet(dropout)
    optimizer = torch.optim.AdamW(
        param_groups(list(model.named_parameters())), lr=0.02, weight_decay=0.01
    )
    # its own generator: creating an iterator then draws from it, not from the global RNG that
    # dropout uses, so a resumed run (which creates one more iterator) sees the same dropout
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=False, generator=g)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
    return model, optimizer, loader, scheduler


def train(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: Any,
    loader: Any,
    scheduler: Any,
    *,
    start: tuple[int, int] = (0, 0),
    stop: tuple[int, int] | None = None,
) -> dict[str, list[float]]:
    """The plain Accelerate loop: accumulate, backward, clip at boundaries, step, schedule.
    Runs from (epoch, batch) ``start`` up to, not including, ``stop``."""
    norms: list[float] = []
    lrs: list[float] = []
    model.train()
    for epoch in range(start[0], EPOCHS):
        skip = start[1] if epoch == start[0] else 0
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch, (x, y) in enumerate(epoch_loader, start=skip):
            if stop is not None and (epoch, batch) >= stop:
                return {"norms": norms, "lrs": lrs}
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    norms.append(float(norm))
                optimizer.step()
                if accelerator.sync_gradients:
                    assert not optimizer.step_was_skipped
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
                lrs.append(optimizer.param_groups[0]["lr"])
    return {"norms": norms, "lrs": lrs}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", default="")
    parser.add_argument("--ckpt", default="")
    return parser.parse_args()


def save_on_main(accelerator: Accelerator, results: dict[str, Any], path: str) -> None:
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tmp = path + ".tmp"
        torch.save(results, tmp)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
    # the end of the job, as Accelerate's docs end one: the process group destroyed before the
    # interpreter exits (left to exit-time destructors, gloo rarely aborted a rank at exit)
    accelerator.end_training()


def zero_accelerator(stage: int) -> Any:
    """A ``ZeroAccelerator`` at ``stage`` (every weight sharded at stage 3) whose batch sizes,
    accumulation and clipping are ``"auto"``: filled from the Accelerator and the loop."""
    from ds_strategy.accelerate import ZeroAccelerator

    config = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    return ZeroAccelerator(config=config, gradient_accumulation_steps=ACCUMULATION)
