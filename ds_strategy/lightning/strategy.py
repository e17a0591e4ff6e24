"""``ZeroStrategy``: Lightning's ``Trainer`` driving a :class:`~ds_strategy.ZeroEngine`.

A thin adapter: it launches and connects the processes like DDP, turns the Trainer's flags
into the engine's config, and maps Lightning's hooks (training/eval steps, backward,
optimizer step, checkpoints, model construction) onto the engine's public API. It holds no
sharding logic.

[Note: the root wrapper]
Under ZeRO-3 the engine gathers a unit's parameters in that unit's forward hooks, and the
model it is given is the *root* unit, gathered for the whole forward. Lightning never calls
``LightningModule.forward`` for a step: it calls ``training_step``, redirected through the
wrapping model's forward. So the engine wraps ``_LightningRoot(lightning_module)``, whose
forward is that redirected step: the LightningModule's own parameters (those outside any
``nn.ModuleList``/``nn.Sequential`` block) stay gathered for the whole step, however the
step reaches them (``self(x)``, ``self.head(h)``, ...). In the engine's checkpoints the
parameter names carry the wrapper's ``module.`` prefix; the consolidated export strips it.

[Note: accumulation]
The engine owns gradient accumulation (``gradient_accumulation_steps`` =
``Trainer(accumulate_grad_batches)``), so the strategy reports
``handles_gradient_accumulation`` and Lightning calls ``optimizer_step`` on every batch; the
engine runs the optimizer on every k-th. Windows follow the engine's micro-step count, so when
an epoch's batch count is not a multiple of k, a window spans the epoch boundary (DDP would
step on the epoch's last batch instead); the strategy warns when that happens.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from ..config import ZeroConfig
from ..core.checkpoint.validate import META_FILE
from ..core.engine import ZeroEngine
from ..core.pipeline import PipelineEngine
from ._config import PRESETS, apply_loop_flags, base_config, clipping
from ._engine_ops import inference_optimizer, move_real_tensors, save_consolidated
from ._pipeline import LightningPipeline, pipeline_stages
from ._summary import install_sharded_summary
from .precision import ZeroPrecision

__all__ = ["ZeroStrategy"]

_ROOT_PREFIX = "module."


class _LightningRoot(nn.Module):
    """The module the engine wraps (see [Note: the root wrapper])."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _timing_sink(trainer: pl.Trainer) -> Callable[[dict[str, float], int], None]:
    def log(report: dict[str, float], step: int) -> None:
        metrics = {f"wall_clock/{k}": float(v) for k, v in report.items()}
        for logger in trainer.loggers:  # rank-zero-only inside Lightning's loggers
            logger.log_metrics(metrics, step=step)

    return log


