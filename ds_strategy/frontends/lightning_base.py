"""What Lightning's Trainer and Fabric strategies share, over ``DDPStrategy`` but not wrapping."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from ..config import ZeroConfig
from ..config.loop import apply_loop_flags, base_config, blaming_precision_flag, check_precision
from ..config.presets import describe, preset_names
from ..core.engine import ZeroEngine
from ..core.job import JobEngines
from ..core.optimizers import move_schedulers
from ..core.parallel_dims import ParallelDims
from ..core.several import SeveralEngines
from ..core.training import TrainingEngine
from .engines import move_real_tensors

if TYPE_CHECKING:
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR

__all__ = ["FlagPrecision", "LightningZeroBase"]

# the plugins Lightning builds from its precision flag, replaced by FlagPrecision (rejects 64-true)
_STOCK = ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision")

_T = TypeVar("_T")


class _TearsDown(Protocol):
    def teardown(self) -> None: ...


class _DDPStrategy(Protocol):
    """What the mixin uses of the ``DDPStrategy`` after it in a strategy's bases (the
    Trainer's or Fabric's, whose attributes differ in type)."""

    cluster_environment: ClusterEnvironment | None

    @property
    def accelerator(self) -> _TearsDown | None: ...

    @property
    def checkpoint_io(self) -> _TearsDown: ...

    @property
    def world_size(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    def broadcast(self, obj: _T, src: int = 0) -> _T: ...


class FlagPrecision:
    """Carries the precision flag to the strategy's config; never autocasts nor converts."""

    front = "Trainer"

    def __init__(self, precision: str = "32-true") -> None:
        """Keep the flag, once checked.

        Args:
            precision: the framework's precision flag, such as ``"bf16-mixed"``.
        """
        # one of Lightning's flags, as its Precision types it: check_precision refuses others
        self.precision = cast("_PRECISION_INPUT_STR", check_precision(precision, self.front))

    @classmethod
    def from_plugin(cls, plugin: Any) -> Any:
        """The equivalent of the plugin the framework built from its ``precision`` flag.

        Args:
            plugin: the framework's precision plugin. A stock one maps onto this class; any
                other is refused.
        """
        if isinstance(plugin, cls):
            return plugin
        if type(plugin).__name__ in _STOCK and type(plugin).__module__.startswith("lightning."):
            return cls(str(plugin.precision))
        raise ValueError(
            f"the ZeRO strategy owns precision, so the precision plugin {type(plugin).__name__} "
            f"cannot be combined with it; remove it and pass {cls.front}(precision=...) instead"
        )


