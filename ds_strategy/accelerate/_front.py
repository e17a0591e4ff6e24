"""What a :class:`~ds_strategy.accelerate.ZeroAccelerator` does alike with a ZeRO engine
(``_engine.py``) and a pipeline (``_pipeline.py``): ``prepare``, the facts its config's
``"auto"`` values take, the optimizer to shard, the objects it hands Accelerate, the checkpoint.

[Note: save_state / load_state]
The engine writes its sharded checkpoint under ``<output_dir>/zero_checkpoint``; beside it, as
with DeepSpeed, Accelerate's own helpers write what else it tracks (schedulers, samplers, RNG
states, its step, objects registered for checkpointing). A rank failing in its own part (a
read-only mount, a hook raising) fails every rank instead of leaving them waiting in the next
collective (``together``, see core/faults.py).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.checkpointing import (
    load_accelerator_state,
    save_accelerator_state,
    save_custom_state,
)
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ..config import ZeroConfig
from ..config.loop import LoopFacts
from ..core.checkpoint.deepspeed.layout import engine_dir
from ..core.checkpoint.trust import loads
from ..core.collectives import Comm
from ..core.faults import together
from ..core.loop import load_all, save_all
from ..core.optimizers import optimizer_to_shard
from ..core.training import TrainingEngine
from ._private import (
    custom_objects,
    is_prepared,
    run_load_hooks,
    run_save_hooks,
    track,
    tracked,
)
from .plugin import ZeroPlugin

__all__ = ["ENGINE_DIR", "EngineOptimizer", "EngineSchedulerWrapper", "Front"]

ENGINE_DIR = "zero_checkpoint"
_DUMMY_OPTIM = "accelerate.utils.DummyOptim"


class EngineSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine steps: ``step()`` is a no-op, as in ``DeepSpeedSchedulerWrapper``."""

    def step(self, *args: object, **kwargs: object) -> None:
        pass


class EngineOptimizer(AcceleratedOptimizer):
    """What ``prepare`` returns for the optimizer: the engine's, over this rank's shards (so is
    its ``state_dict()``: use ``accelerator.save_state``), stepped by the engine."""

    def __init__(self, engine: TrainingEngine) -> None:
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self.skipped = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (an fp16 overflow, a non-finite gradient norm)."""
        return self.skipped


class Front:
    """The accelerator's side of one kind of engine, so its methods need not ask which.
    Once ``prepare`` built it, ``trained`` is the engine and ``model`` what it returned."""

    trained: TrainingEngine | None = None
    model_kind = "the model"  # what prepare() takes as the model, for its errors
    engine_schedulers: tuple[type, ...] = (DummyScheduler,)  # the engine builds and steps these

    def __init__(self, acc: Accelerator, cfg: ZeroConfig, plugin: ZeroPlugin) -> None:
        self.acc, self.cfg, self.plugin = acc, cfg, plugin
        self.adopt_steps: Callable[[int], None] = lambda steps: None  # set by the accelerator
        self.model: nn.Module | None = None
        self.batch_sizes: list[int] = []  # of the loaders prepared, per (data-parallel) rank

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks that split each layer (and read the same batches)."""
        return self.cfg.layout.tp

    def engine_of(self, model: Any) -> TrainingEngine | None:
        """The engine of ``model`` (what ``prepare`` returned for it, or the user's module)."""
        t = self.trained
        return t if t is not None and any(model is m for m in (self.model, t, t.module)) else None

    def owns_optimizer(self, optimizer: Any) -> bool:
        return False

    def engines(self) -> dict[str, TrainingEngine]:
        """Every prepared model's engine, named by the order ``prepare`` got them."""
        return {} if self.trained is None else {"model_0": self.trained}

    def prepare(self, args: tuple[Any, ...]) -> list[Any]:
        """Loaders, then the model with its optimizer (and a scheduler the engine builds), then
        the loop's own schedulers; anything else passes through."""
        fresh = [(i, o) for i, o in enumerate(args) if not is_prepared(o)]
        out = list(args)
        for i, o in fresh:
            out[i] = self.prepare_loader(o) if isinstance(o, DataLoader) else o
        models = [i for i, o in fresh if self.is_model(o)]
        opts = [i for i, o in fresh if isinstance(o, (torch.optim.Optimizer, DummyOptim))]
        scheds = [i for i, o in enumerate(args) if isinstance(o, self.engine_schedulers)]
        if models or opts:
            for m, o in self.pair_up(args, models, opts, scheds):
                if o is None:  # a frozen model, sharded for evaluation
                    out[m] = self.build_frozen(args[m])
                    continue
                sched = args[scheds[0]] if scheds else None
                model, wrapper, owned = self.build(args[m], args[o], sched)
                out[m], out[o] = model, wrapper
                for i in scheds:
                    out[i] = owned
        elif scheds:
            self.scheduler_alone()
        for i, obj in enumerate(args):
            if isinstance(obj, LRScheduler) and i not in scheds:
                out[i] = self.prepare_scheduler(obj)
        return out

    def pair_up(
        self, args: tuple[Any, ...], models: list[int], opts: list[int], scheds: list[int]
    ) -> list[tuple[int, int | None]]:
        """``(model index, its optimizer's index)`` for each model ``prepare`` got: here one
        model with its optimizer, once (the ZeRO engine's front allows several)."""
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
        return [(models[0], opts[0])]

    def build_frozen(self, model: nn.Module) -> nn.Module:
        raise ValueError(
            f"ZeroAccelerator.prepare needs {self.model_kind} together with its optimizer"
        )

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
        """Hand Accelerate the prepared model and optimizer; wrap a scheduler the engine owns."""
        track(self.acc, "model", model)
        track(self.acc, "optimizer", wrapper)
        return None if scheduler is None else EngineSchedulerWrapper(scheduler, wrapper)

    def save_state(self, output_dir: str | None, safe_serialization: bool) -> str:
        """Collective (see the note on save_state)."""
        acc = self.acc
        path = _save_dir(acc, output_dir)
        world = Comm()
        on_each_node = acc.project_configuration.save_on_each_node
        with together(world):
            os.makedirs(path, exist_ok=True)
            # as with DeepSpeed: the hooks get the engine, no consolidated weights
            run_save_hooks(acc, path)
        save_all(self.engines(), os.path.join(path, ENGINE_DIR))  # one commit point for several
        with together(world):
            save_accelerator_state(
                path,
                [],
                [],
                tracked(acc, "scheduler"),
                tracked(acc, "dataloader"),
                acc.state.process_index,
                acc.step,
                None,
                save_on_each_node=on_each_node,
                safe_serialization=safe_serialization,
            )
            for i, obj in enumerate(custom_objects(acc)):
                save_custom_state(obj, path, i, save_on_each_node=on_each_node)
        acc.project_configuration.iteration += 1
        return path

    def load_state(self, input_dir: str | None, trust_checkpoint: bool) -> None:
        """Collective (see ``ZeroAccelerator.load_state`` on ``trust_checkpoint``)."""
        acc = self.acc
        world = Comm()
        with together(world):
            path, engine_path = _load_dir(acc, input_dir)
            run_load_hooks(acc, path)
        load_all(self.engines(), engine_path, trust_checkpoint=trust_checkpoint)
        with together(world):
            rank, objects = acc.state.process_index, custom_objects(acc)
            schedulers, loaders = tracked(acc, "scheduler"), tracked(acc, "dataloader")
            restored = load_accelerator_state(path, [], [], schedulers, loaders, rank, None, "cpu")
            if "step" in restored:
                acc.step = restored["step"]
            saved = [f for f in os.listdir(path) if re.fullmatch(r"custom_checkpoint_\d+\.pkl", f)]
            if len(saved) != len(objects):
                raise RuntimeError(
                    f"{path}: {len(saved)} custom checkpoint(s) saved but {len(objects)} "
                    "object(s) registered with register_for_checkpointing; register the same "
                    "objects"
                )
            for i, obj in enumerate(objects):
                f = Path(path) / f"custom_checkpoint_{i}.pkl"
                obj.load_state_dict(loads(f.read_bytes(), str(f), trust_checkpoint))

    def free(self) -> None:
        for engine in self.engines().values():
            engine.destroy()
        self.trained = self.model = None
        self.batch_sizes = []


