"""Resume a checkpoint written by Lightning's own ``DeepSpeedStrategy`` (the fixture
``tests/data/deepspeed_checkpoints/lightning_s2``: ZeRO-2 on 2 ranks, 4 steps) with
``Trainer.fit(ckpt_path=...)`` under ``ZeroStrategy`` at another stage and world size, and train
to step 7 on the same batches as DeepSpeed's continuation. Writes ``OUT/results.pt``.

Usage: ``MASTER_PORT=... python deepspeed_resume.py OUT STAGE DEVICES``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from _common import out_dir, rank
from safetensors.torch import load_file

from ds_strategy.lightning import ZeroStrategy

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))
from make_fixtures import MORE, STEPS, lightning_parts  # noqa: E402

ROOT = out_dir()
stage, devices = int(sys.argv[2]), int(sys.argv[3])
config = json.loads((DATA / "lightning_s2" / "config.json").read_text())
config["zero_optimization"]["stage"] = stage
data = load_file(DATA / "batches.safetensors")
Net, loader = lightning_parts(data, rank(), devices)
trainer = L.Trainer(
    strategy=ZeroStrategy(config=config),
    accelerator="cpu",
    devices=devices,
    max_steps=STEPS + MORE,
    gradient_clip_val=0.5,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
)
model = Net()
trainer.fit(model, loader(range(STEPS + MORE)), ckpt_path=DATA / "lightning_s2" / "model.ckpt")
weights = trainer.strategy.engine.full_state_dict()
if trainer.global_rank == 0:
    results = {
        "weights": weights,
        "global_step": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "world": int(os.environ.get("WORLD_SIZE", devices)),
    }
    torch.save(results, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
