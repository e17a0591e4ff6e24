"""``ZeroStrategy``'s precision plugin: the flag only; the engine casts and scales."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.types import Steppable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch import Tensor
from torch.optim import LBFGS, Optimizer

from ..core.engine import ZeroEngine
from ..core.loop import PendingClip
from ..core.several import SeveralEngines
from ..frontends.lightning_base import FlagPrecision
from ..frontends.lightning_private import after_closure

__all__ = ["ZeroPrecision"]

_warnings = WarningCache()


class ZeroPrecision(FlagPrecision, Precision):
    """Forwards ``backward``/``optimizer_step``/``clip_gradients`` to the engine; built by
    :class:`~ds_strategy.lightning.ZeroStrategy` from the Trainer's ``precision``::

        trainer = Trainer(strategy="zero2", precision="32-true")
        assert trainer.strategy.precision_plugin.precision == "32-true"
    """

    several: SeveralEngines | None = None  # set by ZeroStrategy with several optimizers

    def __init__(self, precision: str = "32-true") -> None:
        super().__init__(precision)
        self.clips: dict[ZeroEngine, PendingClip] = {}  # set by ZeroStrategy: each engine's

    def _engine(self, optimizer: Any) -> ZeroEngine:
        """The engine stepping ``optimizer`` (several optimizers: its own, else the one)."""
        if self.several is not None:
            return self.several.engine_of(optimizer)
        if not self.clips:
            raise RuntimeError("ZeroPrecision drives a ZeroEngine: use it with ZeroStrategy only")
        return next(iter(self.clips))

    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: LightningModule,
        optimizer: Steppable | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if is_overridden("backward", model, LightningModule):
            _warnings.warn(
                "LightningModule.backward is overridden but ZeroStrategy ignores it: the engine "
                "runs backward (it scales the loss and reduces gradients while backward runs)"
            )
        trainer = model.trainer
        if model.automatic_optimization and trainer.accumulate_grad_batches > 1:
            # the engine divides by accumulate_grad_batches too: undo Lightning's division
            tensor = tensor * trainer.accumulate_grad_batches
        if self.several is not None:
            self.several.backward(tensor, *args, **kwargs)
        else:
            self._engine(optimizer).backward(tensor, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise ValueError(
                "ZeroStrategy cannot run LBFGS: it re-evaluates the closure inside step(), while "
                "the engine needs backward and step as separate calls"
            )
        closure_result = closure()
        engine = self._engine(optimizer)
        if engine.is_gradient_accumulation_boundary():  # once per real step, as under DDP
            if is_overridden("configure_gradient_clipping", model, LightningModule):
                _warnings.warn(
                    "configure_gradient_clipping is overridden: under ZeroStrategy a call to "
                    "self.clip_gradients(...) there clips at the next optimizer step, by norm only"
                )
            after_closure(self, model, optimizer)
        self.clips[engine].step(engine)
        return closure_result

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Remember a clip-by-norm request for the next step, where the global norm exists."""
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "clip_gradients(gradient_clip_algorithm='value') is not supported by "
                "ZeroStrategy: ZeRO clips by the global gradient norm; use "
                "gradient_clip_algorithm='norm'"
            )
        if clip_val > 0:
            self.clips[self._engine(optimizer)].max_norm = float(clip_val)