def torch_optimizer(cfg: ZeroConfig, optimizer: Any) -> Any:
    """The optimizer to shard: the config's for a ``DummyOptim``, else the user's own."""
    return optimizer_to_shard(cfg.optimizer, optimizer, DummyOptim, _DUMMY_OPTIM, "prepare()")


def _iteration(folder: str) -> int:
    found = re.findall(r"(\d+)$", os.path.basename(folder.rstrip("/")))
    return int(found[0]) if found else -1


def _automatic_dirs(acc: Accelerator) -> tuple[str, list[str]]:
    """Accelerate's ``checkpoints`` folder, and its ``checkpoint_<i>`` folders by ``i``."""
    root = os.path.join(acc.project_dir, "checkpoints")
    found = os.listdir(root) if os.path.isdir(root) else []
    return root, sorted((os.path.join(root, f) for f in found), key=_iteration)


def _save_dir(acc: Accelerator, output_dir: str | None) -> str:
    """``output_dir``, or the next ``checkpoints/checkpoint_<i>`` as Accelerate names it."""
    config = acc.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir (or automatic_checkpoint_naming)")
        return os.fspath(output_dir)
    root, existing = _automatic_dirs(acc)
    limit = config.total_limit
    if limit is not None and len(existing) + 1 > limit and acc.is_main_process:
        for folder in existing[: len(existing) + 1 - limit]:
            shutil.rmtree(folder)
    path = os.path.join(root, f"checkpoint_{acc.save_iteration}")
    if os.path.exists(path):
        raise ValueError(
            f"{path} already exists: set accelerator.project_configuration.iteration to the "
            "iteration to save next"
        )
    acc.wait_for_everyone()  # every rank checked before any rank creates it
    return path


def _load_dir(acc: Accelerator, input_dir: str | None) -> tuple[str, Path]:
    """The directory to load, and the engine's checkpoint in it: ours, or DeepSpeed's where
    Accelerate saved with DeepSpeed (its own files beside it are the same)."""
    if input_dir is not None:
        path = os.path.expanduser(os.fspath(input_dir))
    elif acc.project_configuration.automatic_checkpoint_naming:
        root, found = _automatic_dirs(acc)
        if not found:
            raise ValueError(f"no checkpoint under {root}")
        path = found[-1]
    else:
        raise ValueError("load_state needs input_dir (or automatic_checkpoint_naming)")
    engine_path = engine_dir(Path(path), ENGINE_DIR)
    if engine_path is None:
        raise FileNotFoundError(
            f"{path}: no {ENGINE_DIR}/ here, nor a DeepSpeed checkpoint (latest and its tag "
            "directory); pass a directory written by save_state (ZeroAccelerator's, or "
            "Accelerate's with DeepSpeed)"
        )
    return path, engine_path
