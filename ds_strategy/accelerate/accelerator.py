"""``ZeroAccelerator``: ``accelerate.Accelerator`` with ZeRO sharding. Accelerate has no
registry for third-party engines, so this subclass overrides the methods where a DDP-wrapped
model and a sharded engine differ and leaves the rest to Accelerate."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, TorchDynamoPlugin
from torch import nn

from ..config import ZeroConfig
from ..config.loop import apply_compile, apply_mixed_precision
from ..config.parallelism import apply_parallelism_config
from ..core import ZeroEngine
from ..core.materialize import has_meta
from ..core.warnings import FrontEndWarning, renamed_argument
from ..frontends.engines import move_real_tensors
from ..frontends.peft import adapt_peft_model
from ._engine import EngineFront
from ._pipeline import PipelineFront
from ._private import mark_prepared, prepared_objects
from .plugin import ZeroPlugin

__all__ = ["ZeroAccelerator"]

_OTHER_ENGINES = {
    "deepspeed_plugin": "DeepSpeed",
    "deepspeed_plugins": "DeepSpeed",
    "fsdp_plugin": "FSDP",
    "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": "tensor parallelism",
}
_OTHER_ENGINE_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}
_PARALLELISM_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"
_SUPPORTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class ZeroAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that shards with ZeRO instead of DDP.

    Its ``prepare`` wraps the model and optimizer in a ZeRO-sharded
    :class:`~ds_strategy.ZeroEngine` (stage 0-3). A loop written for ``Accelerator`` runs
    unchanged, with consolidated weights and sharded checkpoints.

    Args:
        config: the ZeRO config: a :class:`ZeroPlugin`, or what it takes. That is a preset's
            name, a dict, a ``.json``/``.yaml`` path, or a :class:`~ds_strategy.ZeroConfig`.
            ``None``: read from the environment (``DS_STRATEGY_CONFIG``).
        zero_plugin: the old name of ``config``; deprecated.
        **kwargs: ``accelerate.Accelerator``'s. ``mixed_precision`` maps onto the config's
            ``fp16``/``bf16``. ``parallelism_config`` (or the accelerate config file's) maps
            its ``sp_size``, ``cp_size`` and ``tp_size`` onto the config's sizes. Accelerate's ``torch.compile`` settings map onto its
            ``compile`` section: ``dynamo_backend``, ``dynamo_plugin``, the accelerate config
            file's dynamo section. The engine then compiles the model block by block. Other
            engines' plugins are refused.

    Swap the class in a plain Accelerate loop and launch it with a standard accelerate config::

        DS_STRATEGY_CONFIG=zero3 \\
            accelerate launch --config_file configs/accelerate/cpu_2proc.yaml train.py

    Several models go through ``prepare`` together or one by one: a GAN, or RLHF's actor,
    critic and frozen reference. Each gets an engine; frozen ones are sharded for evaluation.

    With a ``pipeline`` section, ``prepare`` takes an ``nn.Sequential`` and the loop is
    ``loss = model.train_batch(x, y)`` (see ``ds_strategy.accelerate._pipeline``).
    """

    def __init__(self, *, config: Any = None, zero_plugin: Any = None, **kwargs: Any) -> None:
        _refuse_other_engines(kwargs)
        config = renamed_argument("ZeroAccelerator", "zero_plugin", "config", zero_plugin, config)
        self.zero_plugin = config if isinstance(config, ZeroPlugin) else ZeroPlugin(config=config)
        loaded = self.zero_plugin.load()
        # sequence, context and tensor sizes: the engine's rank layout, not Accelerate's mesh
        parallelism = kwargs.pop("parallelism_config", None) or _parallelism_config_from_env()
        if parallelism is not None:
            loaded = apply_parallelism_config(loaded, parallelism)
        if self._launched_on_cpu(kwargs):
            kwargs["cpu"] = True
        # this accelerator's own torch.compile request: Accelerate keeps the process's first
        # state's (its dynamo plugin is set once), which a later accelerator must not inherit
        dynamo = kwargs.get("dynamo_plugin")
        if dynamo is None and kwargs.get("dynamo_backend") is not None:
            dynamo = TorchDynamoPlugin(backend=kwargs["dynamo_backend"])
        with _without_parallelism_env():
            super().__init__(**kwargs)
        if self.distributed_type not in _SUPPORTED_TYPES:
            raise ValueError(
                f"ZeroAccelerator runs on CPU (gloo) and CUDA (NCCL) processes; this launch is "
                f"{self.distributed_type}. Use an accelerate config with distributed_type "
                "MULTI_GPU (see configs/accelerate/)"
            )
        # now, so that a precision conflict fails before any model is built
        cfg = apply_mixed_precision(loaded, str(self.state.mixed_precision))
        dynamo = dynamo if dynamo is not None else self.state.dynamo_plugin
        cfg = apply_compile(cfg, dynamo.backend.value, dynamo.to_kwargs())
        self.scaler = None  # the engine owns precision (casting, loss scaling), not torch.amp
        self.native_amp = False
        front = PipelineFront if cfg.layout.stages > 1 else EngineFront
        self._front: EngineFront | PipelineFront = front(self, cfg, self.zero_plugin)
        self._loader_mesh: Any = None  # see _prepare_device_mesh
        self._front.adopt_steps = self._adopt_accumulation_steps
        self._adopt_accumulation_steps(cfg.gradient_accumulation_steps)

    @staticmethod
    def _launched_on_cpu(kwargs: dict[str, Any]) -> bool:
        """Several processes but no GPU: run on CPU with gloo (a MULTI_GPU config starts them
        with torchrun; without GPUs a plain Accelerator would fall back to one process each)."""
        if kwargs.get("cpu") or PartialState._shared_state:
            return False
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "LOCAL_RANK" not in os.environ:
            return False
        probe = getattr(torch, "accelerator", None)
        if probe is not None and hasattr(probe, "is_available"):
            return not probe.is_available()
        return not torch.cuda.is_available()

    def _adopt_accumulation_steps(self, steps: Any) -> None:
        """The config's steps, when it gives a number, win over the Accelerator's."""
        current = self.gradient_state.num_steps
        if not isinstance(steps, int) or steps == current:
            return
        if current != 1:
            warnings.warn(
                f"gradient_accumulation_steps: the ZeRO config says {steps}, the Accelerator "
                f"{current}; using the config's {steps}",
                FrontEndWarning,
                stacklevel=3,
            )
        self.gradient_accumulation_steps = steps

    @property
    def data_parallel_ranks(self) -> int:
        """The ranks that read different batches: ``num_processes`` over the tensor-,
        sequence- and context-parallel ranks that share each batch."""
        return self.num_processes // self._front.ranks_per_batch

    def _prepare_device_mesh(self) -> Any:
        """The mesh Accelerate's data loaders shard by: the ranks of a tensor-, sequence- and
        context-parallel group (consecutive, as the engine lays them out) read the same
        batches, named as Accelerate names replicated data-parallel and tensor dimensions."""
        tp = self._front.ranks_per_batch
        if tp == 1:
            return super()._prepare_device_mesh()
        if self._loader_mesh is None:  # the rank layout makes its groups (core/layout.py)
            from ..core.layout import RankLayout

            layout = RankLayout.over(tp=tp, dp_replicate=self.data_parallel_ranks, dp_shard=1)
            self._loader_mesh = layout.device_mesh(self.device.type, ("dp_replicate", "tp"))
        return self._loader_mesh

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Like ``Accelerator.prepare``, with an engine for each model.

        Pass each model with its optimizer. They become a :class:`~ds_strategy.ZeroEngine` and
        its rebuilt optimizer, which schedulers move onto. A frozen model without an optimizer
        becomes an engine for evaluation.

        Args:
            *args: models, optimizers, schedulers and data loaders, as Accelerate takes them.
            device_placement: not supported; leave it ``None``.

        Returns:
            The prepared objects in the order given; one object alone, unpacked.
        """
        if device_placement is not None:
            raise ValueError("prepare(device_placement=...) is not supported by ZeroAccelerator")
        out = self._front.prepare(args)
        for obj in out:  # a PEFT model counts and merges its sharded weights whole
            if isinstance(obj, ZeroEngine):
                adapt_peft_model(obj)
        containers = prepared_objects(self)
        for obj in out:
            if any(obj in c for c in containers):
                mark_prepared(obj)
        return tuple(out) if len(out) > 1 else out[0]

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self._front.prepare_scheduler(scheduler)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Prepare a model for inference only; training goes through ``prepare(model, optimizer)``.

        Accelerate prepares this way a model it will not train, such as TRL's reference model.
        At ZeRO stage 3 the model is frozen (``requires_grad_(False)``) and sharded for
        evaluation, as TRL shards it with DeepSpeed. It becomes an engine whose forward
        gathers one block at a time. Like TRL's DeepSpeed engine, it is the caller's, not the
        accelerator's. ``free_memory`` (which the Trainer calls at every ``train()``) leaves it
        working, and ``save_state`` leaves it out. ``engine.destroy()`` frees it. At stages
        0-2 the model is placed on the device, whole and unwrapped. A model already prepared
        here is returned as it is.

        Args:
            model: the model to evaluate with.
            device_placement: ``False`` leaves a whole (stage 0-2) model where it is.
            evaluation_mode: must be ``True``.

        Returns:
            The engine (stage 3, or a model on the meta device), or the model.
        """
        if not evaluation_mode:
            raise ValueError(_TOGETHER)
        if isinstance(model, ZeroEngine) or self._front.engine_of(model) is not None:
            return model
        if self._shards_for_evaluation(model) or has_meta(model):
            # (a model built on the meta device needs the engine's materialising at any stage:
            # ds_strategy.hf.from_pretrained's reference model, read from its files)
            model.requires_grad_(False)
            front: Any = self._front  # an EngineFront (see _shards_for_evaluation)
            cfg = front._resolved(model, None, None).replace(optimizer=None, scheduler=None)
            move_real_tensors(model, self.device)
            return ZeroEngine(model, None, cfg)
        if device_placement is not False:
            move_real_tensors(model, self.device)
        return model

    def _shards_for_evaluation(self, model: nn.Module) -> bool:
        """Whether ``prepare_model(model, evaluation_mode=True)`` shards ``model``: at stage 3."""
        return isinstance(self._front, EngineFront) and self._front.cfg.layout.stage == 3

    def prepare_optimizer(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self._front.owns_optimizer(optimizer):
            return optimizer
        raise ValueError(_TOGETHER)

    @property
    def zero_engine(self) -> ZeroEngine | None:
        """The engine ``prepare`` built (``None`` before, and under a pipeline config)."""
        trained = self._front.trained
        return trained if isinstance(trained, ZeroEngine) else None

    @property
    def zero_config(self) -> ZeroConfig:
        """The engine's resolved config after ``prepare``; before it, the loaded config."""
        trained = self._front.trained
        return trained.config if trained is not None else self._front.cfg

    @zero_config.setter
    def zero_config(self, cfg: ZeroConfig) -> None:
        """Replace the config before ``prepare`` (for a loop that learns its sizes late and fills
        ``"auto"`` values itself); after ``prepare`` the engine is built: an error."""
        if self._front.trained is not None:
            raise ValueError("zero_config cannot change after prepare() built the engine")
        self._front.cfg = cfg
        self._adopt_accumulation_steps(cfg.gradient_accumulation_steps)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``engine.backward``: the loss is divided by ``gradient_accumulation_steps``.

        Args:
            loss: the micro-batch's loss.
            **kwargs: passed to ``engine.backward``.
        """
        self._front.backward(loss, **kwargs)

    def accumulate(self, *models: Any) -> AbstractContextManager[None]:
        self._front.check_accumulate()
        return super().accumulate(*models)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        return self._front.no_sync(model)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Clip the model's gradients, every shard, to a global norm of ``max_norm``.

        It clips as ``torch.nn.utils.clip_grad_norm_`` clips full gradients. Call it at an
        accumulation boundary, between ``backward`` and ``optimizer.step()``.

        Args:
            parameters: the prepared model's parameters.
            max_norm: the largest norm allowed.
            norm_type: 2; ZeRO clips by L2 norm only.

        Returns:
            The global norm before clipping.
        """
        return self._front.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        self._front.clip_grad_value_(parameters, clip_value)

    def unwrap_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """The user's model; under a pipeline, this rank's stage.

        Under ZeRO-3 its parameters are empty outside forward. Read weights with
        :meth:`get_state_dict`.

        Args:
            model: the prepared model (or engine).
            *args: Accelerate's, for a model that is not an engine's.
            **kwargs: Accelerate's, for a model that is not an engine's.
        """
        engine = self._front.engine_of(model)
        if engine is None and isinstance(model, ZeroEngine):  # from prepare_model(evaluation_mode)
            engine = model
        return engine.module if engine is not None else super().unwrap_model(model, *args, **kwargs)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights on every rank, keyed like ``model.state_dict()``.

        Collective: call it on every rank.

        Args:
            model: the prepared model.
            unwrap: ``False`` prefixes every key with ``module.``.
        """
        engine = self._front.engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap)
        state = engine.full_state_dict()
        return state if unwrap else {f"module.{k}": v for k, v in state.items()}

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Save the engine's sharded checkpoint and Accelerate's state. Collective.

        The engine's checkpoint goes under ``<output_dir>/zero_checkpoint``. Accelerate's
        state is its schedulers, samplers, RNG states and registered objects.

        One commit point covers all of it. Everything is written into ``<output_dir>.tmp``;
        the save hooks are given that directory. Then comes a manifest, then renames put it in
        place. A crash at any moment leaves the previous save or this one, whole. It differs
        from Accelerate's in three ways, each to keep that promise:

        - ``output_dir`` must be new, empty, or an earlier ``save_state`` of this version
          holding only its own files. Any other directory is refused before anything is
          written, since the commit replaces the directory whole.
        - With ``automatic_checkpoint_naming`` and ``total_limit``, old checkpoints are
          removed after the new one is committed, not before. For a moment there is one more
          than ``total_limit``, never none.
        - ``<output_dir>.tmp``, ``.old`` and ``.lock`` beside it are this save's.

        Args:
            output_dir: the directory to write; ``None`` with automatic checkpoint naming.
            safe_serialization: as Accelerate's (the engine writes its own format).
            **kwargs: Accelerate's model-saving arguments: refused once an engine exists.

        Returns:
            The directory written.
        """
        if self._front.trained is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        if kwargs:
            raise TypeError(f"ZeroAccelerator.save_state does not support {', '.join(kwargs)}")
        return self._front.save_state(output_dir, safe_serialization)

    def load_state(
        self,
        input_dir: str | None = None,
        load_kwargs: dict | None = None,
        *,
        trust_checkpoint: bool = False,
        **kwargs: Any,
    ) -> None:
        """Restore what :meth:`save_state` wrote, at any world size or ZeRO stage. Collective.

        It also restores Accelerate's ``save_state`` with DeepSpeed. A pipeline needs the same
        stages. Before anything is restored, every rank checks the save's manifest. Every file
        it lists must be there with its size and CRC-32. The engines' steps must be the ones
        saved with Accelerate's files. A directory without a manifest is a save this version
        did not finish. It is refused with a :class:`~ds_strategy.CheckpointError` naming what
        is wrong. Only tensors and plain data are unpickled, unless ``trust_checkpoint=True``
        (for a trusted source). That covers the engine's checkpoint and registered objects,
        which Accelerate would unpickle in full.

        Args:
            input_dir: the directory :meth:`save_state` wrote; ``None`` with automatic
                checkpoint naming: the newest ``checkpoint_<i>``.
            load_kwargs: refused once an engine exists.
            trust_checkpoint: unpickle any object, for a checkpoint from a trusted source.
            **kwargs: refused once an engine exists.
        """
        if self._front.trained is None:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        if kwargs or load_kwargs:
            raise TypeError("ZeroAccelerator.load_state takes no load_kwargs or model kwargs")
        self._front.load_state(input_dir, trust_checkpoint)

    def free_memory(self, *objects: Any) -> Any:
        self._front.free()
        return super().free_memory(*objects)


_TOGETHER = (
    "ZeroAccelerator builds the engine from the model and its optimizer together: call "
    "accelerator.prepare(model, optimizer, ...)"
)


def _parallelism_config_from_env() -> Any:
    """The ``ParallelismConfig`` an accelerate config file asks for (``accelerate launch``
    sets ``ACCELERATE_USE_PARALLELISM_CONFIG`` and ``PARALLELISM_CONFIG_*``), or None."""
    if os.environ.get(_PARALLELISM_ENV, "false").lower() != "true":
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig()


@contextmanager
def _without_parallelism_env() -> Iterator[None]:
    """Accelerate's own ``__init__`` reads the variable and builds a device mesh of its own:
    hidden while it runs, as the sizes now live in the ZeRO config."""
    saved = os.environ.pop(_PARALLELISM_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[_PARALLELISM_ENV] = saved


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
