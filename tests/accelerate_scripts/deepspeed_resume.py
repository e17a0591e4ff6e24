"""``load_state`` of a directory Accelerate's own ``save_state`` wrote under DeepSpeed (the
fixture ``tests/data/deepspeed_checkpoints/accelerate_s2``: ZeRO-2 on 2 ranks, 4 steps) at the
world size ``accelerate launch`` gives and another ZeRO stage, then 3 more steps on the same
global batches as Accelerate and DeepSpeed's continuation; rank 0 writes the weights to OUT.

Usage: ``accelerate launch ... deepspeed_resume.py OUT STAGE``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ds_strategy.accelerate import ZeroAccelerator

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))
from make_fixtures import MICRO, MORE, STEPS, WORLD, Counter, lambda_lr, mlp_rows, model  # noqa: E402

out, stage = Path(sys.argv[1]), int(sys.argv[2])
config = json.loads((DATA / "accelerate_s2" / "config.json").read_text())
config["zero_optimization"]["stage"] = stage
# a prepared scheduler steps once per process at each call; the fixture's Accelerate counted
# one process, so once a step: step_scheduler_with_optimizer=False steps it once a call
accelerator = ZeroAccelerator(config=config, step_scheduler_with_optimizer=False)
share = WORLD * MICRO // accelerator.num_processes  # of each step's global batch
net = model()
opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
data = load_file(DATA / "batches.safetensors")
rows = mlp_rows(data, range(STEPS, STEPS + MORE))
loader = torch.utils.data.DataLoader(rows, batch_size=share)  # Accelerate shards it
counter = Counter()
accelerator.register_for_checkpointing(counter)
net, opt, loader, sched = accelerator.prepare(net, opt, loader, lambda_lr(opt))
accelerator.load_state(str(DATA / "accelerate_s2" / "state"))
loaded = {"seen": counter.seen, "last_epoch": sched.scheduler.last_epoch}
for x, y in loader:
    accelerator.backward(((net(x) - y) ** 2).mean())
    opt.step()
    sched.step()
    opt.zero_grad()
weights = accelerator.get_state_dict(net)
if accelerator.is_main_process:
    results = {"weights": weights, "loaded": loaded, "world": accelerator.num_processes}
    results["global_steps"] = accelerator.zero_engine.global_steps
    torch.save(results, out)
accelerator.wait_for_everyone()
accelerator.end_training()
