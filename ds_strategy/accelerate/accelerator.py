"""``ZeroAccelerator``: ``accelerate.Accelerator`` with ZeRO sharding from ds_strategy's engine.

Accelerate has no registry for third-party engines, so this is a subclass that overrides the
methods where a DDP-wrapped model and a sharded engine differ (``prepare``, ``backward``,
``clip_grad_norm_``, state dicts and checkpoints) and leaves the rest (dataloaders, ``gather``,
``accumulate``, trackers, ``print`` ...) to Accelerate.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import PartialState
from accelerate.utils import DistributedType, DynamoBackend
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch import nn

from ..config import ZeroConfig
from ..core import ZeroEngine
from . import _state
from ._driver import (
    EngineDriver,
    EngineSchedulerWrapper,
    ZeroOptimizerWrapper,
    track_optimizer_step,
)
from ._pipeline import PipelineFrontEnd, pipeline_front_end
from ._resolve import AcceleratorFacts, apply_mixed_precision, resolve, torch_optimizer
from .plugin import ZeroPlugin

__all__ = ["ZeroAccelerator"]

_OTHER_ENGINES = {
    "deepspeed_plugin": "DeepSpeed",
    "deepspeed_plugins": "DeepSpeed",
    "fsdp_plugin": "FSDP",
    "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": "tensor parallelism",
    "parallelism_config": "ParallelismConfig (tensor/context/sequence parallelism)",
}
_OTHER_ENGINE_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "ParallelismConfig",
}
_SUPPORTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def _no_accelerator_device() -> bool:
    probe = getattr(torch, "accelerator", None)
    if probe is not None and hasattr(probe, "is_available"):
        return not probe.is_available()
    return not torch.cuda.is_available()


class ZeroAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose ``prepare`` wraps the model and optimizer in a
    ZeRO-sharded :class:`~ds_strategy.ZeroEngine` (stage 0-3) instead of DDP.

    A loop written for ``Accelerator`` runs unchanged: ``prepare``, ``backward``,
    ``accumulate``, ``clip_grad_norm_`` (returns the global norm; clips like torch),
    ``optimizer.step_was_skipped``, schedulers (stepped like Accelerate steps them),
    ``unwrap_model``, ``get_state_dict`` / ``save_model`` (consolidated weights) and
    ``save_state`` / ``load_state`` (sharded: every rank writes its own shard).

    Args:
        zero_plugin: the ZeRO config (see :class:`ZeroPlugin`). ``None`` reads the file named
            by ``DS_STRATEGY_CONFIG`` and ``DS_STRATEGY_*`` overrides.
        **kwargs: ``accelerate.Accelerator``'s arguments. ``mixed_precision`` maps onto the
            config's ``fp16``/``bf16`` sections; DeepSpeed/FSDP/Megatron plugins, parallelism
            configs and ``dynamo_backend`` are refused with an error.

    Started by ``accelerate launch`` with a standard accelerate config file::

        DS_STRATEGY_CONFIG=configs/zero3.yaml \\
            accelerate launch --config_file configs/accelerate/cpu_2proc.yaml train.py

    where ``train.py`` is a plain Accelerate loop with the class swapped::

        from ds_strategy.accelerate import ZeroAccelerator

        accelerator = ZeroAccelerator(gradient_accumulation_steps=2)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        accelerator.save_model(model, "out")  # consolidated model.safetensors

    With a ``pipeline`` section in the config, ``prepare`` takes an ``nn.Sequential`` and the
    loop is ``loss = model.train_batch(x, y)`` (see ``ds_strategy.accelerate._pipeline``).
    """

    def __init__(self, *args: Any, zero_plugin: ZeroPlugin | None = None, **kwargs: Any) -> None:
        if args:
            raise TypeError("ZeroAccelerator takes keyword arguments only")
        _refuse_other_engines(kwargs)
        self.zero_plugin = zero_plugin if zero_plugin is not None else ZeroPlugin()
        loaded = self.zero_plugin.load()
        if self._launched_on_cpu(kwargs):
            kwargs["cpu"] = True
        super().__init__(**kwargs)
        self._check_state()
        # checked now so a precision conflict fails before any model is built
        self._zero_config_source = apply_mixed_precision(loaded, str(self.state.mixed_precision))
        # The engine owns precision (casting, loss scaling), not torch.amp: no GradScaler here.
        self.scaler = None
        self.native_amp = False
        self._driver: EngineDriver | None = None
        self._optimizer_wrapper: ZeroOptimizerWrapper | None = None
        self._user_optimizer: weakref.ref[Any] | None = None
        self._loader_batch_sizes: list[int | None] = []
        # a `pipeline` section: the model becomes a PipelineEngine driven by train_batch
        self._pipeline: PipelineFrontEnd | None = pipeline_front_end(self, self._zero_config_source)
        gas = self._zero_config_source.gradient_accumulation_steps
        if isinstance(gas, int):
            self._adopt_accumulation_steps(gas)

    # -- construction checks -------------------------------------------------------------------

    @staticmethod
    def _launched_on_cpu(kwargs: dict[str, Any]) -> bool:
        """Several processes but no GPU: run on CPU with gloo.

        ``accelerate launch`` starts several CPU processes only through mpirun (MULTI_CPU);
        a MULTI_GPU config starts them with torchrun instead, but then each process sees no
        GPU and a plain Accelerator falls back to one process each. This is the only setup
        where starting them as MULTI_CPU is what the user meant."""
        if kwargs.get("cpu") or PartialState._shared_state:
            return False
        launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ
        return launched and _no_accelerator_device()

    def _check_state(self) -> None:
        if self.distributed_type not in _SUPPORTED_TYPES:
            raise ValueError(
                f"ZeroAccelerator runs on CPU (gloo) and CUDA (NCCL) processes; this launch is "
                f"{self.distributed_type}. Use an accelerate config with distributed_type "
                "MULTI_GPU (see configs/accelerate/)"
            )
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise ValueError(
                "dynamo_backend (torch.compile through Accelerate) is not supported by "
                "ZeroAccelerator; set dynamo_backend to 'no'"
            )

    def _adopt_accumulation_steps(self, steps: int) -> None:
        current = self.gradient_state.num_steps
        if steps != current:
            if current != 1:
                warnings.warn(
                    f"gradient_accumulation_steps: the ZeRO config says {steps}, the Accelerator "
                    f"{current}; using the config's {steps}",
                    UserWarning,
                    stacklevel=3,
                )
            self.gradient_accumulation_steps = steps  # type: ignore[has-type]

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Like ``Accelerator.prepare``: dataloaders are sharded by rank as Accelerate does; the
        model and its optimizer (passed together) become a :class:`~ds_strategy.ZeroEngine`
        and a wrapper of its rebuilt optimizer; schedulers are moved onto that optimizer."""
        if device_placement is not None:
            raise ValueError("prepare(device_placement=...) is not supported by ZeroAccelerator")
        if self._pipeline is not None:
            return self._pipeline.prepare(args)
        out = list(args)
        batch_sizes = []
        for i, obj in enumerate(args):
            if isinstance(obj, torch.utils.data.DataLoader) and not _prepared(obj):
                size = obj.batch_size
                if size is not None and self.split_batches:
                    size //= self.num_processes
                batch_sizes.append(size)
                out[i] = self.prepare_data_loader(obj)
        self._loader_batch_sizes.extend(batch_sizes)
        models = [(i, o) for i, o in enumerate(args) if _is_model(o)]
        optimizers = [(i, o) for i, o in enumerate(args) if _is_optimizer(o)]
        dummy_scheds = [(i, o) for i, o in enumerate(args) if isinstance(o, DummyScheduler)]
        if models or optimizers:
            engine, wrapper, owned = self._prepare_engine(models, optimizers, dummy_scheds)
            for i, _ in models:
                out[i] = engine
            for i, _ in optimizers:
                out[i] = wrapper
            for i, _ in dummy_scheds:
                out[i] = owned
        elif dummy_scheds:
            raise ValueError(
                "accelerate.utils.DummyScheduler must be passed to prepare() together with the "
                "model and its DummyOptim"
            )
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                out[i] = self.prepare_scheduler(obj)
        containers = (self._dataloaders, self._models, self._optimizers, self._schedulers)
        for obj in out:
            if any(obj in c for c in containers):
                obj._is_accelerate_prepared = True
        return tuple(out) if len(out) > 1 else out[0]

    def _prepare_engine(
        self,
        models: list[tuple[int, Any]],
        optimizers: list[tuple[int, Any]],
        dummy_scheds: list[tuple[int, Any]],
    ) -> tuple[ZeroEngine, ZeroOptimizerWrapper, EngineSchedulerWrapper | None]:
        if self._driver is not None:
            raise ValueError(
                "this ZeroAccelerator already prepared a model; like Accelerate's DeepSpeed "
                "integration it trains one model (create another ZeroAccelerator for another)"
            )
        if len(models) != 1 or len(optimizers) != 1:
            raise ValueError(
                "ZeroAccelerator.prepare needs the model and its optimizer in the same call, one "
                f"of each (got {len(models)} model(s), {len(optimizers)} optimizer(s)): the "
                "engine rebuilds the optimizer over this rank's shards"
            )
        model, user_optimizer = models[0][1], optimizers[0][1]
        cfg = self._zero_config_source
        engine_sched = self._engine_scheduler(cfg, dummy_scheds)
        resolved = resolve(cfg, self._facts(model, user_optimizer, dummy_scheds))
        optimizer = torch_optimizer(resolved, user_optimizer)
        if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model.to(self.device)  # a meta model is materialised by the engine, unit by unit
        engine = ZeroEngine(model, optimizer, resolved, lr_scheduler=engine_sched)
        if engine.timers is not None:  # wall_clock_breakdown: also to the trackers, once started
            engine.timers.add_sink(self._log_timings)
        self._adopt_accumulation_steps(engine.gradient_accumulation_steps)
        self._driver = EngineDriver(engine)
        wrapper = ZeroOptimizerWrapper(engine.optimizer, self._driver)
        self._optimizer_wrapper = wrapper
        self._user_optimizer = weakref.ref(user_optimizer)
        self._models.append(engine)
        self._optimizers.append(wrapper)
        owned = None
        if engine.lr_scheduler is not None:  # saved with the engine's checkpoint, not here
            owned = EngineSchedulerWrapper(engine.lr_scheduler, wrapper)
        return engine, wrapper, owned

    def _log_timings(self, report: dict[str, float], step: int) -> None:
        if self.trackers:  # init_trackers() was called; log() writes on the main process only
            self.log({f"wall_clock/{k}": float(v) for k, v in report.items()}, step=step)

    def _engine_scheduler(self, cfg: ZeroConfig, dummy_scheds: list[tuple[int, Any]]) -> Any:
        """The scheduler the engine builds and steps: None when the config's ``scheduler``
        section names it (the engine builds it; a DummyScheduler only supplies its "auto"
        step counts), else a DummyScheduler's ``lr_scheduler_callable``."""
        if len(dummy_scheds) > 1:
            raise ValueError("prepare() accepts one DummyScheduler")
        callable_ = dummy_scheds[0][1].lr_scheduler_callable if dummy_scheds else None
        if cfg.scheduler is not None:
            if callable_ is not None:
                raise ValueError(
                    f"the ZeRO config's scheduler section ({cfg.scheduler.type}) and "
                    "DummyScheduler(lr_scheduler_callable=...) both define the lr schedule; "
                    "keep one of them"
                )
            return None
        if dummy_scheds and callable_ is None:
            raise ValueError(
                "DummyScheduler without lr_scheduler_callable needs a 'scheduler' section in "
                "the ZeRO config (e.g. WarmupLR); add one or pass lr_scheduler_callable"
            )
        return callable_

    def _facts(
        self, model: nn.Module, optimizer: Any, dummy_scheds: list[tuple[int, Any]]
    ) -> AcceleratorFacts:
        hidden = None
        model_config = getattr(model, "config", None)
        if model_config is not None:
            hidden = getattr(model_config, "hidden_size", None)
            sizes = getattr(model_config, "hidden_sizes", None)
            if hidden is None and sizes:
                hidden = max(sizes)
        sizes = [s for s in self._loader_batch_sizes if s is not None]
        dummy = optimizer if isinstance(optimizer, DummyOptim) else None
        sched = dummy_scheds[0][1] if dummy_scheds else None
        return AcceleratorFacts(
            world_size=self.num_processes,
            mixed_precision=str(self.state.mixed_precision),
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            # Accelerate's default (is_train_batch_min) with a train and an eval loader
            micro_batch_size=min(sizes) if sizes else None,
            gradient_clipping=self.zero_plugin.gradient_clipping,
            hidden_size=hidden,
            optimizer_lr=dummy.lr if dummy else None,
            optimizer_weight_decay=dummy.weight_decay if dummy else None,
            base_lr=None if dummy else float(optimizer.param_groups[0]["lr"]),
            warmup_num_steps=getattr(sched, "warmup_num_steps", None),
            total_num_steps=getattr(sched, "total_num_steps", None),
        )

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Wrap ``scheduler`` as Accelerate does (stepped at optimizer steps, ``num_processes``
        times each unless ``split_batches``), after moving it onto the engine's optimizer."""
        if _prepared(scheduler):
            return scheduler
        if self._pipeline is not None:
            self._pipeline.refuse("prepare_scheduler")
        wrapper = self._optimizer_wrapper
        if wrapper is None:
            raise ValueError(
                "prepare the model and optimizer before (or together with) the lr scheduler"
            )
        engine = self.zero_engine
        if engine is not None and engine.config.scheduler is not None:
            raise ValueError(
                f"the ZeRO config's scheduler section ({engine.config.scheduler.type}) already "
                "schedules the learning rate (the engine steps it); remove the section or do "
                "not prepare another lr scheduler"
            )
        bound = getattr(scheduler, "optimizer", None)
        user_opt = self._user_optimizer() if self._user_optimizer is not None else None
        if bound is user_opt and bound is not None:
            scheduler.optimizer = wrapper.optimizer
            track_optimizer_step(wrapper.optimizer)
        elif bound is not wrapper and bound is not wrapper.optimizer:
            raise ValueError(
                "the lr scheduler is built on an optimizer this ZeroAccelerator did not prepare; "
                "build it on the optimizer passed to (or returned by) prepare()"
            )
        out = AcceleratedScheduler(
            scheduler,
            wrapper,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self._schedulers.append(out)
        return out

    def prepare_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        raise ValueError(
            "ZeroAccelerator builds the engine from the model and its optimizer together: call "
            "accelerator.prepare(model, optimizer, ...)"
        )

    def prepare_optimizer(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, ZeroOptimizerWrapper):
            return optimizer
        raise ValueError(
            "ZeroAccelerator builds the engine from the model and its optimizer together: call "
            "accelerator.prepare(model, optimizer, ...)"
        )

    # -- the loop ------------------------------------------------------------------------------

    @property
    def zero_engine(self) -> ZeroEngine | None:
        """The engine ``prepare`` built (``None`` before)."""
        return self._driver.engine if self._driver is not None else None

    @property
    def zero_config(self) -> ZeroConfig:
        """The engine's resolved config after ``prepare``; before it, the loaded config."""
        engine = self.zero_engine
        if self._pipeline is not None and self._pipeline.engine is not None:
            return self._pipeline.engine.config
        return engine.config if engine is not None else self._zero_config_source

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward``: the loss is divided by ``gradient_accumulation_steps`` and
        gradients are reduced into the shards while backward runs."""
        if self._pipeline is not None:
            self._pipeline.refuse("backward")
        if self._driver is None:
            return super().backward(loss, **kwargs)
        unknown = sorted(set(kwargs) - {"retain_graph"})
        if unknown:
            raise TypeError(f"ZeroAccelerator.backward does not support {', '.join(unknown)}")
        self._driver.backward(
            loss,
            boundary=self.sync_gradients,
            accumulation_steps=self.gradient_accumulation_steps,
            retain_graph=bool(kwargs.get("retain_graph", False)),
        )

    @contextlib.contextmanager
    def accumulate(self, *models: Any) -> Iterator[None]:
        if self._pipeline is not None:
            self._pipeline.refuse("accumulate")
        with super().accumulate(*models):
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if self._pipeline is not None:
            self._pipeline.refuse("no_sync")
        engine = self._engine_of(model)
        if engine is None:
            with super().no_sync(model):
                yield
            return
        # Stages 2/3 reduce every backward into the gradient shards: skipping that would hold
        # full-size unreduced gradients, as Accelerate's DeepSpeed integration also avoids.
        with engine.no_sync() if engine.stage < 2 else contextlib.nullcontext():
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """The global L2 norm of all the model's gradients (every shard), which are clipped to
        ``max_norm`` exactly as ``torch.nn.utils.clip_grad_norm_`` would clip the full
        gradients. Call it at an accumulation boundary, after ``backward``, before
        ``optimizer.step()`` (which then applies the clipped gradients)."""
        if self._pipeline is not None:
            self._pipeline.refuse("clip_grad_norm_")
        if self._driver is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(
                f"clip_grad_norm_(norm_type={norm_type}): ZeRO clips by the L2 norm only"
            )
        if not float(max_norm) > 0:
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): must be > 0")
        self._check_all_parameters(parameters)
        if not self._driver.step_pending:
            where = (
                "before accelerator.backward(loss) or after optimizer.step()"
                if self.sync_gradients
                else "at a micro-step that is not an accumulation boundary "
                "(accelerator.sync_gradients is False)"
            )
            raise RuntimeError(
                f"clip_grad_norm_ was called {where}; ZeRO clips the reduced, accumulated "
                "gradients of an optimizer step: call it under `if accelerator.sync_gradients:` "
                "between backward and optimizer.step()"
            )
        norm = self._driver.clip_grad_norm(float(max_norm))
        return torch.tensor(norm, device=self.device)

    def _check_all_parameters(self, parameters: Iterable[torch.Tensor]) -> None:
        assert self._driver is not None
        module = self._driver.engine.module
        known = {id(p) for p in module.parameters()}
        wanted = {id(p) for p in module.parameters() if p.requires_grad}
        given = {id(p) for p in parameters}
        if not given <= known or not wanted <= given:
            raise ValueError(
                "clip_grad_norm_ clips the global norm of all the model's gradients at once; "
                "pass model.parameters() of the prepared model (a subset, or parameters of "
                "another model, cannot be clipped separately under ZeRO)"
            )

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self._pipeline is not None:
            self._pipeline.refuse("clip_grad_value_")
        if self._driver is None:
            return super().clip_grad_value_(parameters, clip_value)
        raise RuntimeError(
            "clip_grad_value_ is not supported by ZeroAccelerator (gradients are sharded and "
            "clipped inside the engine's step); use clip_grad_norm_"
        )

    # -- weights and checkpoints --------------------------------------------------------------

    def _engine_of(self, model: Any) -> ZeroEngine | None:
        engine = self.zero_engine
        if engine is not None and (model is engine or model is engine.module):
            return engine
        return None

    def unwrap_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """The user's model inside the engine. Under ZeRO-3 its sharded parameters are empty
        outside forward: read weights with :meth:`get_state_dict`."""
        engine = self._engine_of(model)
        if engine is not None:
            return engine.module
        if self._pipeline is not None and self._pipeline.owns(model):
            return self._pipeline.model.module  # type: ignore[union-attr]  # this rank's stage
        return super().unwrap_model(model, *args, **kwargs)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights on every rank, keyed like ``model.state_dict()``
        (``unwrap=False``: prefixed ``module.`` like the engine's own keys). Collective under
        ZeRO-3: call it on every rank."""
        if self._pipeline is not None and self._pipeline.owns(model):
            return self._pipeline.state_dict(unwrap)  # every stage's layers
        engine = self._engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap)
        state = engine.full_state_dict()
        return state if unwrap else {f"module.{k}": v for k, v in state.items()}

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Save the training state: the engine's sharded checkpoint (every rank writes its own
        shard, under ``<output_dir>/zero_checkpoint``), plus Accelerate's schedulers,
        samplers, RNG states and registered objects. Collective."""
        if self._pipeline is not None and self._pipeline.model is not None:
            return self._pipeline.save_state(output_dir, safe_serialization, kwargs)
        if self._driver is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        if kwargs:
            raise TypeError(f"ZeroAccelerator.save_state does not support {', '.join(kwargs)}")
        return _state.save_state(self, self._driver.engine, output_dir, safe_serialization)

    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict | None = None,
        *,
        trust_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        """Restore what :meth:`save_state` wrote, at any world size or ZeRO stage. Collective.

        Only tensors and plain data are unpickled, from the engine's checkpoint and from the
        objects registered with ``register_for_checkpointing``, unless
        ``trust_checkpoint=True`` (for a checkpoint from a source you trust that holds other
        objects)."""
        if self._pipeline is not None and self._pipeline.model is not None:
            return self._pipeline.load_state(
                input_dir, {**(load_kwargs or {}), **kwargs}, trust_checkpoint
            )
        if self._driver is None:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        if kwargs or load_kwargs:
            raise TypeError("ZeroAccelerator.load_state takes no load_kwargs or model kwargs")
        self._driver.step_pending = False
        _state.load_state(self, self._driver.engine, input_dir, trust_checkpoint)

    def free_memory(self, *objects: Any) -> Any:
        if self._pipeline is not None:
            self._pipeline.free()
        if self._driver is not None:
            self._driver.engine.destroy()
        self._driver = None
        self._optimizer_wrapper = None
        self._user_optimizer = None
        self._loader_batch_sizes = []
        return super().free_memory(*objects)


def _refuse_other_engines(kwargs: dict[str, Any]) -> None:
    for name, what in _OTHER_ENGINES.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"ZeroAccelerator does not combine with {what} ({name}=...)")
    for var, what in _OTHER_ENGINE_ENV.items():
        if os.environ.get(var, "false").lower() == "true":
            raise ValueError(
                f"{var}=true: the accelerate config selects {what}, which ZeroAccelerator "
                "replaces; launch with a plain multi-GPU/CPU accelerate config (see "
                "configs/accelerate/) and put the ZeRO settings in DS_STRATEGY_CONFIG"
            )


def _prepared(obj: Any) -> bool:
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def _is_model(obj: Any) -> bool:
    return isinstance(obj, nn.Module) and not isinstance(obj, ZeroEngine)


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.Optimizer, DummyOptim)) and not isinstance(
        obj, ZeroOptimizerWrapper
    )