class ZeroStrategy(ParallelStrategy):
    """ZeRO stage 1, 2 or 3 sharded data parallelism for ``lightning.Trainer``.

    ``import ds_strategy`` registers ``zero1``, ``zero2``, ``zero2_offload``, ``zero3`` and
    ``zero3_offload``, so ``Trainer(strategy="zero3")`` works without importing this class.
    After setup, ``trainer.strategy.engine`` is the :class:`~ds_strategy.ZeroEngine`.

    The Trainer's flags map onto the config: ``precision`` onto ``bf16``/``fp16``,
    ``accumulate_grad_batches`` onto ``gradient_accumulation_steps``, ``gradient_clip_val``
    onto ``gradient_clipping`` (clipping by norm only). A config value that contradicts a
    flag is an error naming both. Checkpoints are sharded directories written by every rank;
    :meth:`save_consolidated` exports the weights to one file.

    Args:
        stage: ZeRO stage 0-3; ``None`` keeps the config's stage (2 when there is no config).
        config: a :class:`~ds_strategy.ZeroConfig`, a DeepSpeed-style dict, or a path to a
            ``.json``/``.yaml`` file. Explicit arguments of this constructor override it.
        offload_optimizer: keep optimizer state in CPU memory
            (``zero_optimization.offload_optimizer.device: cpu``).
        offload_parameters: keep parameters in CPU memory (stage 3 only,
            ``zero_optimization.offload_param.device: cpu``).
        param_init_fn: ``fn(module)`` initialising a module's own parameters when a model
            built on the meta device is materialised (default: ``module.reset_parameters()``).
        accelerator, parallel_devices, cluster_environment, precision_plugin: set by the
            Trainer; as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
        process_group_backend: ``"gloo"``/``"nccl"`` (default: by device).
        timeout: timeout of the process group's collectives.

    Example::

        import lightning as L
        from ds_strategy.lightning import ZeroStrategy

        trainer = L.Trainer(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=2,
                            accumulate_grad_batches=2, gradient_clip_val=1.0, max_epochs=2)
        trainer.fit(model)              # a LightningModule
        trainer.strategy.save_consolidated("weights.safetensors")
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int | None = None,
        config: ZeroConfig | dict[str, Any] | str | Path | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
        )
        self._base_config = base_config(config, stage, offload_optimizer, offload_parameters)
        self._param_init_fn = param_init_fn
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._engine: ZeroEngine | None = None
        self._engine_trains = False  # built with the LightningModule's optimizer (not for eval)
        self._pipeline: LightningPipeline | None = None  # with a pipeline config section

    # -- configuration --------------------------------------------------------------------------

    @property
    def stage(self) -> int:
        return int(self._base_config.zero_optimization.stage)

    @property
    def config(self) -> ZeroConfig:
        """The engine's resolved config after setup; before, the config with this strategy's
        arguments applied (the Trainer's flags are written in at setup)."""
        return self._engine.config if self._engine is not None else self._base_config

    @property
    def engine(self) -> ZeroEngine:
        """The :class:`~ds_strategy.ZeroEngine` (available once the Trainer set the strategy up)."""
        if self._engine is None:
            raise RuntimeError(
                "trainer.strategy.engine exists once the Trainer has set the strategy up "
                "(inside fit/validate/test/predict, or after them)"
            )
        return self._engine

    @property
    def pipeline(self) -> PipelineEngine:
        """The :class:`~ds_strategy.core.pipeline.PipelineEngine` when the config has a
        ``pipeline`` section (see :mod:`ds_strategy.lightning._pipeline` for what the
        LightningModule provides then)."""
        if self._pipeline is None:
            raise RuntimeError(
                "trainer.strategy.pipeline exists once the Trainer has set up a strategy whose "
                "config has a pipeline section with stages > 1"
            )
        return self._pipeline.engine

    @property
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning builds a stock plugin from Trainer(precision=...); the engine owns precision,
        # so keep only the flag.
        self._precision_plugin = None if plugin is None else ZeroPrecision.from_plugin(plugin)

    # -- processes ------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True  # how a custom strategy asks the Trainer for a DistributedSampler

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        stages = pipeline_stages(self._base_config)
        if stages > 1:  # shard by data-parallel rank: the Mesh's layout (rank = stage * D + dp)
            dp_size = self.world_size // stages
            return {"num_replicas": dp_size, "rank": self.global_rank % dp_size}
        # the engine's data-parallel group is the world: every rank gets a distinct shard of data
        if self._engine is not None:
            return {"num_replicas": self._engine.world_size, "rank": self._engine.rank}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its sharded checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores the optimizer with the weights

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # see [Note: accumulation]

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(
                self.root_device
            )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=device_id,
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- model construction ---------------------------------------------------------------------

    def _meta_init(self, empty_init: bool | None) -> bool:
        return (self.stage == 3 and empty_init is not False) or bool(empty_init)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Under stage 3 (or with ``empty_init=True``) modules are created on the meta device;
        the engine materialises them one ZeRO-3 unit at a time in :meth:`setup`."""
        if not self._meta_init(empty_init):
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta") if self.stage == 3 else nullcontext():
            yield

    # -- setup ----------------------------------------------------------------------------------

    def model_to_device(self) -> None:
        """Move the LightningModule's real (non-meta) tensors to this rank's device. Once the
        engine exists it owns placement: its flat buffers back the parameters."""
        if self._engine is None and self.lightning_module is not None:
            move_real_tensors(self.lightning_module, self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        pl_module = self.lightning_module
        assert pl_module is not None
        if pipeline_stages(self._base_config) > 1:
            self._setup_pipeline(trainer, fitting)
            return
        if self._owns(pl_module) and (self._engine_trains or not fitting):
            self.model = self._engine  # fit then validate/test/predict: keep the trained engine
            return
        self._drop_engine(pl_module)
        if fitting:
            optimizer, schedulers = self._lightning_optimizer(trainer)
            engine = self._build_engine(trainer, optimizer, schedulers[:1])
            # Lightning steps the schedulers itself (intervals, frequency, ReduceLROnPlateau
            # monitors); the engine only re-pointed them at its rebuilt optimizer. A config
            # scheduler section (and no Lightning scheduler) stays with the engine.
            if schedulers:
                engine.lr_scheduler = None
            for scheduler in schedulers[1:]:
                scheduler.optimizer = engine.optimizer
            self.optimizers = [engine.optimizer]
        else:
            engine = self._build_engine(trainer, inference_optimizer, [])
        self._engine, self._engine_trains = engine, fitting
        self.model = engine
        if engine.stage == 3:
            install_sharded_summary(trainer, engine)
        self.barrier("ZeroStrategy.setup")

    def _setup_pipeline(self, trainer: pl.Trainer, fitting: bool) -> None:
        pl_module = self.lightning_module
        current = self._pipeline
        if current is not None and current.pl_module is pl_module:
            if fitting:
                self.optimizers = [current.engine.optimizer]
            return  # fit then validate/test: keep the trained pipeline
        cfg = apply_loop_flags(
            self._base_config,
            world_size=self.world_size // pipeline_stages(self._base_config),
            precision=str(self.precision_plugin.precision),
            accumulate=None,  # the micro-batches are the config's gradient_accumulation_steps
        )
        self.model_to_device()
        if fitting:
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with a "
                    "pipeline config: a pipeline step already runs the config's "
                    "gradient_accumulation_steps micro-batches; leave accumulate_grad_batches at 1"
                )
            clip = clipping(cfg, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            cfg = cfg.replace(gradient_clipping=clip)
            optimizer, schedulers = self._lightning_optimizer(trainer)
            self._pipeline = LightningPipeline.build(pl_module, cfg, optimizer, schedulers)
            self.optimizers = [self._pipeline.engine.optimizer]
        else:
            self._pipeline = LightningPipeline.build(pl_module, cfg, inference_optimizer, [])
        self.barrier("ZeroStrategy.setup")

    # -- the loop's steps (a pipeline config replaces them, see _pipeline.py) -------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline.training_step(args[0] if args else kwargs["batch"])
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline.eval_step(args[0] if args else kwargs["batch"], "val")
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline.eval_step(args[0] if args else kwargs["batch"], "test")
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            raise RuntimeError(
                "predict is not available with a pipeline config: the pipeline returns losses, "
                "not outputs; consolidate the weights (save_consolidated) and predict without it"
            )
        return super().predict_step(*args, **kwargs)

    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:
            return closure_loss  # train_batch ran the backward of every micro-batch
        return super().backward(closure_loss, *args, **kwargs)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any
    ) -> Any:
        if self._pipeline is not None:
            return closure()  # the closure runs training_step, whose train_batch steps
        return super().optimizer_step(optimizer, closure, *args, **kwargs)

    def _owns(self, pl_module: pl.LightningModule) -> bool:
        return self._engine is not None and self._engine.module.module is pl_module

    def _drop_engine(self, pl_module: pl.LightningModule) -> None:
        engine, self._engine = self._engine, None
        if engine is None or engine.module.module is not pl_module:
            return  # another module's engine: that module stays as it is
        if engine.stage == 3:
            raise RuntimeError(
                "this LightningModule was set up by ZeroStrategy for evaluation and its ZeRO-3 "
                "parameters are sharded, so it cannot be set up again for training; call "
                "trainer.fit before validate/test/predict, or use a new model and Trainer"
            )
        engine.destroy()  # stages 0-2 keep full parameters: a new engine can start from them

    def _lightning_optimizer(self, trainer: pl.Trainer) -> tuple[Optimizer, list[Any]]:
        self.setup_optimizers(trainer)
        optimizers = self.optimizers
        if len(optimizers) != 1 or isinstance(optimizers[0], _MockOptimizer):
            raise ValueError(
                f"ZeroStrategy needs exactly one optimizer from configure_optimizers, got "
                f"{0 if optimizers and isinstance(optimizers[0], _MockOptimizer) else len(optimizers)}: "
                "the engine shards one optimizer's state across the ranks and runs it at its own "
                "accumulation boundaries. Put all parameters in one optimizer (param groups may "
                "carry different hyper-parameters), or train the other models with their own "
                "strategy"
            )
        return optimizers[0], [config.scheduler for config in self.lr_scheduler_configs]

    def _build_engine(
        self, trainer: pl.Trainer, optimizer: Any, schedulers: list[Any]
    ) -> ZeroEngine:
        pl_module = self.lightning_module
        assert pl_module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        precision = str(self.precision_plugin.precision)
        cfg = apply_loop_flags(
            self._base_config,
            world_size=self.world_size,
            precision=precision,
            accumulate=trainer.accumulate_grad_batches if fitting else None,
            clip_val=trainer.gradient_clip_val,
            clip_algorithm=trainer.gradient_clip_algorithm,
        )
        self.model_to_device()
        try:
            engine = ZeroEngine(
                _LightningRoot(pl_module),
                optimizer,
                cfg,
                lr_scheduler=schedulers[0] if schedulers else None,
                param_init_fn=self._param_init_fn,
            )
        except ValueError as err:
            if cfg.fp16.enabled is True or cfg.bf16.enabled is True:
                key = "fp16" if cfg.fp16.enabled is True else "bf16"
                raise ValueError(
                    f"Trainer(precision={precision!r}) sets {key}.enabled=true in the ZeRO "
                    f"config, which the engine rejected: {err}"
                ) from err
            raise
        if engine.timers is not None:  # wall_clock_breakdown: also to the Trainer's loggers
            engine.timers.add_sink(_timing_sink(trainer))
        return engine

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

    def teardown(self) -> None:
        # The engine stays: the LightningModule's parameters live in its flat buffers (under
        # stage 3 only this rank's shard exists), so validate/test/predict after fit reuse it.
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ----------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine writes the (sharded) weights itself in save_checkpoint

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return {}  # likewise the sharded optimizer state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already restored the weights into the engine

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # and the optimizer state

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike,
        storage_options: Any | None = None,
    ) -> None:
        """Write one sharded checkpoint directory at ``filepath`` (collective: every rank
        writes its own shards). Lightning's checkpoint dict, less the weights and optimizer
        state that the engine writes itself, travels as the engine's ``client_state``."""
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy does not use a CheckpointIO plugin, so storage_options cannot "
                "be passed to save_checkpoint"
            )
        path = Path(self.broadcast(str(filepath)))  # rank 0's name everywhere
        client_state = {
            k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
        }
        # Lightning leaves optimizer_states out of a weights-only checkpoint
        # (trainer.save_checkpoint(weights_only=True), ModelCheckpoint(save_weights_only=True))
        include_optimizer = "optimizer_states" in checkpoint
        if self._pipeline is not None:
            if not include_optimizer:
                raise ValueError(
                    "weights-only checkpoints are not available with a pipeline config; save a "
                    "full checkpoint or export the weights with save_consolidated"
                )
            self._pipeline.engine.save_checkpoint(path, client_state=client_state)
            return
        self.engine.save_checkpoint(
            path, client_state=client_state, include_optimizer=include_optimizer
        )

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore weights, optimizer and engine counters from a directory written by
        :meth:`save_checkpoint` (any world size or stage); returns Lightning's dict.

        Nothing in the directory is unpickled beyond tensors and plain data unless
        ``weights_only=False`` (``Trainer.fit(..., weights_only=False)``), Lightning's and
        torch's way of saying the file is trusted: then it loads with
        ``trust_checkpoint=True`` (hyper-parameters holding custom objects need it).
        """
        trusted = weights_only is False
        path = Path(self.broadcast(str(checkpoint_path)))
        if self._engine is not None:
            self._engine.wait_for_checkpoint()  # an asynchronous save may still be renaming
        if not path.is_dir():
            raise ValueError(
                f"{path}: ZeroStrategy resumes from checkpoint directories written under "
                "ZeroStrategy. To start from a single-file state dict, load it into the "
                "LightningModule before fit (model.load_state_dict(torch.load(path)['state_dict']))"
            )
        if self._pipeline is not None:
            saved = self._pipeline.engine.load_checkpoint(path, trust_checkpoint=trusted)
            return _lightning_state(path, saved)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and not _has_optimizer_state(path):
            raise ValueError(
                f"{path}: this checkpoint holds weights only (saved with weights_only=True or "
                "ModelCheckpoint(save_weights_only=True)), so fit cannot resume from it. Pass it "
                "to validate/test/predict, or resume fit from a full checkpoint"
            )
        # evaluation needs the weights only: its engine's optimizer is a stand-in
        client_state = self.engine.load_checkpoint(
            path, load_optimizer=fitting, trust_checkpoint=trusted
        )
        return _lightning_state(path, client_state)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """Delete a checkpoint directory (``ModelCheckpoint(save_top_k=...)`` rotation)."""
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def save_consolidated(self, path: str | os.PathLike) -> Path:
        """Write the consolidated fp32 weights to one file, keyed like
        ``lightning_module.state_dict()``; ``.safetensors`` or ``torch.save`` by suffix.

        Collective (call it on every rank); rank 0 writes. Example::

            trainer.fit(model)
            trainer.strategy.save_consolidated("model.safetensors")
        """
        if self._pipeline is not None:
            return self._pipeline.save_consolidated(Path(path))
        return save_consolidated(self.engine, path, prefix=_ROOT_PREFIX)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, kwargs in PRESETS.items():
            desc = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            strategy_registry.register(
                name, cls, description=f"ds_strategy ZeRO ({desc})", override=True, **kwargs
            )


def _has_optimizer_state(path: Path) -> bool:
    meta = path / META_FILE
    try:
        return bool(json.loads(meta.read_text()).get("optimizer", True))
    except (OSError, ValueError):
        return True  # unreadable metadata: let the engine's load name the problem


def _lightning_state(path: Path, client_state: Any) -> dict[str, Any]:
    if not isinstance(client_state, dict):
        raise ValueError(f"{path}: not written by a Lightning Trainer (no Lightning state)")
    return client_state
