"""The same Fabric training loop (accumulation with ``no_backward_sync``, ``clip_gradients``,
a user-stepped lr scheduler) under ``ddp`` and the ZeRO strategy; ``fabric.save`` after epoch
0 and ``fabric.load`` into a fresh Fabric to finish. Rank 0 writes ``OUT/results.pt``.

Usage: ``MASTER_PORT=... python fabric_parity.py OUT`` (one process per rank: see launch.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import ZERO3_SHARD_ALL, loader, local_numel, mlp, out_dir, rank
from torch import nn

import ds_strategy  # noqa: F401  (registers the strategies)
from ds_strategy.fabric import ZeroStrategy

ROOT = out_dir()
ACCUMULATE = 2
results: dict[str, Any] = {}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": model.body.parameters(), "weight_decay": 0.01},
        {"params": model.head.parameters(), "lr": 0.1},
    ]
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def weights(fabric: L.Fabric, model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(fabric.strategy, ZeroStrategy):
        return fabric.strategy.engine.full_state_dict()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(
    strategy: Any, save: Path | None = None, load: Path | None = None, compiled: bool = False
) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    L.seed_everything(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = Net()
    counters.clear()
    if compiled:  # fabric.setup(torch.compile(model)): Fabric compiles what the strategy built
        model = torch.compile(model, backend="aot_eager")
    if load is not None:  # every weight must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    model, opt, sched = fabric.setup(model, opt, scheduler=sched)
    # no shuffling: Fabric sets the sampler's epoch by counting iterations, which a resumed
    # run restarts, so a shuffled order would differ from the uninterrupted run's
    data = fabric.setup_dataloaders(loader(64, shuffle=False))
    state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "epoch": -1}
    norms = []
    if load is not None:
        fabric.load(load, state)
    for epoch in range(state["epoch"] + 1, 2):
        for i, (x, y) in enumerate(data):
            boundary = (i + 1) % ACCUMULATE == 0
            with fabric.no_backward_sync(model, enabled=not boundary):
                fabric.backward(nn.functional.mse_loss(model(x), y) / ACCUMULATE)
            if boundary:
                norms.append(float(fabric.clip_gradients(model, opt, max_norm=1.0)))
                opt.step()
                opt.zero_grad()
                sched.step()
        if save is not None and epoch == 0:
            state["epoch"] = epoch
            fabric.save(save, state)
    out = {
        "weights": weights(fabric, model),
        "lr": [g["lr"] for g in opt.param_groups],
        "local_numel": local_numel(model),
        "epoch": state["epoch"],
        "norms": norms,
        "graphs": counters["stats"]["unique_graphs"],
    }
    if isinstance(fabric.strategy, ZeroStrategy):
        out["stage"] = fabric.strategy.engine.stage
    return out


def train_split_sequences() -> dict[str, Any]:
    """The demo GPT with each sequence split over both ranks (``sequence_parallel_size=2``,
    ZeRO-2): both read the same rows, the loss comes through ``engine.sequence``."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
    from tests.tp_common import gpt, tokens

    strategy = ZeroStrategy(stage=2, config={"sequence_parallel_size": 2})
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = gpt()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(4):
        rows = tokens()[4 * step : 4 * step + 4]
        loss = fabric.strategy.engine.sequence.next_token_loss(model, rows)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"weights": fabric.strategy.engine.full_state_dict(), "losses": losses}


results["split_sequences"] = train_split_sequences()
results["ddp"] = train("ddp")
results["zero1"] = train("zero1")
ckpt = ROOT / "fabric_ckpt"
results["zero3"] = train(ZeroStrategy(stage=3, config=ZERO3_SHARD_ALL), save=ckpt)
results["resume3"] = train(ZeroStrategy(stage=3, config=ZERO3_SHARD_ALL), load=ckpt)
results["zero3_compiled"] = train(ZeroStrategy(stage=3, config=ZERO3_SHARD_ALL), compiled=True)

# fabric.init_module() under stage 3: built on the meta device, materialised by setup
fabric = L.Fabric(
    accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, config=ZERO3_SHARD_ALL)
)
fabric.launch()
with fabric.init_module():
    model = Net()
results["init_module_device"] = next(model.parameters()).device.type
model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
x, y = next(iter(loader(8)))
fabric.backward(nn.functional.mse_loss(model(x), y))
opt.step()
fabric.strategy.save_consolidated(ROOT / "init_module.safetensors")
results["ckpt_is_dir"] = ckpt.is_dir()

if rank() == 0:
    from safetensors.torch import load_file

    results["init_module_weights"] = load_file(str(ROOT / "init_module.safetensors"))
    torch.save(results, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
