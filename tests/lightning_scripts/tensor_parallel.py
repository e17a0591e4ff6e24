"""The demo GPT in a LightningModule trained by ``Trainer(strategy=ZeroStrategy(config=...))``
with ``tensor_parallel.autotp_size=2`` on 4 processes (2 data-parallel x 2 tensor-parallel),
ZeRO stage 3 (the model built in ``configure_model``), accumulation 2 and clipping. Each rank
writes the rows it trained on and rank 0 the consolidated weights to ``OUT``; the test
compares them with one process on the global batch (``tests/tp_common.py``).

Usage: ``MASTER_PORT=... python tensor_parallel.py OUT`` (4 processes: see launch.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy.lightning import ZeroStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests/

from tests.tp_common import STEPS, gpt, loss_of, tokens  # noqa: E402


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        self.seen: list[torch.Tensor] = []

    def configure_model(self) -> None:
        # under stage 3 the strategy would build this on the meta device, but not with
        # tensor parallelism, which splits real weights
        if self.model is None:
            self.model = gpt()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (rows,) = batch
        self.seen.append(rows.clone())
        return loss_of(self.model, rows)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


def main() -> None:
    from _common import out_dir, rank, trainer  # this folder is on sys.path when run

    out = out_dir()
    config = {"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}
    lm = LM()
    loop = trainer(
        ZeroStrategy(config=config),
        out,
        devices=4,
        max_epochs=1,
        max_steps=STEPS,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
    )
    data = DataLoader(TensorDataset(tokens()), batch_size=4, shuffle=False)
    loop.fit(lm, data)
    engine = loop.strategy.engine
    state = engine.full_state_dict()
    torch.save(
        {"seen": torch.stack(lm.seen), "coordinates": dict(engine.mesh.coordinates)},
        out / f"rank{rank()}.pt",
    )
    if rank() == 0:
        torch.save(state, out / "state.pt")


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # destroyed before exit (else gloo can abort)
        torch.distributed.destroy_process_group()
