"""``ZeroTrainer``: Hugging Face's ``transformers.Trainer`` training through a ZeRO engine.

The Trainer runs on Accelerate; this subclass gives it a
:class:`~ds_strategy.accelerate.ZeroAccelerator` instead of a plain ``Accelerator`` and changes
only what a sharded engine needs changed: the config's ``"auto"`` values (filled from the
``TrainingArguments``, ``_args.py``), the optimizer and scheduler a config section names,
consolidated weights for ``save_model``, and the engine's own checkpoint inside each Trainer
checkpoint.

[Note: who accumulates]
The Trainer divides each micro-batch's loss by the accumulation steps itself and marks every
micro-step as an accumulation boundary or not (Accelerate's ``sync_gradients``), keeping
Accelerate's own steps at 1. The engine therefore follows ``sync_gradients`` and divides by
nothing more, and the config's ``gradient_accumulation_steps`` (which must equal the
argument) is never handed to Accelerate, where it would divide a second time.

[Note: checkpoints]
``checkpoint-<N>/`` holds what a plain Trainer writes there (consolidated ``model.safetensors``
loadable by ``from_pretrained``, trainer state, RNG states, the Trainer's lr scheduler) and,
instead of ``optimizer.pt``, the engine's sharded checkpoint under ``zero_checkpoint/``:
weights in fp32, optimizer state, a config scheduler, counters. It resumes at any world size
or ZeRO stage (``train(resume_from_checkpoint=...)``), and ``load_best_model_at_end`` loads its
weights. A ``checkpoint-<N>/`` that a Trainer wrote with DeepSpeed (``global_step<N>/`` and
``latest``) resumes too: the engine reads DeepSpeed's layout.
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils.deepspeed import DummyOptim
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from ..accelerate import ZeroAccelerator, ZeroPlugin
from ..accelerate._front import ENGINE_DIR, EngineSchedulerWrapper
from ..config import ZeroConfig
from ..core.checkpoint.deepspeed.layout import find_deepspeed
from ..core.checkpoint.deepspeed.opening import model_state
from ..core.schedulers import load_scheduler_state
from ..core.warnings import renamed_argument
from ..frontends.engines import move_schedulers
from ..frontends.peft import merged_base_state
from ._args import fill_from_training_args
from ._private import TrainerHooks, save_pretrained_state, scheduler_is_rebuilt
from .pretrained import from_pretrained

__all__ = ["ZeroTrainer"]


class _TrainerAccelerator(ZeroAccelerator):
    """A ZeroAccelerator whose accumulation the Trainer drives (see the note on who accumulates)."""

    trainer_model: Callable[[], Any] = staticmethod(lambda: None)  # set by ZeroTrainer

    def _adopt_accumulation_steps(self, steps: int) -> None:
        pass

    def _shards_for_evaluation(self, model: Any) -> bool:
        # the Trainer's own model, evaluated before train(): whole until train() builds its engine
        return model is not self.trainer_model() and super()._shards_for_evaluation(model)


class ZeroTrainer(TrainerHooks, Trainer):
    """``transformers.Trainer`` with ZeRO stages 0-3, offload and the engine's mixed precision.

    Takes every argument ``Trainer`` takes, plus:

    Args:
        config: a DeepSpeed-style config: a preset's name, a dict, a ``.json``/``.yaml``
            path, or a :class:`~ds_strategy.ZeroConfig`. ``"auto"`` values are allowed. They
            are filled from ``args`` as transformers fills them for DeepSpeed. ``None``: from
            ``DS_STRATEGY_CONFIG`` and ``DS_STRATEGY_*`` variables (see ``ZeroPlugin``).
        zero_config: the old name of ``config``; deprecated.

    Start it as any Trainer script, with ``torchrun`` or ``accelerate launch``::

        trainer = ZeroTrainer(model=model, args=TrainingArguments(...),
                              train_dataset=ds, config="ds_config.json")
        trainer.train()
        trainer.save_model("out")  # model.safetensors, loads with from_pretrained

    With an ``optimizer`` section, the engine builds that optimizer over all trainable
    parameters, as DeepSpeed does. Without one, it shards the Trainer's own (``args.optim``,
    its weight-decay groups). The engine builds and steps a ``scheduler`` section. Without
    one, the Trainer's ``lr_scheduler_type`` applies.
    """

    def __init__(
        self, *args: Any, config: Any = None, zero_config: Any = None, **kwargs: Any
    ) -> None:
        config = renamed_argument("ZeroTrainer", "zero_config", "config", zero_config, config)
        args, kwargs = _pretrained_model(type(self), args, kwargs)
        self.zero_plugin = ZeroPlugin(config=config)
        self._max_steps: int | None = None
        self.accelerator_args: dict[str, Any] = {}  # what the Trainer builds its Accelerator from
        super().__init__(*args, **kwargs)

    # -- the accelerator ------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        _refuse_other_engines(self.args)
        super().create_accelerator_and_postprocess()  # the Trainer's own arguments for it
        settings = dict(self.accelerator_args)
        settings.pop("kwargs_handlers", None)  # DistributedDataParallel's: there is no DDP here
        self.accelerator = _TrainerAccelerator(config=self.zero_plugin, **settings)
        owner = weakref.ref(self)
        self.accelerator.trainer_model = lambda: getattr(owner(), "model", None)
        self._loaded_config: ZeroConfig = self.accelerator.zero_config
        gather = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(gather).parameters:
            gather = functools.partial(gather, use_gather_object=self.args.eval_use_gather_object)
        self.gather_function = gather
        if self._loaded_config.layout.stage == 3 and self.args.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size is not supported with ZeRO stage 3 (as with DeepSpeed); "
                "set per_device_train_batch_size or use stage 2"
            )

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples an optimizer step takes: micro-batch x accumulation x data-parallel ranks.

        Ranks that share a batch (a sequence split across them, a layer split across them)
        count once. The Trainer reads the sizes from Accelerate's own parallelism config,
        which this accelerator folds into the ZeRO config instead.

        Args:
            args: the ``TrainingArguments``.
        """
        data_ranks = self.accelerator.data_parallel_ranks
        return self._train_batch_size * args.gradient_accumulation_steps * data_ranks

    # -- optimizer and scheduler ----------------------------------------------------------

    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        values = super().set_initial_training_values(args, dataloader)
        self._max_steps = int(values[-1])  # the run's optimizer steps, for "auto" step counts
        return values

    def create_optimizer(self, model: Any = None) -> Any:
        """Fill the config's ``"auto"`` values, just before the engine is built.

        An ``optimizer`` section makes the engine build that optimizer; a ``DummyOptim`` stands
        in for it here.

        Args:
            model: as in ``Trainer.create_optimizer``.

        Returns:
            The Trainer's optimizer, or the ``DummyOptim``.
        """
        acc = self.accelerator
        if acc.zero_engine is None and self._max_steps is not None:
            acc.zero_config = fill_from_training_args(
                self._loaded_config,
                self.args,
                world_size=acc.data_parallel_ranks,
                model=self.model,
                num_training_steps=self._max_steps,
            )
        section = acc.zero_config.optimizer
        if section is None:
            return super().create_optimizer(model)
        if self.optimizer is not None and not isinstance(self.optimizer, DummyOptim):
            raise ValueError(
                f"the ZeRO config has an optimizer section ({section.type}) and Trainer was given "
                f"an optimizer ({type(self.optimizer).__name__}); keep one of them"
            )
        assert self.model is not None  # (a Trainer is given its model, or a model_init)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = DummyOptim(params, lr=self.args.learning_rate)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The engine's scheduler for a config ``scheduler``; otherwise the Trainer's.

        The engine's is wrapped so that the Trainer's ``step()`` is a no-op. The Trainer's
        moves onto the engine's optimizer.

        Args:
            num_training_steps: as in ``Trainer.create_scheduler``.
            optimizer: as in ``Trainer.create_scheduler``.

        Returns:
            The scheduler the Trainer steps.
        """
        engine = self.accelerator.zero_engine
        if engine is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None and engine.config.scheduler is not None:
            self.lr_scheduler = EngineSchedulerWrapper(engine.lr_scheduler, self.optimizer)
            scheduler_is_rebuilt(self)
            return self.lr_scheduler
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        move_schedulers(engine, [scheduler])  # also one passed as Trainer(optimizers=(o, s))
        return scheduler

    # -- saving and loading ---------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write consolidated fp32 weights with ``save_pretrained`` (safetensors), at any stage.

        A PEFT model writes its adapters. After its ``merge_and_unload``, it writes the merged
        base model, which loads with the base architecture's ``from_pretrained``. Collective
        once training has begun: call it on every rank.

        Args:
            output_dir: the directory. Default: ``args.output_dir``.
        """
        engine = self.accelerator.zero_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        assert output_dir is not None  # (TrainingArguments fills in its default)
        state = engine.full_state_dict(rank0_only=not self.args.save_on_each_node)
        merged = merged_base_state(engine.module, state)  # after PEFT's merge_and_unload
        if merged is None:
            save_pretrained_state(self, output_dir, state)
        else:  # the base model, under its own names (frontends/peft.py)
            trained, self.model = self.model, merged[0]
            try:
                save_pretrained_state(self, output_dir, merged[1])
            finally:
                self.model = trained
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def save_engine_state(self, output_dir: str) -> bool:
        """In a Trainer checkpoint, save the engine's state instead of ``optimizer.pt``.

        See the module's note on checkpoints. Collective.

        Args:
            output_dir: the Trainer checkpoint's directory.

        Returns:
            False when there is no engine yet.
        """
        engine = self.accelerator.zero_engine
        if engine is None:
            return False
        engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))  # collective
        if self.args.should_save and engine.config.scheduler is None:
            assert self.lr_scheduler is not None  # (the Trainer creates it with the optimizer)
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return True

    def load_engine_state(self, checkpoint: str | None) -> bool:
        """Resume the engine from a Trainer checkpoint. Collective.

        Args:
            checkpoint: the Trainer checkpoint's directory, or None.

        Returns:
            False when there is no engine or no checkpoint.
        """
        engine = self.accelerator.zero_engine
        if engine is None or checkpoint is None:
            return False
        deepspeed = find_deepspeed(Path(checkpoint))  # a checkpoint DeepSpeed's Trainer wrote
        engine.load_checkpoint(deepspeed or os.path.join(checkpoint, ENGINE_DIR))  # collective
        if engine.config.scheduler is not None:
            return True
        saved = os.path.join(checkpoint, SCHEDULER_NAME)
        scheduler = self.lr_scheduler  # (the Trainer creates it with the optimizer)
        if deepspeed is not None:  # there, the Trainer's scheduler is saved by DeepSpeed
            state = model_state(deepspeed).get("lr_scheduler")
            if state:
                assert scheduler is not None
                load_scheduler_state(scheduler, state)
        elif os.path.isfile(saved):
            assert scheduler is not None
            scheduler.load_state_dict(torch.load(saved, weights_only=True))
        return True

    def load_best_engine_state(self) -> bool:
        """Load the best checkpoint's engine state at the end of training; False if none."""
        engine = self.accelerator.zero_engine
        best = self.state.best_model_checkpoint
        if engine is None or best is None:
            return False
        engine.load_checkpoint(os.path.join(best, ENGINE_DIR), load_optimizer=False)
        return True


