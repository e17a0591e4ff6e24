"""The demo GPT through ``ZeroAccelerator`` with a ``tensor_parallel`` section on 4 processes
(2 data-parallel x 2 tensor-parallel), ZeRO stage 1, accumulation 2 and ``clip_grad_norm_``:
a plain Accelerate loop. Each rank saves the rows it trained on, rank 0 the consolidated
weights, for the test to compare with one process on the global batch.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml --num_processes 4 \\
        tests/accelerate_scripts/tensor_parallel.py --out results.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy.accelerate import ZeroAccelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests/

from tests.tp_common import STEPS, gpt, loss_of, tokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    config = {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    accelerator = ZeroAccelerator(config=config, gradient_accumulation_steps=2)
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    loader = DataLoader(TensorDataset(tokens()), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    for (rows,) in loader:
        with accelerator.accumulate(model):
            seen.append(rows.clone())
            accelerator.backward(loss_of(model, rows))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.zero_engine.global_steps == STEPS:
            break
    engine = accelerator.zero_engine
    state = accelerator.get_state_dict(model)
    rank = accelerator.process_index
    torch.save(
        {"seen": torch.stack(seen), "coordinates": dict(engine.mesh.coordinates)},
        f"{out}.rank{rank}",
    )
    if rank == 0:
        torch.save(state, out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
