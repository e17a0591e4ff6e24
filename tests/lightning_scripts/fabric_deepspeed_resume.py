"""Resume a checkpoint written by Lightning Fabric's own ``DeepSpeedStrategy`` (the fixture
``tests/data/deepspeed_checkpoints/fabric_s2``: ZeRO-2 on 2 ranks, 4 steps, the lr scheduler and
step count as DeepSpeed's client state) with ``fabric.load`` under ``ZeroStrategy`` at another
stage on one or two processes, and train to step 7 on the same global batches as Fabric's own
continuation. Writes ``OUT/results.pt``.

Usage: ``MASTER_PORT=... python fabric_deepspeed_resume.py OUT STAGE [DEVICES]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from _common import out_dir
from safetensors.torch import load_file

from ds_strategy.fabric import ZeroStrategy

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))
from make_fixtures import MICRO, MORE, STEPS, WORLD, lambda_lr, model  # noqa: E402

ROOT = out_dir()
config = json.loads((DATA / "fabric_s2" / "config.json").read_text())
config["zero_optimization"]["stage"] = int(sys.argv[2])
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 1
per_rank = WORLD * MICRO // devices  # the global batch of the fixture's two ranks
config["train_micro_batch_size_per_gpu"] = per_rank
fabric = L.Fabric(strategy=ZeroStrategy(config=config), accelerator="cpu", devices=devices)
fabric.launch()
net = model()
opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
sched = lambda_lr(opt)
net, opt = fabric.setup(net, opt)
state = {"model": net, "optimizer": opt, "scheduler": sched, "step": 0}
fabric.load(DATA / "fabric_s2" / "model.ckpt", state)
loaded = {"step": state["step"], "last_epoch": sched.last_epoch}
data = load_file(DATA / "batches.safetensors")
for i in range(STEPS, STEPS + MORE):
    rows = slice(fabric.global_rank * per_rank, (fabric.global_rank + 1) * per_rank)
    x, y = data["inputs"][i, rows], data["targets"][i, rows]
    fabric.backward(((net(x) - y) ** 2).mean(), model=net)
    opt.step()
    sched.step()
weights = fabric.strategy.engine.full_state_dict()
if fabric.global_rank == 0:
    torch.save({"weights": weights, "loaded": loaded}, ROOT / "results.pt")

if torch.distributed.is_initialized():  # the end of the job: destroyed before the interpreter
    torch.distributed.destroy_process_group()  # exits (left to its destructors, gloo can abort)