class LightningZeroBase:
    """What the Trainer's and Fabric's ``ZeroStrategy`` share, mixed in before ``DDPStrategy``."""

    front = "Trainer"  # how error messages name the loop object
    precision_attr = "precision_plugin"  # the framework's name for its precision plugin
    precision_class: Any = FlagPrecision  # the front end's plugin (a FlagPrecision)
    not_set_up = "the ZeRO engine exists once the strategy has set the model up"
    say_which = "pass the model or optimizer the strategy returned"  # when several are set up

    def __init__(
        self,
        stage: int | None = None,
        config: ZeroConfig | dict[str, Any] | str | Path | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        accelerator: Any | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Any | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """Configure the strategy. The framework sets ``accelerator`` and the arguments after it.

        Args:
            stage: the ZeRO stage, 0-3. ``None`` keeps the config's stage, or 2 without a
                config.
            config: a :class:`~ds_strategy.ZeroConfig`, a DeepSpeed-style dict or a
                ``.json``/``.yaml`` path. The other arguments override it.
            offload_optimizer: keep optimizer state in CPU memory.
            offload_parameters: keep parameters in CPU memory (stage 3).
            param_init_fn: ``fn(module)`` initialising a meta-device module's own parameters
                when it is materialised. Default: ``module.reset_parameters()``.
            accelerator: set by the framework.
            parallel_devices: set by the framework.
            cluster_environment: set by the framework.
            precision: set by the framework.
            process_group_backend: the process group's backend. Default: by device.
            timeout: the process group's timeout.
        """
        super().__init__(  # type: ignore[call-arg]
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **{self.precision_attr: precision},
        )
        self._base_config = base_config(config, stage, offload_optimizer, offload_parameters)
        self._param_init_fn = param_init_fn
        self._engine: TrainingEngine | None = None  # a ZeroEngine, or a pipeline's
        self._job = JobEngines(self.not_set_up, self.say_which)  # its ZeroEngines, see core/job.py
        self._init_front()

    def _init_front(self) -> None:
        """The front end's own state, set after the framework's constructor."""

    @property
    def _ddp(self) -> _DDPStrategy:
        # every strategy mixes this class in before a DDPStrategy (see _DDPStrategy)
        return cast(_DDPStrategy, self)

    @property
    def stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self._base_config.layout.stage

    @property
    def config(self) -> ZeroConfig:
        """The engine's resolved config once set up; before, without the loop's flags."""
        return self._engine.config if self._engine is not None else self._base_config

    @property
    def engine(self) -> ZeroEngine:
        """The :class:`~ds_strategy.ZeroEngine` the strategy set up."""
        if not isinstance(self._engine, ZeroEngine):
            raise RuntimeError(self.not_set_up)
        return self._engine

    def _active(self) -> TrainingEngine:
        if self._engine is None:
            raise RuntimeError(self.not_set_up)
        return self._engine

    def save_consolidated(self, path: str | os.PathLike) -> Path:
        """Write the fp32 weights to one file. Collective: rank 0 writes.

        The weights are keyed like the module's ``state_dict()``. A model set up with several
        optimizers writes every engine's::

            trainer.strategy.save_consolidated("model.safetensors")

        Args:
            path: the file: ``.safetensors``, or ``torch.save`` for another suffix.

        Returns:
            The file written.
        """
        several = self._job.several_of()  # the only set-up, an engine per optimizer
        return (several if several is not None else self._active()).save_weights(Path(path))

    def _add(self, setup: Any) -> Any:
        """Record what one set-up built (see ``core/job.py``); the first engine is ``engine``."""
        self._job.add(setup)
        if self._engine is None:
            self._engine = self._job.trained[0]
        return setup

    def _checkpoint_path(self, path: str | os.PathLike) -> Path:
        """Rank 0's path on every rank, once an asynchronous save has finished renaming."""
        if self._engine is not None:
            self._engine.wait_for_checkpoint()
        return Path(self._ddp.broadcast(str(path)))

    def plugin(self) -> Any:
        """The precision plugin.

        The framework builds a stock one from its ``precision`` flag. The setter turns it into
        ``precision_class``, which carries the flag only.
        """
        plugin = getattr(self, f"_{self.precision_attr}")
        return plugin if plugin is not None else self.precision_class()

    def set_plugin(self, plugin: Any) -> None:
        """Keep the framework's precision plugin as ``precision_class``.

        Args:
            plugin: the framework's plugin, or None.
        """
        kept = None if plugin is None else self.precision_class.from_plugin(plugin)
        setattr(self, f"_{self.precision_attr}", kept)

    def _flag(self) -> str:
        return str(getattr(self, self.precision_attr).precision)

    def _build_engine(
        self, module: nn.Module, optimizer: Any, accumulate: int | None, **kwargs: Any
    ) -> ZeroEngine:
        """The engine of ``module``, with the loop's flags written into its config."""
        flag = self._flag()
        clip = {k: kwargs.pop(k) for k in ("clip_val", "clip_algorithm") if k in kwargs}
        cfg = apply_loop_flags(
            self._base_config,
            world_size=self._ddp.world_size,
            precision=flag,
            accumulate=accumulate,
            front=self.front,
            **clip,
        )
        move_real_tensors(module, self._ddp.root_device)
        with blaming_precision_flag(cfg, self.front, flag):
            return ZeroEngine(module, optimizer, cfg, param_init_fn=self._param_init_fn, **kwargs)

    def _build_several(
        self,
        module: nn.Module,
        optimizers: list[Any],
        schedulers: list[Any],
        accumulate: int | None,
    ) -> SeveralEngines:
        """One engine per optimizer over the submodules holding its parameters (see [Note: one
        engine per optimizer] in ``core/several.py``); each scheduler moves onto its engine."""

        def build(part: nn.Module, optimizer: Any) -> ZeroEngine:
            if optimizer is None:  # the frozen submodules', for evaluation
                return self._build_engine(part, None, None)
            engine = self._build_engine(part, optimizer, accumulate)
            move_schedulers(engine, [s for s in schedulers if s.optimizer is optimizer])
            return engine

        move_real_tensors(module, self._ddp.root_device)  # buffers of parameter-free submodules
        return SeveralEngines(module, optimizers, build)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The sampler's ``num_replicas`` and ``rank``."""
        # by data-parallel rank: every stage, tensor-, sequence- and context-parallel rank of
        # one reads its rows
        layout, world = self._base_config.layout, self._ddp.num_nodes * self._ddp.num_processes
        dims = ParallelDims(world, pp=layout.stages, tp=layout.tp, sp=layout.sp, cp=layout.cp)
        return {"num_replicas": dims.dp, "rank": dims.coordinates(self._ddp.global_rank)["dp"]}

    def _meta_init(self, empty_init: bool | None) -> bool:
        """Create modules on the meta device under stage 3 (or with ``empty_init=True``), not
        with tensor parallelism, which splits real weights."""
        return self._meta_stage3 and empty_init is not False or bool(empty_init)

    def module_sharded_context(self) -> AbstractContextManager:
        """Under stage 3 without tensor parallelism, modules are created on the meta device."""
        return torch.device("meta") if self._meta_stage3 else nullcontext()

    @property
    def _meta_stage3(self) -> bool:
        layout = self._base_config.layout
        return layout.stage == 3 and layout.tp == 1

    model_sharded_context = module_sharded_context  # the Trainer's name

    def teardown(self) -> None:
        ddp = self._ddp
        assert ddp.cluster_environment is not None and ddp.accelerator is not None
        ddp.cluster_environment.teardown()
        getattr(self, self.precision_attr).teardown()
        ddp.accelerator.teardown()
        ddp.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the package's presets by name: ``zero1`` ... ``zero3_offload``.

        Args:
            strategy_registry: the framework's registry of strategies.
        """
        for name in preset_names():  # the package's presets (config/presets.py), by name
            strategy_registry.register(
                name,
                cls,
                description=f"ds_strategy: {describe(name)}",
                override=True,
                config=name,
            )
