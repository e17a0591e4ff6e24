"""Train a LightningModule with hyper-parameters for two steps under
``Trainer(strategy="zero3")`` on 2 ranks and save it with ``trainer.save_checkpoint``, for
``tests/test_lightning_load.py`` to load with ``load_from_checkpoint`` in one process.

Writes ``OUT/model.ckpt`` (a sharded checkpoint directory) and, from rank 0, ``OUT/results.pt``
(the engine's consolidated weights and the module's hyper-parameters). The test imports
:class:`HParamNet` from here; the run is under the ``__main__`` guard.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn


class HParamNet(L.LightningModule):
    """A small regressor whose sizes and learning rate are hyper-parameters, with a buffer
    the fit changes (so a load that drops buffers shows)."""

    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(8, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale

    def on_fit_start(self) -> None:
        self.scale.fill_(0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


if __name__ == "__main__":
    from _common import loader, out_dir, rank, trainer

    import ds_strategy  # noqa: F401 - registers "zero3"

    ROOT = out_dir()
    torch.manual_seed(0)
    model = HParamNet(hidden=12, lr=0.02)
    t = trainer("zero3", ROOT, max_steps=2, accumulate_grad_batches=1, gradient_clip_val=None)
    t.fit(model, loader(16))
    t.save_checkpoint(ROOT / "model.ckpt")
    weights = t.strategy.engine.full_state_dict()  # collective
    if rank() == 0:
        results = {"weights": weights, "hparams": dict(model.hparams)}
        torch.save(results, ROOT / "results.pt")
    if torch.distributed.is_initialized():  # before the interpreter exits (gloo can abort)
        torch.distributed.destroy_process_group()
