"""``ZeroStrategy`` for Lightning Fabric: ``fabric.setup``, ``fabric.backward``,
``fabric.clip_gradients`` and ``fabric.save``/``fabric.load`` mapped onto one
:class:`~ds_strategy.ZeroEngine`. The Trainer counterpart is
:class:`ds_strategy.lightning.ZeroStrategy`; both share the config mapping and hold no
sharding logic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import (
    TBroadcast,
    _BackwardSyncControl,
    _Sharded,
    _validate_keys_for_strict_loading,
)
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp, _Stateful
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from ..config import ZeroConfig
from ..core.engine import ZeroEngine
from ..lightning._config import PRESETS, apply_loop_flags, base_config
from ..lightning._engine_ops import (
    inference_optimizer,
    move_real_tensors,
    save_consolidated,
    step_with_clip,
)
from .precision import ZeroFabricPrecision

__all__ = ["ZeroStrategy"]


class _EngineSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)`` is the engine's ``no_sync()``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, ZeroEngine):
            raise TypeError(
                "fabric.no_backward_sync() needs the model returned by fabric.setup() under the "
                "ZeRO strategy"
            )
        return module.no_sync()


class ZeroStrategy(ParallelStrategy, _Sharded):
    """ZeRO stage 1, 2 or 3 sharded data parallelism for ``lightning.Fabric``.

    ``import ds_strategy`` registers ``zero1``, ``zero2``, ``zero2_offload``, ``zero3`` and
    ``zero3_offload`` for ``Fabric(strategy=...)``. The training loop is the same as under
    ``strategy="ddp"``; ``fabric.setup(model, optimizer)`` returns the engine (wrapped by
    Fabric) and its rebuilt optimizer, and ``fabric.save``/``fabric.load`` write and read one
    sharded checkpoint directory.

    Semantics that differ from DDP because gradients are sharded:

    - ``fabric.clip_gradients(model, optimizer, max_norm=...)`` returns the global norm and
      clips like torch, at an accumulation boundary (it finishes the gradient reduction);
      between boundaries the request waits for the next optimizer step and None is
      returned. Clipping by value is not supported.
    - ``optimizer.zero_grad()`` is harmless but unnecessary: the engine zeroes gradients
      after each optimizer step.
    - An lr scheduler passed to ``fabric.setup(..., scheduler=...)`` is re-pointed at the
      rebuilt optimizer and still stepped by your loop.

    Args:
        stage, config, offload_optimizer, offload_parameters, param_init_fn: as for
            :class:`ds_strategy.lightning.ZeroStrategy`.
        accelerator, parallel_devices, cluster_environment, precision: set by Fabric.
        process_group_backend: ``"gloo"``/``"nccl"`` (default: by device).
        timeout: timeout of the process group's collectives.

    Example::

        fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
        fabric.launch()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
        loss = model(x).square().mean()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    """

    def __init__(
        self,
        stage: int | None = None,
        config: ZeroConfig | dict[str, Any] | str | Path | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._base_config = base_config(config, stage, offload_optimizer, offload_parameters)
        self._param_init_fn = param_init_fn
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._backward_sync_control = _EngineSyncControl()
        self._engine: ZeroEngine | None = None
        self._max_norm: float | None = None  # a clip request waiting for the next step

    # -- configuration --------------------------------------------------------------------------

    @property
    def stage(self) -> int:
        return int(self._base_config.zero_optimization.stage)

    @property
    def config(self) -> ZeroConfig:
        """The engine's resolved config once set up; before, the config with this strategy's
        arguments applied."""
        return self._engine.config if self._engine is not None else self._base_config

    @property
    def engine(self) -> ZeroEngine:
        """The engine built by ``fabric.setup``."""
        if self._engine is None:
            raise RuntimeError("the ZeRO engine exists once fabric.setup(model, ...) has run")
        return self._engine

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else ZeroFabricPrecision()

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = None if precision is None else ZeroFabricPrecision.from_plugin(precision)

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
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
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

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
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

    def all_reduce(
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

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Under stage 3 (or with ``empty_init=True``) ``fabric.init_module()`` creates the
        model on the meta device; ``fabric.setup`` materialises it one ZeRO-3 unit at a time."""
        if not self._meta_init(empty_init):
            return super().module_init_context(empty_init)
        return self._meta_context()

    def module_sharded_context(self) -> AbstractContextManager:
        return self._meta_context() if self.stage == 3 else nullcontext()

    @contextmanager
    def _meta_context(self) -> Generator[None, None, None]:
        with torch.device("meta"), self.precision.module_init_context():
            yield

    def module_to_device(self, module: nn.Module) -> None:
        if any(t.is_meta for t in chain(module.parameters(), module.buffers())):
            move_real_tensors(module, self.root_device)  # the engine materialises the rest
        else:
            module.to(self.root_device)

    # -- setup ----------------------------------------------------------------------------------

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Wrap ``module`` and its single optimizer in a :class:`~ds_strategy.ZeroEngine`."""
        if len(optimizers) != 1:
            raise ValueError(
                f"the ZeRO strategy needs exactly one optimizer per model, got {len(optimizers)}: "
                "the engine shards one optimizer's state across the ranks. Put all parameters "
                "in one optimizer (param groups may carry different hyper-parameters)"
            )
        engine = self._build_engine(module, optimizers[0], scheduler)
        if scheduler is not None:
            engine.lr_scheduler = None  # the user's loop keeps stepping its scheduler
        return engine, [engine.optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Wrap ``module`` for evaluation (no optimizer state is kept)."""
        return self._build_engine(module, inference_optimizer, None)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def _build_engine(self, module: nn.Module, optimizer: Any, scheduler: Any) -> ZeroEngine:
        if self._engine is not None:
            raise ValueError(
                "the ZeRO strategy drives one model per Fabric: fabric.setup was already called"
            )
        precision = str(self.precision.precision)
        cfg = apply_loop_flags(
            self._base_config,
            world_size=self.world_size,
            precision=precision,
            accumulate=None,  # Fabric loops accumulate as the config (or the user) says
            front="Fabric",
        )
        self.module_to_device(module)
        try:
            engine = ZeroEngine(
                module, optimizer, cfg, lr_scheduler=scheduler, param_init_fn=self._param_init_fn
            )
        except ValueError as err:
            if cfg.fp16.enabled is True or cfg.bf16.enabled is True:
                key = "fp16" if cfg.fp16.enabled is True else "bf16"
                raise ValueError(
                    f"Fabric(precision={precision!r}) sets {key}.enabled=true in the ZeRO config, "
                    f"which the engine rejected: {err}"
                ) from err
            raise
        self._engine = engine
        return engine

    # -- backward, step, clipping ---------------------------------------------------------------

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        engine = module if isinstance(module, ZeroEngine) else self.engine
        self.precision.pre_backward(tensor, module)
        engine.backward(tensor, *args, **kwargs)
        self.precision.post_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: the engine's step (runs the optimizer at accumulation
        boundaries, clipping as configured or as ``clip_gradients`` asked)."""
        if kwargs.get("closure") is not None:
            raise ValueError("the ZeRO strategy cannot run optimizer.step(closure)")
        max_norm, self._max_norm = self._max_norm, None
        step_with_clip(self.engine, max_norm)
        return None

    def clip_gradients_norm(  # type: ignore[override]
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor | None:
        """Clip the global L2 norm of the gradients at ``max_norm`` and return it (before
        clipping), as ``torch.nn.utils.clip_grad_norm_`` does, through the engine's
        ``clip_grad_norm_``: at an accumulation boundary it finishes the gradient reduction
        and clips the reduced shards; the optimizer step stays with ``optimizer.step()``.
        Between boundaries (a config with ``gradient_accumulation_steps`` > 1) the request
        is kept for the next optimizer step and None is returned. A non-finite norm (an
        fp16 overflow, whose step the engine will skip) is returned, not raised.
        """
        if float(norm_type) != 2.0:
            raise ValueError(
                f"the ZeRO strategy clips by the global L2 norm only, got norm_type={norm_type}"
            )
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            self._max_norm = float(max_norm)
            return None
        return torch.tensor(engine.clip_grad_norm_(float(max_norm)))

    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        raise ValueError(
            "fabric.clip_gradients(clip_val=...) is not supported by the ZeRO strategy: it clips "
            "by the global gradient norm; use fabric.clip_gradients(model, optimizer, max_norm=...)"
        )

    # -- checkpoints ----------------------------------------------------------------------------

    def _engine_in(self, state: dict[str, Any]) -> ZeroEngine:
        engines = [v for v in state.values() if isinstance(v, ZeroEngine)]
        if len(engines) != 1:
            raise ValueError(
                f"the state must hold exactly one model set up by fabric.setup under the ZeRO "
                f"strategy (found {len(engines)}): pass state={{'model': model, ...}}"
            )
        return engines[0]

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write one sharded checkpoint directory (collective). The model and its optimizer
        go through the engine; every other entry travels as its ``client_state``."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                "fabric.save(..., storage_options/filter) is not supported by the ZeRO strategy: "
                "the engine writes the sharded state itself"
            )
        engine = self._engine_in(state)
        path = Path(self.broadcast(str(path)))
        rest = {k: v for k, v in state.items() if v is not engine and v is not engine.optimizer}
        engine.save_checkpoint(path, client_state=self._convert_stateful_objects_in_state(rest, {}))

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the engine (weights, optimizer, counters) from a directory written by
        :meth:`save_checkpoint`, then the other entries of ``state`` from its client state.
        Returns the saved entries that ``state`` did not ask for."""
        path = Path(self.broadcast(str(path)))
        if self._engine is not None:
            self._engine.wait_for_checkpoint()  # an asynchronous save may still be renaming
        if not path.is_dir() or not isinstance(state, dict) or not state:
            if path.is_dir():
                raise ValueError(
                    "loading a ZeRO checkpoint directory needs the set-up model in the state: "
                    "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
                )
            return super().load_checkpoint(path, state, strict, weights_only)
        engine = self._engine_in(state)
        # weights_only=False is Fabric's (and torch.load's) way of saying "I trust this file"
        saved = engine.load_checkpoint(path, trust_checkpoint=weights_only is False) or {}
        wanted = [k for k, v in state.items() if v is not engine and v is not engine.optimizer]
        _validate_keys_for_strict_loading(wanted, saved.keys(), strict=strict)
        for name in wanted:
            if name not in saved:
                continue
            obj = state[name]
            if isinstance(obj, _Stateful):
                obj.load_state_dict(saved.pop(name))
            else:
                state[name] = saved.pop(name)
        return saved

    def save_consolidated(self, path: str | os.PathLike) -> Path:
        """Write the consolidated fp32 weights to one file, keyed like the model's
        ``state_dict()`` (``.safetensors`` or ``torch.save`` by suffix). Collective; rank 0
        writes."""
        return save_consolidated(self.engine, path)

    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, kwargs in PRESETS.items():
            desc = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            strategy_registry.register(
                name, cls, description=f"ds_strategy ZeRO ({desc})", override=True, **kwargs
            )
