"""The engines of one job: what a loop set up, each set-up one :class:`~ds_strategy.ZeroEngine`
or the engines of one model with several optimizers (:class:`~ds_strategy.core.several.
SeveralEngines`), with a clip request waiting for each trained engine's step
(:class:`~ds_strategy.core.loop.PendingClip`). Fabric's strategy and the Trainer's (with its
precision plugin) keep one and route backward, clipping, the step and checkpoint entries
through it; nothing here touches a framework.

A call names its engine by the model it was set up as (a compiled module: the one it compiles)
or by an optimizer; with one engine set up, a call needs to name none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from torch import Tensor, nn

from .engine import ZeroEngine
from .loop import PendingClip
from .several import SeveralEngines

__all__ = ["JobEngines"]

SetUp = TypeVar("SetUp", ZeroEngine, SeveralEngines)


class JobEngines:
    """The set-ups of one job, in order, and each trained engine's clip request::

        job = JobEngines(not_set_up="set a model up first", say_which="pass model=...")
        engine = job.add(ds_strategy.initialize(model, optimizer, config))
        job.backward(engine(x).square().mean())
        job.clip(1.0)  # at a boundary now, else at the step
        job.step(engine.optimizer)

    ``not_set_up``: the error of a call before any set-up; ``say_which``: how the loop names the
    engine a call is for, when several are set up and the call names none of them. An
    optimizer is named by identity: the engine's own, or a framework's wrapper holding it as
    ``.optimizer`` (Lightning's ``LightningOptimizer``)."""

    def __init__(
        self, not_set_up: str, say_which: str = "pass the model or optimizer set up"
    ) -> None:
        self.not_set_up = not_set_up
        self.say_which = say_which
        self.setups: list[ZeroEngine | SeveralEngines] = []
        # every engine with a clip: one set up alone (for training or evaluation), or a
        # SeveralEngines' trained ones
        self.clips: dict[ZeroEngine, PendingClip] = {}

    def add(self, setup: SetUp) -> SetUp:
        """Record what one set-up built (an engine, or :class:`SeveralEngines`); returns it."""
        self.setups.append(setup)
        if isinstance(setup, SeveralEngines):
            self.clips.update(setup.clips)
        else:
            self.clips[setup] = PendingClip()
        return setup

    @property
    def engines(self) -> list[ZeroEngine]:
        """Every engine, in set-up order (a model set up with several optimizers: one per
        optimizer, then its frozen submodules' one)."""
        found: list[ZeroEngine] = []
        for setup in self.setups:
            found += setup.engines.values() if isinstance(setup, SeveralEngines) else [setup]
        return found

    @property
    def trained(self) -> list[ZeroEngine]:
        """The engines with a clip request, in set-up order (the first is a job's engine)."""
        return list(self.clips)

    def several_of(self, module: nn.Module | None = None) -> SeveralEngines | None:
        """The engines of ``module``, set up with several optimizers (``module`` None: the
        only set-up, if it is one)."""
        module = getattr(module, "_orig_mod", module)
        for setup in self.setups:
            alone = module is None and len(self.setups) == 1
            if isinstance(setup, SeveralEngines) and (alone or module is setup.module):
                return setup
        return None

    def engine_of(self, module: nn.Module | None = None, optimizer: object = None) -> ZeroEngine:
        """The engine ``module`` is (a compiled one: the engine it compiles) or ``optimizer``
        (or a wrapper's ``.optimizer``) belongs to; the only one when one is set up."""
        engines = self.trained
        if not engines:
            raise RuntimeError(self.not_set_up)
        if len(engines) == 1:
            return engines[0]
        module = getattr(module, "_orig_mod", module)  # torch.compile(engine)
        optimizers = {id(optimizer), id(getattr(optimizer, "optimizer", optimizer))}
        for engine in engines:
            if module is engine or (optimizer is not None and id(engine.optimizer) in optimizers):
                return engine
        raise ValueError(
            f"{len(engines)} engines are set up under the ZeRO strategy, and this call names "
            f"none of them by its model or optimizer: {self.say_which}"
        )

    def backward(
        self,
        loss: Tensor,
        *args: Any,  # a framework's backward arguments, for ZeroEngine.backward
        module: nn.Module | None = None,
        optimizer: object = None,
        **kwargs: Any,
    ) -> None:
        """The backward of the engines of ``module`` (several optimizers: see
        :meth:`SeveralEngines.backward`), else of :meth:`engine_of` ``(module, optimizer)``."""
        several = self.several_of(module)
        if several is not None:
            several.backward(loss, *args, **kwargs)
        else:
            self.engine_of(module, optimizer).backward(loss, *args, **kwargs)

    def step(self, optimizer: object) -> bool:
        """``optimizer``'s engine steps, clipping as asked; whether it was a boundary."""
        engine = self.engine_of(optimizer=optimizer)
        return self.clips[engine].step(engine)

    def clip(
        self,
        max_norm: float,
        module: nn.Module | None = None,
        optimizer: object = None,
        wait: bool = False,
    ) -> float | None:
        """Clip the gradients of :meth:`engine_of` ``(module, optimizer)`` to the global norm
        ``max_norm``: at a boundary now, returning the norm before clipping, else at its step
        (``wait``: at its step even at a boundary, for a loop that clips right before it)."""
        engine = self.engine_of(module, optimizer)
        if wait:
            self.clips[engine].max_norm = float(max_norm)
            return None
        return self.clips[engine].clip(engine, max_norm)

    def named(self, state: Mapping[str, object]) -> tuple[dict[str, ZeroEngine], list[str]]:
        """The engines of the models in a checkpoint's ``state`` by name (an engine under its
        key; a model set up with several optimizers under ``key.optimizer_<i>`` and
        ``key.frozen``), and the keys of the other entries (not a model set up here or an
        optimizer of the engines named)."""
        found: dict[str, ZeroEngine] = {}
        for key, value in state.items():
            several = self.several_of(value) if isinstance(value, nn.Module) else None
            if isinstance(value, ZeroEngine):
                found[key] = value
            elif several is not None:
                found.update({f"{key}.{name}": e for name, e in several.engines.items()})
        held = {id(e) for e in found.values()} | {id(e.optimizer) for e in found.values()}
        held |= {id(s.module) for s in self.setups if isinstance(s, SeveralEngines)}
        return found, [k for k, v in state.items() if id(v) not in held]

    def destroy(self) -> None:
        """Destroy every engine set up, and forget them."""
        for setup in self.setups:
            setup.destroy()
        self.setups.clear()
        self.clips.clear()
