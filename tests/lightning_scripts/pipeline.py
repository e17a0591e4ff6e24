"""Train an ``nn.Sequential`` as a 2-stage pipeline (P=2 x D=1) under ``ZeroStrategy``, then
validate, checkpoint, evaluate the checkpoint in a fresh Trainer and export the weights, and
again under ``precision="bf16-mixed"`` and with fp16 in the config; rank
0 trains the same model with plain PyTorch on the same batches and saves both to
``OUT/results.pt``.

Usage: ``MASTER_PORT=... python pipeline.py OUT`` (one process per rank: see launch.py).
"""

from __future__ import annotations

from typing import Any

import torch
from _common import loader, out_dir, rank, trainer
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import ds_strategy  # noqa: F401  (registers the strategies)
from ds_strategy.lightning import PipelineModule, ZeroStrategy

ROOT = out_dir()
CLIP = 0.5
CONFIG = {
    "pipeline": {"stages": 2, "schedule": "1f1b", "partition_method": "uniform"},
    "zero_optimization": {"stage": 1},
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
}


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1), nn.Identity()
    )


class PipeModule(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = layers()

    def pipeline_layers(self) -> nn.Sequential:
        return self.layers

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train_loader() -> Any:
    return loader(32, shuffle=False, batch_size=8)  # 4 steps of 4 micro-batches of 2


def shuffled_like_lightning() -> Any:
    """The order a distributed Trainer trains in: Lightning shuffles the training data with a
    DistributedSampler (seed 0, epoch 0); one data-parallel replica reads it all."""
    data = train_loader().dataset
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    return DataLoader(data, batch_size=8, sampler=sampler)


def val_loader() -> Any:
    return loader(16, seed=1, shuffle=False, batch_size=8)


results: dict[str, Any] = {}
t = trainer(
    ZeroStrategy(config=CONFIG),
    ROOT / "pipe",
    max_epochs=1,
    accumulate_grad_batches=1,
    gradient_clip_val=CLIP,
)
model = PipeModule()
t.fit(model, train_loader())
results["sampler"] = t.strategy.distributed_sampler_kwargs
results["stage"] = t.strategy.pipeline.stage_id
results["val"] = t.validate(model, val_loader(), verbose=False)[0]["val_loss"]
results["weights"] = t.strategy.pipeline.full_state_dict()
t.save_checkpoint(ROOT / "pipe.ckpt")
t.strategy.save_consolidated(ROOT / "pipe.safetensors")

fresh = trainer(ZeroStrategy(config=CONFIG), ROOT / "fresh", accumulate_grad_batches=1)
results["fresh_val"] = fresh.validate(
    PipeModule(), val_loader(), ckpt_path=ROOT / "pipe.ckpt", verbose=False
)[0]["val_loss"]

# mixed precision: bf16 from Lightning's flag; fp16 (loss scaling) from the config, as
# Lightning turns precision="16-mixed" into bf16 on a CPU
for flag in ("bf16-mixed", "fp16-config"):
    mixed = trainer(
        ZeroStrategy(
            config={**CONFIG, "fp16": {"enabled": flag == "fp16-config", "initial_scale_power": 8}}
        ),
        ROOT / flag,
        max_epochs=1,
        accumulate_grad_batches=1,
        gradient_clip_val=CLIP,
        precision=flag if flag == "bf16-mixed" else "32-true",
    )
    mixed_model = PipeModule()
    mixed.fit(mixed_model, train_loader())
    engine = mixed.strategy.pipeline.engine
    results[flag] = {
        "enabled": (engine.config.bf16.enabled, engine.config.fp16.enabled),
        "compute": engine.precision.param_dtype,
        "val": mixed.validate(mixed_model, val_loader(), verbose=False)[0]["val_loss"],
        "skipped": mixed.strategy.pipeline.skipped_steps,
    }

try:
    trainer(ZeroStrategy(config=CONFIG), ROOT / "acc", accumulate_grad_batches=2).fit(
        PipeModule(), train_loader()
    )
    results["accumulate_error"] = None
except ValueError as e:
    results["accumulate_error"] = str(e)

if rank() == 0:
    ref = layers()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in shuffled_like_lightning():
        nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        batch_losses = [float(nn.functional.mse_loss(ref(x), y)) for x, y in val_loader()]
    results["ref_weights"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    results["ref_val"] = sum(batch_losses) / len(batch_losses)
    results["file"] = load_file(str(ROOT / "pipe.safetensors"))
    # the same PipelineModule under a single-device Trainer trains as a plain model
    single = trainer(
        "auto",
        ROOT / "single",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=1,
        gradient_clip_val=CLIP,
    )
    plain = PipeModule()
    single.fit(plain, shuffled_like_lightning())
    results["single_weights"] = {
        k: v.detach().clone() for k, v in plain.layers.state_dict().items()
    }
    torch.save(results, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
