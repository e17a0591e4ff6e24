"""What a :class:`~ds_strategy.accelerate.ZeroAccelerator` does alike with a ZeRO engine
(``_engine.py``) and a pipeline (``_pipeline.py``): ``prepare``, the facts its config's
``"auto"`` values take, the optimizer to shard, the objects it hands Accelerate, the checkpoint.

[Note: save_state / load_state]
The engine writes its sharded checkpoint under ``<output_dir>/zero_checkpoint``; beside it, as
with DeepSpeed, Accelerate's own helpers write what else it tracks (schedulers, samplers, RNG
states, its step, objects registered for checkpointing). All of it is written into
``<output_dir>.tmp`` and committed at once, by a manifest and renames (``_commit.py``); a load
checks the manifest on every rank before it changes anything. A rank failing in its own part
(a read-only mount, a hook raising) fails every rank instead of leaving them waiting in the
next collective (``together``, see core/faults.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

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
from ..core.checkpoint.bundle import prune
from ..core.checkpoint.trust import loads
from ..core.checkpoint.validate import CheckpointError
from ..core.collectives import Comm
from ..core.faults import together
from ..core.loop import load_all, save_all
from ..core.optimizers import optimizer_to_shard
from ..core.training import TrainingEngine
from . import _commit as commit
from ._commit import ENGINE_DIR
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
    def ranks_per_batch(self) -> int:
        """Ranks that read the same batches: those splitting each layer (tensor parallelism)
        and those splitting each sequence (sequence and context parallelism)."""
        return self.cfg.layout.ranks_per_batch

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

    # Each kind of engine's front answers these (``_engine.py``, ``_pipeline.py``).

    def prepare_loader(self, loader: DataLoader) -> object:
        raise NotImplementedError

    def is_model(self, obj: object) -> bool:
        raise NotImplementedError

    def build(self, model: Any, optimizer: object, sched: object) -> tuple[object, ...]:
        """The engine of ``model`` (what this front's :meth:`is_model` accepts): what
        ``prepare`` returns for the model and the optimizer, then for the engine's scheduler."""
        raise NotImplementedError

    def scheduler_alone(self) -> NoReturn:
        raise NotImplementedError

    def prepare_scheduler(self, scheduler: LRScheduler) -> object:
        raise NotImplementedError

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
        """Collective; one commit point for everything it writes (see ``_commit.py``)."""
        acc, world = self.acc, Comm()
        root, final = commit.save_target(acc, output_dir)
        with commit.SAVE_STATE.saving(world, final, root, self) as tmp:
            with together(world):  # as with DeepSpeed: the hooks get the engine, no weights
                run_save_hooks(acc, str(tmp))
            engines = self.engines()
            save_all(engines, tmp / ENGINE_DIR)  # one commit point for several (engines.py)
            for engine in engines.values():
                engine.wait_for_checkpoint()  # checkpoint.async_save: written before the commit
            with together(world):
                self._save_accelerate_files(str(tmp), safe_serialization)
            with together(world, CheckpointError):  # every rank has written: rank 0 commits
                if world.rank == 0:
                    steps = {name: _steps(e) for name, e in engines.items()}
                    commit.SAVE_STATE.commit(tmp, final, acc.step, steps)
                    self._prune(root, final)
        acc.project_configuration.iteration += 1
        return str(final)

    def _save_accelerate_files(self, path: str, safe_serialization: bool) -> None:
        """What Accelerate's ``save_state`` writes beside the engine's checkpoint."""
        acc = self.acc
        on_each_node = acc.project_configuration.save_on_each_node
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

    def _prune(self, root: Path | None, final: Path) -> None:
        """``total_limit``: only now that ``final`` is committed (see ``_commit.py``)."""
        limit = self.acc.project_configuration.total_limit
        if root is not None and limit is not None:
            prune(commit.automatic_dirs(self.acc)[1], final, limit)

    def load_state(self, input_dir: str | None, trust_checkpoint: bool) -> None:
        """Collective (see ``ZeroAccelerator.load_state`` on ``trust_checkpoint``). Every check
        passes on every rank before anything is loaded."""
        acc, world = self.acc, Comm()
        with together(world, CheckpointError):
            path, engine_path = commit.load_target(acc, input_dir)
            # Accelerate's own save under DeepSpeed has no manifest; a directory of ours must
            manifest = commit.SAVE_STATE.check(path) if engine_path != path else None
            run_load_hooks(acc, str(path))
        load_all(self.engines(), engine_path, trust_checkpoint=trust_checkpoint)
        with together(world):
            rank, objects = acc.state.process_index, custom_objects(acc)
            schedulers, loaders = tracked(acc, "scheduler"), tracked(acc, "dataloader")
            restored = load_accelerator_state(
                str(path), [], [], schedulers, loaders, rank, None, "cpu"
            )
            if manifest is not None:
                restored["step"] = manifest["step"]
            if "step" in restored:
                acc.step = restored["step"]
            names = manifest["files"] if manifest is not None else os.listdir(path)
            saved = [f for f in names if re.fullmatch(r"custom_checkpoint_\d+\.pkl", f)]
            if len(saved) != len(objects):
                raise RuntimeError(
                    f"{path}: {len(saved)} custom checkpoint(s) saved but {len(objects)} "
                    "object(s) registered with register_for_checkpointing; register the same "
                    "objects"
                )
            for i, obj in enumerate(objects):
                f = path / f"custom_checkpoint_{i}.pkl"
                obj.load_state_dict(loads(f.read_bytes(), str(f), trust_checkpoint))

    def free(self) -> None:
        for engine in self.engines().values():
            engine.destroy()
        self.trained = self.model = None
        self.batch_sizes = []


def _steps(engine: Any) -> int:
    return int(engine.global_steps)


def torch_optimizer(cfg: ZeroConfig, optimizer: Any) -> Any:
    """The optimizer to shard: the config's for a ``DummyOptim``, else the user's own."""
    return optimizer_to_shard(cfg.optimizer, optimizer, DummyOptim, _DUMMY_OPTIM, "prepare()")