def _pretrained_model(
    cls: type, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]]:
    """``model`` given as a directory or Hub id: built on the meta device, its weights read
    into the shards when the engine is built (``pretrained.py``), as TRL's trainers take a
    model by name. A trainer taking a ``ref_model`` (TRL's DPO) that would build the reference
    from the same name itself, whole on every rank, gets it built the same way instead; not
    with a ``peft_config`` or ``precompute_ref_log_probs``, where TRL keeps no reference."""
    if args and isinstance(args[0], str | os.PathLike):
        name, args = args[0], (from_pretrained(args[0]), *args[1:])
    elif isinstance(kwargs.get("model"), str | os.PathLike):
        name, kwargs = kwargs["model"], dict(kwargs, model=from_pretrained(kwargs["model"]))
    else:
        return args, kwargs
    takes_reference = any(  # zero(DPOTrainer)'s own __init__ is ZeroTrainer's
        "ref_model" in inspect.signature(vars(c)["__init__"]).parameters
        for c in cls.__mro__
        if "__init__" in vars(c)
    )
    if takes_reference and len(args) < 2 and kwargs.get("ref_model") is None:
        settings = kwargs.get("args")
        keeps_none = kwargs.get("peft_config") is not None or bool(
            getattr(settings, "precompute_ref_log_probs", False)
        )
        if not keeps_none:
            kwargs = dict(kwargs, ref_model=from_pretrained(name))
    return args, kwargs


def _refuse_other_engines(args: Any) -> None:
    """Settings that select another engine, or that this one cannot honour, named with the fix."""
    refused = {
        "deepspeed": "selects DeepSpeed's engine; pass the same config as ZeroTrainer(config=...)",
        "fsdp": "selects FSDP; ZeRO stage 3 is the equivalent here",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ValueError(f"TrainingArguments({name}=...) {why}")
    if args.save_only_model and args.load_best_model_at_end:
        raise ValueError(
            "save_only_model=True with load_best_model_at_end=True: ZeroTrainer loads the best "
            "model from its engine checkpoint, which save_only_model leaves out (as with "
            "DeepSpeed); drop one of them"
        )
