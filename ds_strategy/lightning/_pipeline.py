"""``ZeroStrategy`` with a ``pipeline`` config section: the Trainer's loops driving a
:class:`~ds_strategy.core.pipeline.PipelineEngine`.

[Note: what the LightningModule provides under a pipeline]
A pipeline schedule runs forward and backward of all micro-batches itself, stage by stage,
so there is no ``training_step`` to call per batch. The model is a :class:`PipelineModule`
(a LightningModule) that provides

- ``pipeline_layers()``: the model as an ``nn.Sequential`` (or list of layers), usually an
  attribute built in ``__init__``; each rank keeps its stage's layers;
- ``pipeline_loss(output, target)``: the loss of one micro-batch;

and its own ``training_step``/``validation_step``/``test_step`` run those two on a whole batch,
so the same module also trains under any other strategy (DDP, ZeRO without a pipeline). Its
batches are ``(inputs, targets)``: this data-parallel rank's
``gradient_accumulation_steps`` micro-batches of ``train_micro_batch_size_per_gpu``. For each
training batch the strategy runs ``engine.train_batch`` (schedule and optimizer step) and logs
``train_loss``; validation and test batches run ``engine.eval_batch`` and log ``val_loss`` /
``test_loss`` (the global batch's mean, the same on every rank). ``configure_optimizers``
works as usual (its scheduler is stepped by Lightning). ``Trainer(accumulate_grad_batches)``
must stay 1: the micro-batches are the config's ``gradient_accumulation_steps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from ..config import ZeroConfig
from ..core.pipeline import PipelineEngine
from ._engine_ops import write_weights

__all__ = ["LightningPipeline", "PipelineModule", "pipeline_stages"]


def pipeline_stages(cfg: ZeroConfig) -> int:
    """How many pipeline stages the config asks for (1: no pipeline)."""
    return int(cfg.pipeline.stages or 1)


class PipelineModule(pl.LightningModule):
    """A LightningModule defined by its layers and its loss, which ``ZeroStrategy`` can split
    into pipeline stages (a config with a ``pipeline`` section) and any other strategy trains
    as it is. Subclass it, build the layers in ``__init__`` and implement
    :meth:`pipeline_layers`, :meth:`pipeline_loss` and ``configure_optimizers``::

        class Net(PipelineModule):
            def __init__(self):
                super().__init__()
                self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

            def pipeline_layers(self):
                return self.layers

            def pipeline_loss(self, output, target):
                return nn.functional.mse_loss(output, target)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters())

    Batches are ``(inputs, targets)``; ``train_loss``, ``val_loss`` and ``test_loss`` are
    logged (with ``sync_dist`` outside a pipeline; a pipeline's losses are already global).
    """

    def pipeline_layers(self) -> Any:
        """The model as an ``nn.Sequential`` (or a list of layers) of this module."""
        raise TypeError(f"{type(self).__name__} must implement pipeline_layers()")

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The (mean) loss of one batch or micro-batch."""
        raise TypeError(f"{type(self).__name__} must implement pipeline_loss(output, target)")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.pipeline_layers()(inputs)

    def _step_loss(self, batch: Any, name: str) -> torch.Tensor:
        x, y = _split(batch, f"{name} batch")
        loss = self.pipeline_loss(self(x), y)
        self.log(f"{name}_loss", loss, prog_bar=name == "train", sync_dist=name != "train")
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step_loss(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step_loss(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step_loss(batch, "test")


def _hook(pl_module: pl.LightningModule, name: str) -> Any:
    fn = getattr(pl_module, name, None)
    if not callable(fn):
        raise TypeError(
            f"{type(pl_module).__name__}.{name} is missing: under a pipeline config the model "
            "is a ds_strategy.lightning.PipelineModule, which provides pipeline_layers() (the "
            "model as an nn.Sequential) and pipeline_loss(output, target)"
        )
    return fn


def _split(batch: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"{where}: under a pipeline config each batch must be (inputs, targets); got "
        f"{type(batch).__name__}"
    )


class LightningPipeline:
    """The pipeline engine of one ``ZeroStrategy`` and the loop steps it runs."""

    def __init__(self, engine: PipelineEngine, pl_module: pl.LightningModule) -> None:
        self.engine = engine
        self.pl_module = pl_module

    @classmethod
    def build(
        cls, pl_module: pl.LightningModule, cfg: ZeroConfig, optimizer: Any, schedulers: list[Any]
    ) -> LightningPipeline:
        """The pipeline of ``pl_module``'s layers; ``schedulers`` (Lightning's, which it steps
        itself) are pointed at this stage's rebuilt optimizer."""
        engine = PipelineEngine(
            _hook(pl_module, "pipeline_layers")(), optimizer, cfg, _hook(pl_module, "pipeline_loss")
        )
        for scheduler in schedulers:
            scheduler.optimizer = engine.optimizer
        return cls(engine, pl_module)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = _split(batch, "training batch")
        loss = self.engine.train_batch(x, y)
        self.pl_module.log("train_loss", loss, prog_bar=True)
        return loss

    def eval_step(self, batch: Any, prefix: str) -> torch.Tensor:
        x, y = _split(batch, f"{prefix} batch")
        loss = self.engine.eval_batch(x, y)
        self.pl_module.log(f"{prefix}_loss", loss)
        return loss

    def save_consolidated(self, path: Path) -> Path:
        """The whole model's fp32 weights (keys of the Sequential's ``state_dict()``) to one
        file, written by global rank 0. Collective."""
        state = self.engine.full_state_dict()
        if dist.get_rank() == 0:
            write_weights(state, path)
        dist.barrier()
        return path
