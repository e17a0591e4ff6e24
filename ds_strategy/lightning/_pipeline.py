"""``ZeroStrategy`` with a ``pipeline`` config section: the Trainer's loops driving a
:class:`~ds_strategy.core.pipeline.PipelineEngine`.

[Note: what the LightningModule provides under a pipeline]
A schedule runs forward and backward of all micro-batches itself, so there is no per-batch
``training_step``. The model is a :class:`PipelineModule`: the pipeline runs its
``pipeline_layers()`` (an ``nn.Sequential``; each rank keeps its stage's layers) and
``pipeline_loss(output, target)``; under any other strategy its own steps run them on a whole
batch. A batch is ``(inputs, targets)``, this data-parallel rank's
``gradient_accumulation_steps`` micro-batches, run by ``engine.train_batch`` (with the
optimizer step) or ``engine.eval_batch``; ``train_loss``/``val_loss``/``test_loss`` (the
global batch's mean) are logged. ``Trainer(accumulate_grad_batches)`` stays 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from ..config import ZeroConfig
from ..core.optimizers import move_schedulers
from ..core.pipeline import PipelineEngine, split_batch
from ..core.pipeline.loop import PipelineLoop, refusing

__all__ = ["LightningPipeline", "PipelineModule", "build_pipeline"]


class PipelineModule(pl.LightningModule):
    """A LightningModule defined by its layers and its loss.

    Under a ``pipeline`` config it is split into stages. Any other strategy trains it as it
    is::

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
    """

    def pipeline_layers(self) -> Any:
        """The model as an ``nn.Sequential`` (or a list of layers) of this module."""
        raise TypeError(f"{type(self).__name__} must implement pipeline_layers()")

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The (mean) loss of one batch or micro-batch.

        Args:
            output: the last layer's output.
            target: the batch's targets.
        """
        raise TypeError(f"{type(self).__name__} must implement pipeline_loss(output, target)")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.pipeline_layers()(inputs)

    def _step_loss(self, batch: Any, name: str) -> torch.Tensor:
        x, y = split_batch(batch, f"{name} batch")
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


def build_pipeline(
    pl_module: pl.LightningModule, cfg: ZeroConfig, optimizer: Any, schedulers: list[Any]
) -> PipelineEngine:
    """The pipeline of ``pl_module``'s layers; Lightning's ``schedulers`` move onto it."""
    engine = PipelineEngine(
        _hook(pl_module, "pipeline_layers")(), optimizer, cfg, _hook(pl_module, "pipeline_loss")
    )
    move_schedulers(engine, schedulers)
    return engine


class LightningPipeline:
    """The Trainer's step hooks under a pipeline config (see the module note)."""

    def __init__(self, engine: PipelineEngine, pl_module: pl.LightningModule) -> None:
        self.loop, self.pl_module = PipelineLoop(engine), pl_module

    def _run(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        loss = self.loop.run_batch(kind, args[0] if args else kwargs["batch"])
        self.pl_module.log(f"{kind}_loss", loss, prog_bar=kind == "train")
        return loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("train", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("val", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("test", args, kwargs)

    predict_step = refusing(
        "predict",
        "predict",
        "consolidate the weights (save_consolidated) and predict without it",
    )

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # train_batch ran the backward of every micro-batch

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], *a: Any, **k: Any) -> Any:
        return closure()  # the closure runs training_step, whose train_batch steps
