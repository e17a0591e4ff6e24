"""``ZeroStrategy``: Lightning's ``Trainer`` driving a :class:`~ds_strategy.ZeroEngine` (or a
pipeline, see ``_pipeline.py``); it maps Lightning's hooks onto the engine, no sharding logic.
The engine wraps a :class:`~ds_strategy.core.root.SharedRoot` of the LightningModule, as
Lightning runs ``training_step`` through the forward (see [Note: the root wrapper] there).

[Note: accumulation]
The engine owns accumulation (``gradient_accumulation_steps = accumulate_grad_batches``) and
steps on every k-th of Lightning's per-batch ``optimizer_step`` calls, so a window spans an
epoch boundary when the batch count is not a multiple of k (DDP would step on the epoch's last
batch); the strategy warns then.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from ..config.loop import apply_loop_flags, clipping
from ..core.checkpoint.engines import holds_engines
from ..core.checkpoint.validate import has_optimizer_state
from ..core.engine import ZeroEngine
from ..core.job import JobEngines
from ..core.loop import save_all
from ..core.optimizers import evaluation_optimizer, move_schedulers
from ..core.pipeline import PipelineEngine
from ..core.pipeline.loop import schedule_does
from ..core.root import SharedRoot
from ..core.several import SeveralEngines
from ..frontends.engines import move_real_tensors, timing_sink
from ..frontends.lightning_base import LightningZeroBase
from ..frontends.lightning_private import is_stand_in_optimizer
from ._pipeline import LightningPipeline, build_pipeline
from ._summary import install_sharded_summary
from .precision import ZeroPrecision

__all__ = ["ZeroStrategy"]


_STEP_HOOKS = (
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "backward",
    "optimizer_step",
)


class ZeroStrategy(LightningZeroBase, DDPStrategy):
    """ZeRO stage 0-3 for ``lightning.Trainer``.

    It is registered as ``zero1`` ... ``zero3_offload``. The Trainer's ``precision``,
    ``accumulate_grad_batches`` and ``gradient_clip_val`` map onto the config. A config value
    contradicting a flag is an error naming both. ``trainer.strategy.engine`` is the
    :class:`~ds_strategy.ZeroEngine`. Checkpoints are sharded directories. Example::

        trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=2,
                            accumulate_grad_batches=2, gradient_clip_val=1.0, max_epochs=2)
        trainer.fit(model)              # a LightningModule
        trainer.strategy.save_consolidated("weights.safetensors")
    """

    strategy_name = "zero"
    not_set_up = (
        "trainer.strategy.engine exists once the Trainer has set the strategy up (inside "
        "fit/validate/test/predict, or after them) with a config without a pipeline section"
    )
    say_which = "use the optimizers the strategy returned (self.optimizers() in a LightningModule)"

    def _init_front(self) -> None:
        self._engine_module: pl.LightningModule | None = None  # the module it was built for
        self._engine_trains = False  # built with the LightningModule's optimizer (not for eval)

    @property
    def engines(self) -> list[ZeroEngine]:
        """Every engine; one unless ``configure_optimizers`` returns several optimizers.

        Then there is one engine per optimizer, and one for the frozen submodules (see
        ``core/several.py``).
        """
        return self._job.engines or [self.engine]

    @property
    def _several(self) -> SeveralEngines | None:
        return self._job.several_of()  # several optimizers: an engine each

    @property
    def pipeline(self) -> PipelineEngine:
        """The :class:`~ds_strategy.core.pipeline.PipelineEngine` of a ``pipeline`` config."""
        if not isinstance(self._engine, PipelineEngine):
            raise RuntimeError(
                "trainer.strategy.pipeline exists once the Trainer has set up a strategy whose "
                "config has a pipeline section with stages > 1"
            )
        return self._engine

    precision_class = ZeroPrecision
    precision_plugin = property(LightningZeroBase.plugin, LightningZeroBase.set_plugin)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its sharded checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores the optimizer with the weights

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # see [Note: accumulation]

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Create modules on the meta device under stage 3, until :meth:`setup` builds units.

        Not with tensor parallelism, which splits real weights.

        Args:
            empty_init: ``True`` uses the meta device at any stage; ``False`` never does.
        """
        meta = self._meta_init(empty_init)
        with torch.device("meta") if meta else super().tensor_init_context(empty_init):
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """The Trainer's name for :meth:`module_sharded_context`."""
        with self.module_sharded_context():
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        pl_module = self.lightning_module
        assert pl_module is not None
        kept = self._engine is not None and self._engine_module is pl_module
        if kept and (self._engine_trains or not fitting):  # fit, then validate: keep the trained
            if isinstance(self._engine, ZeroEngine) and self._several is None:
                self.model = self._engine  # Lightning's connect() reset it to the LightningModule
        else:
            self._drop_engine(pl_module)
            optimizers, schedulers = self._configured_optimizers(trainer) if fitting else ([], [])
            optimizer = optimizers[0] if fitting else None
            if len(optimizers) > 1:
                self._setup_several(trainer, pl_module, optimizers, schedulers)
            elif self._base_config.layout.stages > 1:
                self._setup_pipeline(trainer, pl_module, optimizer, schedulers)
            else:
                self._setup_engine(trainer, pl_module, optimizer, schedulers)
            if self.stage == 3 and self._job.engines:  # parameters empty outside their forward
                install_sharded_summary(trainer, self._job.engines)
            self._engine_module, self._engine_trains = pl_module, fitting
            self.barrier("ZeroStrategy.setup")
        if fitting:  # the job's engines, or the pipeline
            trained: list[Any] = self._job.trained or [self._engine]
            self.optimizers = [e.optimizer for e in trained]

    def _setup_several(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizers: list, scheds: list
    ) -> None:
        """One engine per optimizer: see [Note: one engine per optimizer] in ``core/several.py``."""
        if self._base_config.layout.stages > 1:
            raise ValueError(
                f"configure_optimizers returned {len(optimizers)} optimizers with a pipeline "
                "config: a pipeline trains one model with one optimizer"
            )
        several = self._add(self._build_several(pl_module, optimizers, scheds, 1))
        _wrap_toggles(pl_module, several)

    def _setup_engine(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, scheds: list[Any]
    ) -> None:
        fitting = optimizer is not None
        engine = self._build_engine(
            SharedRoot(pl_module),
            optimizer if fitting else evaluation_optimizer,
            trainer.accumulate_grad_batches if fitting else None,
            clip_val=trainer.gradient_clip_val,
            clip_algorithm=trainer.gradient_clip_algorithm,
        )
        move_schedulers(engine, scheds)  # Lightning steps them (intervals, ReduceLROnPlateau)
        if engine.timers is not None:  # wall_clock_breakdown: also to the Trainer's loggers
            engine.timers.add_sink(timing_sink(lambda m, step: _log_metrics(trainer, m, step)))
        self.model = self._add(engine)

    def _setup_pipeline(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, scheds: list[Any]
    ) -> None:
        cfg = apply_loop_flags(
            self._base_config,
            world_size=self.world_size // self._base_config.layout.stages,
            precision=self._flag(),
            accumulate=None,  # the micro-batches are the config's gradient_accumulation_steps
        )
        if optimizer is not None:
            if trainer.accumulate_grad_batches != 1:
                call = f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})"
                fix = "leave accumulate_grad_batches at 1"
                raise ValueError(schedule_does(call, "accumulate", fix))
            clip = clipping(cfg, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            cfg = cfg.replace(gradient_clipping=clip)
        move_real_tensors(pl_module, self.root_device)
        self._engine = engine = build_pipeline(
            pl_module, cfg, optimizer if optimizer is not None else evaluation_optimizer, scheds
        )
        self._use_steps(LightningPipeline(engine, pl_module))

    def _drop_engine(self, pl_module: pl.LightningModule) -> None:
        engine, owner = self._engine, self._engine_module
        self._engine, self._engine_module = None, None
        self._job = JobEngines(self.not_set_up, self.say_which)
        self.precision_plugin.job = self._job
        self._use_steps(None)
        if engine is None or owner is not pl_module:
            return  # another module's engine: that module stays as it is
        # here the engine was built for evaluation (setup keeps a fit's, one or several)
        if engine.config.zero_optimization.stage == 3:
            raise RuntimeError(
                "this LightningModule was set up by ZeroStrategy for evaluation and its ZeRO-3 "
                "parameters are sharded, so it cannot be set up again for training; call "
                "trainer.fit before validate/test/predict, or use a new model and Trainer"
            )
        engine.destroy()  # stages 0-2 keep full parameters: a new engine can start from them

    def _use_steps(self, steps: LightningPipeline | None) -> None:
        """A pipeline's step hooks replace Lightning's on this instance (None: Lightning's own)."""
        for name in _STEP_HOOKS:
            if steps is None:
                self.__dict__.pop(name, None)
            else:
                setattr(self, name, getattr(steps, name))

    def _configured_optimizers(self, trainer: pl.Trainer) -> tuple[list[Optimizer], list[Any]]:
        self.setup_optimizers(trainer)
        optimizers = list(self.optimizers)
        if not optimizers or is_stand_in_optimizer(optimizers[0]):
            raise ValueError(
                "ZeroStrategy (configure_optimizers) got no optimizer: the engine shards the "
                "optimizer's state across the ranks. Return one from configure_optimizers (or "
                "one per model, e.g. a GAN's generator and discriminator, with manual optimization)"
            )
        return optimizers, [config.scheduler for config in self.lr_scheduler_configs]

    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return
        k, batches = trainer.accumulate_grad_batches, trainer.num_training_batches
        if k > 1 and isinstance(batches, int) and batches % k:
            rank_zero_warn(
                f"{batches} training batches per epoch is not a multiple of "
                f"accumulate_grad_batches={k}: under ZeroStrategy the engine's accumulation "
                "windows continue across epoch boundaries (DDP would step on each epoch's last "
                "batch); use a batch count divisible by accumulate_grad_batches to match it"
            )

    # -- checkpoints: the engine saves and loads weights and optimizer state itself -------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` restored the engine's weights already.

        Args:
            checkpoint: Lightning's checkpoint dict (unused).
            strict: unused.
        """

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizer state already.

        Args:
            checkpoint: Lightning's checkpoint dict (unused).
        """

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike,
        storage_options: Any | None = None,
    ) -> None:
        """Save one sharded checkpoint directory. Collective.

        Lightning's other entries travel as its ``client_state``.

        Args:
            checkpoint: Lightning's checkpoint dict. Without ``optimizer_states`` (a
                weights-only checkpoint), no optimizer state is saved.
            filepath: the directory; rank 0's name is used on every rank.
            storage_options: not supported; leave it ``None``.
        """
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy does not use a CheckpointIO plugin, so storage_options cannot "
                "be passed to save_checkpoint"
            )
        path = self._checkpoint_path(filepath)  # rank 0's name everywhere
        client_state = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        # a weights-only checkpoint (weights_only=True, save_weights_only=True) has none
        include_optimizer = "optimizer_states" in checkpoint
        engines = self._several.engines if self._several is not None else {"": self._active()}
        save_all(engines, path, client_state, include_optimizer)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote, at any world size or stage.

        Args:
            checkpoint_path: the checkpoint directory.
            weights_only: only ``False`` (a trusted file) unpickles arbitrary data.

        Returns:
            Lightning's checkpoint dict.
        """
        path = self._checkpoint_path(checkpoint_path)
        if not path.is_dir():
            raise ValueError(
                f"{path}: ZeroStrategy resumes from checkpoint directories written under "
                "ZeroStrategy. To start from a single-file state dict, load it into the "
                "LightningModule before fit (model.load_state_dict(torch.load(path)['state_dict']))"
            )
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and not has_optimizer_state(path):
            raise ValueError(
                f"{path}: this checkpoint holds weights only (saved with weights_only=True or "
                "ModelCheckpoint(save_weights_only=True)), so fit cannot resume from it. Pass it "
                "to validate/test/predict, or resume fit from a full checkpoint"
            )
        # evaluation needs the weights only: its engine's optimizer is a stand-in
        trust = weights_only is False
        if self._several is not None:
            client_state = self._several.load(path, fitting, trust)
        elif fitting and holds_engines(path):
            raise ValueError(
                f"{path} holds several models (one engine per optimizer of configure_optimizers): "
                "resume it with the same LightningModule and optimizers (validate, test and "
                "predict read its weights into one engine)"
            )
        else:
            client_state = self._active().load_checkpoint(
                path, load_optimizer=fitting, trust_checkpoint=trust
            )
        if not isinstance(client_state, dict):
            raise ValueError(f"{path}: not written by a Lightning Trainer (no Lightning state)")
        return client_state


def _wrap_toggles(module: pl.LightningModule, several: SeveralEngines) -> None:
    """``toggle_optimizer``/``untoggle_optimizer`` also turn the other engines' parameters
    off and on (see ``core/several.py``)."""
    cls = type(module)

    def toggle_optimizer(optimizer: Any) -> None:
        cls.toggle_optimizer(module, optimizer)
        several.toggle(optimizer)

    def untoggle_optimizer(optimizer: Any) -> None:
        cls.untoggle_optimizer(module, optimizer)
        several.untoggle()

    module.__dict__["toggle_optimizer"] = toggle_optimizer
    module.__dict__["untoggle_optimizer"] = untoggle_optimizer


def _log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:  # rank-zero-only inside Lightning's loggers
        logger.log_metrics(metrics, step=step)
