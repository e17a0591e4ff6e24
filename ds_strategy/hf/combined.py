"""``zero(TrainerClass)``: any ``transformers.Trainer`` subclass (TRL's ``SFTTrainer``,
``DPOTrainer``, ``GRPOTrainer``, one of the user's own) training through the ZeRO engine, with
no class for the user to write.

[Note: the order of the bases]
The class is ``(ZeroTrainer, TrainerClass)``: ``ZeroTrainer`` takes ``config=`` and hands every
other argument to ``TrainerClass.__init__``, which builds its models and datasets as it always
does and then runs ``Trainer``'s setup, where ``ZeroTrainer`` builds the accelerator. A model
given by name is built by ``ZeroTrainer`` on the meta device first and read into the shards
when the engine is built (``pretrained.py``); so is the reference model a trainer taking
``ref_model`` (DPO) would otherwise load whole from that name (see ``_pretrained_model``). ``ZeroTrainer`` changes the accelerator,
the optimizer, the scheduler, ``save_model`` and the checkpoint contents; TRL 1.16's trainers
override none of these except ``GRPOTrainer._load_optimizer_and_scheduler``, whose own extra
state (adaptive entropy) is not restored on resume here.

[Note: models the trainer does not train]
TRL prepares a reference or teacher model with ``accelerator.prepare_model(...,
evaluation_mode=True)``. At ZeRO stage 3 that model is sharded for evaluation (each rank holds
1/N of it, gathered one block at a time in its forward), as TRL does with DeepSpeed; at stages
0-2 it stays whole on every rank, as with DeepSpeed. The Trainer's own model, evaluated before
training, stays whole until ``train()`` builds its engine.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import Trainer

from .trainer import ZeroTrainer

__all__ = ["zero"]


def zero(trainer_class: type[Trainer]) -> type[ZeroTrainer]:
    """``trainer_class``, training through the ZeRO engine.

    The result subclasses both it and :class:`~ds_strategy.hf.ZeroTrainer`, made once per
    class. It takes ``trainer_class``'s arguments, plus ``config=`` as ``ZeroTrainer`` does.
    That is a preset's name, a dict, or a ``.json``/``.yaml`` path. ``None`` reads
    ``DS_STRATEGY_CONFIG`` and the other ``DS_STRATEGY_*`` variables.

    Args:
        trainer_class: ``transformers.Trainer`` or a subclass of it. A ``ZeroTrainer``
            subclass is returned as it is.

    Returns:
        The combined class, named ``Zero<trainer_class.__name__>``.

    Start the script with ``torchrun`` or ``accelerate launch``::

        from trl import SFTConfig, SFTTrainer
        from ds_strategy.hf import zero

        trainer = zero(SFTTrainer)(model="path/or/hub-id", args=SFTConfig(...),
                                   train_dataset=ds, config="zero3")
        trainer.train()
        trainer.save_model("out")  # consolidated, loads with from_pretrained
    """
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, Trainer):
        raise TypeError(
            f"zero() takes transformers.Trainer or a subclass of it (such as trl.SFTTrainer), "
            f"got {trainer_class!r}"
        )
    if issubclass(trainer_class, ZeroTrainer):
        return trainer_class
    cls: type = trainer_class  # (mypy reads Trainer's class as unhashable: it is hashable)
    return _combined(cls)


@functools.cache
def _combined(trainer_class: type[Trainer]) -> type[ZeroTrainer]:
    if trainer_class is Trainer:
        return ZeroTrainer
    name = f"Zero{trainer_class.__name__}"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"``{trainer_class.__qualname__}`` through the ZeRO engine (see ``zero``).",
        "create_accelerator_and_postprocess": _create_accelerator_and_postprocess,
    }
    return type(name, (ZeroTrainer, trainer_class), namespace)


def _create_accelerator_and_postprocess(self: Any) -> None:
    ZeroTrainer.create_accelerator_and_postprocess(self)
    stage = self._loaded_config.layout.stage
    if stage == 3 and getattr(self.args, "sync_ref_model", False):
        raise ValueError(
            f"{type(self).__name__}: sync_ref_model=True at ZeRO stage 3: TRL's callback copies "
            "the policy's weights into the reference model's parameters, which are sharded "
            "here (empty outside forward); set sync_ref_model=False, or use stage 0-2, where "
            "both models are whole on each rank"
        )
