"""What a :class:`~ds_strategy.accelerate.ZeroAccelerator` does alike with a ZeRO engine and a
pipeline: the facts its config's ``"auto"`` values take, the optimizer to shard, the objects
it hands Accelerate, the checkpoint. ``_engine.py`` and ``_pipeline.py`` hold the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ..config import ZeroConfig
from ..config._auto import LoopFacts
from ..core import ZeroEngine
from ..core.optimizers import build_optimizer
from ..core.training import TrainingEngine
from . import _state
from ._driver import EngineSchedulerWrapper
from .plugin import ZeroPlugin

__all__ = ["Front"]


class Front:
    """The accelerator's side of one kind of engine (a ZeRO engine or a pipeline): the
    accelerator's methods call it instead of asking which. ``trained`` is the engine once
    ``prepare`` built it."""

    trained: TrainingEngine | None = None

    def __init__(self, acc: Accelerator, cfg: ZeroConfig, plugin: ZeroPlugin) -> None:
        self.acc = acc
        self.cfg = cfg
        self.plugin = plugin
        self.adopt_steps: Callable[[int], None] = lambda steps: None  # set by the accelerator

    @property
    def config(self) -> ZeroConfig:
        return self.trained.config if self.trained is not None else self.cfg

    @property
    def zero_engine(self) -> ZeroEngine | None:
        """The ZeRO engine (None before ``prepare``, and for a pipeline)."""
        return None

    def owns(self, model: Any) -> bool:
        return self.trained is not None and (model is self.trained or model is self.trained.module)

    model_kind = "the model"  # what prepare() takes as the model, for its errors

    def prepare(self, args: tuple[Any, ...]) -> list[Any]:
        """Loaders, then the model with its optimizer (and a scheduler the engine builds), then
        the loop's own schedulers; anything else passes through."""
        out = [self.prepare_loader(o) if isinstance(o, DataLoader) else o for o in args]
        models = [i for i, o in enumerate(args) if not prepared(o) and self.is_model(o)]
        opts = [i for i, o in enumerate(args) if not prepared(o) and is_optimizer(o)]
        scheds = [i for i, o in enumerate(args) if self.engine_scheduler(o)]
        if models or opts:
            if self.trained is not None:
                raise ValueError(
                    "this ZeroAccelerator already prepared a model; like Accelerate's DeepSpeed "
                    "integration it trains one model (create another ZeroAccelerator for another)"
                )
            if len(models) != 1 or len(opts) != 1 or len(scheds) > 1:
                raise ValueError(
                    f"ZeroAccelerator.prepare needs {self.model_kind} and its optimizer in the "
                    f"same call, one of each, and at most one scheduler for the engine (got "
                    f"{len(models)} model(s), {len(opts)} optimizer(s), {len(scheds)}): the "
                    "engine rebuilds the optimizer over this rank's shards"
                )
            sched = args[scheds[0]] if scheds else None
            model, wrapper, owned = self.build(args[models[0]], args[opts[0]], sched)
            out[models[0]], out[opts[0]] = model, wrapper
            for i in scheds:
                out[i] = owned
        elif scheds:
            self.scheduler_alone()
        for i, obj in enumerate(args):
            if isinstance(obj, LRScheduler) and i not in scheds:
                out[i] = self.prepare_scheduler(obj)
        return out

    def facts(
        self, optimizer: Any, world_size: int, micro_batch: int | None, **more: Any
    ) -> LoopFacts:
        """What the accelerator knows for the config's ``"auto"`` values."""
        dummy = optimizer if isinstance(optimizer, DummyOptim) else None
        return LoopFacts(
            world_size=world_size,
            gradient_accumulation_steps=self.acc.gradient_accumulation_steps,
            micro_batch_size=micro_batch,
            gradient_clipping=self.plugin.gradient_clipping,
            optimizer_lr=dummy.lr if dummy else None,
            optimizer_weight_decay=dummy.weight_decay if dummy else None,
            **more,
        )

    def register(
        self, model: nn.Module, wrapper: Any, scheduler: Any
    ) -> EngineSchedulerWrapper | None:
        """Hand Accelerate the prepared model and optimizer; wrap a scheduler the engine owns
        (saved with the engine's checkpoint, stepped by the engine)."""
        self.acc._models.append(model)
        self.acc._optimizers.append(wrapper)
        return None if scheduler is None else EngineSchedulerWrapper(scheduler, wrapper)

    def state_dict(self, unwrap: bool) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights on every rank (collective), keyed like the user's
        ``model.state_dict()`` (``unwrap=False``: prefixed ``module.``)."""
        assert self.trained is not None
        state = self.trained.full_state_dict()
        return state if unwrap else {f"module.{k}": v for k, v in state.items()}

    def save_state(self, output_dir: str | None, safe_serialization: bool) -> str:
        assert self.trained is not None
        return _state.save_state(self.acc, self.trained, output_dir, safe_serialization)

    def load_state(self, input_dir: str | None, trust_checkpoint: bool) -> None:
        assert self.trained is not None
        _state.load_state(self.acc, self.trained, input_dir, trust_checkpoint)

    def free(self) -> None:
        if self.trained is not None:
            self.trained.destroy()
        self.trained = None


def torch_optimizer(cfg: ZeroConfig, optimizer: Any) -> Any:
    """The optimizer to shard: built from the config's section for a ``DummyOptim`` ("auto"
    lr / weight decay filled from it), else the user's own, which must not meet a section."""
    if isinstance(optimizer, DummyOptim):
        if cfg.optimizer is None:
            raise ValueError(
                "optimizer: accelerate.utils.DummyOptim needs an 'optimizer' section in the ZeRO "
                "config; add one or pass a torch.optim optimizer to prepare()"
            )
        return build_optimizer(cfg.optimizer, optimizer.params)
    if cfg.optimizer is not None:
        raise ValueError(
            f"the ZeRO config has an 'optimizer' section ({cfg.optimizer.type}) and a "
            f"{type(optimizer).__name__} was passed to prepare(); remove the section or pass "
            "accelerate.utils.DummyOptim(model.parameters()) to use it"
        )
    return optimizer


def scheduler_of(sched: Any) -> Any:
    """What the engine builds its scheduler from: a DummyScheduler's callable, or the
    scheduler itself."""
    return sched.lr_scheduler_callable if isinstance(sched, DummyScheduler) else sched


def is_optimizer(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.Optimizer, DummyOptim))


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (LRScheduler, DummyScheduler))


def prepared(obj: Any) -> bool:
    return bool(getattr(obj, "_is_accelerate_prepared", False))
