"""The demo GPT in a LightningModule trained by ``Trainer(strategy=ZeroStrategy(config=...))``
on 4 processes (the model built in ``configure_model``), accumulation 2 and clipping: 2
data-parallel x 2 tensor-parallel ranks (``tensor_parallel.autotp_size=2``, ZeRO-3), then 2
data-parallel x 2 sequence-parallel ranks (``sequence_parallel_size=2``, ZeRO-2;
``training_step`` takes the loss through ``engine.sequence``). Each rank writes the rows it trained on and rank
0 the consolidated weights to ``OUT``; the test compares them with one process on the global
batch (``tests/tp_common.py``).

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
    def __init__(self, split_sequences: bool = False) -> None:
        super().__init__()
        self.model: torch.nn.Module | None = None
        self.seen: list[torch.Tensor] = []
        self.split_sequences = split_sequences

    def configure_model(self) -> None:
        # under stage 3 the strategy would build this on the meta device, but not with
        # tensor parallelism, which splits real weights
        if self.model is None:
            self.model = gpt()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (rows,) = batch
        self.seen.append(rows.clone())
        if self.split_sequences:  # this rank's half of each sequence, the whole loss
            return self.trainer.strategy.engine.sequence.next_token_loss(self.model, rows)
        return loss_of(self.model, rows)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


def fit(out: Path, name: str, config: dict[str, Any]) -> None:
    from _common import rank, trainer  # this folder is on sys.path when run

    lm = LM(split_sequences="sequence_parallel_size" in config)
    loop = trainer(
        ZeroStrategy(config=config),
        out / name,
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
        {"seen": torch.stack(lm.seen), "coordinates": dict(engine.mesh.layout.coordinates)},
        out / f"{name}_rank{rank()}.pt",
    )
    if rank() == 0:
        torch.save(state, out / f"{name}_state.pt")


def main() -> None:
    from _common import out_dir  # this folder is on sys.path when run

    out = out_dir()
    fit(out, "tp", {"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}})
    # stage 2: at stage 3 configure_model would build the GPT on the meta device, initialised
    # anew rather than from the seed the one-process reference starts from
    fit(out, "sp", {"zero_optimization": {"stage": 2}, "sequence_parallel_size": 2})


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # destroyed before exit (else gloo can abort)
        torch.distributed.destroy_process_group()
