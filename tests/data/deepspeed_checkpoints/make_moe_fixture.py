"""Regenerate the DeepSpeed-MoE checkpoint the tests read (``tests/test_moe.py``).

Needs DeepSpeed (``pip install deepspeed``; its CPU accelerator and gloo, no GPU)::

    DS_ACCELERATOR=cpu python tests/data/deepspeed_checkpoints/make_moe_fixture.py

Two ranks train :func:`model` (a linear layer, a DeepSpeed-MoE layer of 4 experts spread over
``ep_size=2`` ranks, top-2, dropless, no Gumbel noise, and a linear head) at ZeRO-2 for 4
steps and save (``moe_s2/ckpt``). The weights at that point, every rank's experts under their
global index, are ``moe_s2/consolidated.safetensors``. A fresh DeepSpeed engine loads the
checkpoint and trains 3 more steps; its weights are ``moe_s2/continued.safetensors``. The
optimizer has DeepSpeed's MoE param groups (``split_params_into_different_moe_groups_for_
optimizer``). ``moe_s2/batches.safetensors`` holds every global batch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "moe_s2"
STEPS, MORE, MICRO, WORLD, TOKENS, D = 4, 3, 2, 2, 5, 8
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
}
LR, AUX = 0.02, 0.01


def model(moe_class, ep_size: int):  # type: ignore[no-untyped-def]
    """The network, with ``moe_class`` DeepSpeed's ``MoE`` or ds_strategy's."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp = torch.nn.Linear(D, D)
            expert = torch.nn.Sequential(
                torch.nn.Linear(D, 12), torch.nn.Tanh(), torch.nn.Linear(12, D)
            )
            self.moe = moe_class(
                hidden_size=D,
                expert=expert,
                num_experts=4,
                ep_size=ep_size,
                k=2,
                min_capacity=0,
                drop_tokens=False,
                top2_2nd_expert_sampling=False,
            )
            self.head = torch.nn.Linear(D, 3)

        def forward(self, x):  # type: ignore[no-untyped-def]
            h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
            return self.head(h), l_aux

    return Net()


def batches():  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(1)
    n = STEPS + MORE
    return {
        "moe_inputs": torch.randn(n, WORLD * MICRO, TOKENS, D, generator=g),
        "moe_targets": torch.randn(n, WORLD * MICRO, TOKENS, 3, generator=g),
    }


def loss_of(engine, x, y):  # type: ignore[no-untyped-def]
    out, l_aux = engine(x)
    return ((out - y) ** 2).mean() + AUX * l_aux


def train(engine, data, steps: range, rank: int) -> None:  # type: ignore[no-untyped-def]
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    for i in steps:
        loss = loss_of(engine, data["moe_inputs"][i, rows], data["moe_targets"][i, rows])
        engine.backward(loss)
        engine.step()


def whole_weights(engine, ep_size: int):  # type: ignore[no-untyped-def]
    """Every rank's module state, experts renamed to their global index (rank 0 returns it)."""
    import re

    import torch.distributed as dist

    mine = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    local = 4 // ep_size
    for rank, state in enumerate(every):
        first = (rank % ep_size) * local
        for k, v in state.items():
            m = re.search(r"deepspeed_experts\.(\d+)\.", k)
            if m:
                k = k.replace(
                    f"deepspeed_experts.{m.group(1)}.",
                    f"deepspeed_experts.{first + int(m.group(1))}.",
                )
            out[k] = v
    return out


def optimizer(net):  # type: ignore[no-untyped-def]
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = [{"params": list(net.parameters()), "name": "params"}]
    return torch.optim.AdamW(split_params_into_different_moe_groups_for_optimizer(groups), lr=LR)


def run() -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE
    from safetensors.torch import load_file, save_file

    data = load_file(OUT / "batches.safetensors")
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    net = model(MoE, 2)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer(net), config=CONFIG)
    train(engine, data, range(STEPS), rank)
    engine.save_checkpoint(OUT / "ckpt", client_state={"epoch": 1})
    saved = whole_weights(engine, 2)
    if rank == 0:
        save_file(saved, OUT / "consolidated.safetensors")
    dist.barrier()
    net = model(MoE, 2)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer(net), config=CONFIG)
    engine.load_checkpoint(OUT / "ckpt")
    train(engine, data, range(STEPS, STEPS + MORE), rank)
    continued = whole_weights(engine, 2)
    if rank == 0:
        save_file(continued, OUT / "continued.safetensors")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (OUT / "ckpt" / script).unlink(missing_ok=True)
        (OUT / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")


def main() -> None:
    if sys.argv[1:] == ["--case", "moe_s2"]:
        run()
        return
    from safetensors.torch import save_file

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    save_file(batches(), OUT / "batches.safetensors")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    cmd = ["torchrun", f"--nproc_per_node={WORLD}", "--master_port=29614", __file__]
    cmd += ["--case", "moe_s2"]
    subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
