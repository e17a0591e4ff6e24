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

from ..core.job import JobEngines
from ..core.loop import norm_only
from ..frontends.lightning_base import FlagPrecision
from ..frontends.lightning_private import after_closure

__all__ = ["ZeroPrecision"]

_warnings = WarningCache()


class ZeroPrecision(FlagPrecision, Precision):
    """Forwards ``backward``, ``optimizer_step`` and ``clip_gradients`` to the engine.

    :class:`~ds_strategy.lightning.ZeroStrategy` builds it from the Trainer's ``precision``::

        trainer = Trainer(strategy="zero2", precision="32-true")
        assert trainer.strategy.precision_plugin.precision == "32-true"
    """

    def __init__(self, precision: str = "32-true") -> None:
        """Keep the flag, once checked.

        Args:
            precision: the Trainer's precision flag, such as ``"bf16-mixed"``.
        """
        super().__init__(precision)
        # ZeroStrategy's engines, once it sets the model up
        self.job = JobEngines("ZeroPrecision drives a ZeroEngine: use it with ZeroStrategy only")

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
        self.job.backward(tensor, *args, optimizer=optimizer, **kwargs)

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
        engine = self.job.engine_of(optimizer=optimizer)
        if engine.is_gradient_accumulation_boundary():  # once per real step, as under DDP
            if is_overridden("configure_gradient_clipping", model, LightningModule):
                _warnings.warn(
                    "configure_gradient_clipping is overridden: under ZeroStrategy a call to "
                    "self.clip_gradients(...) there clips at the next optimizer step, by norm only"
                )
            after_closure(self, model, optimizer)
        self.job.step(optimizer)
        return closure_result

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Remember a clip-by-norm request for the next step, where the global norm exists.

        Args:
            optimizer: the optimizer whose engine clips.
            clip_val: the largest norm allowed; 0 clips nothing.
            gradient_clip_algorithm: ``"norm"``; ZeRO clips by norm only.
        """
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            call = "clip_gradients(gradient_clip_algorithm='value')"
            raise ValueError(norm_only(call, "gradient_clip_algorithm='norm'"))
        if clip_val > 0:  # at the step, where the engine's configured clip may be this one
            self.job.clip(clip_val, optimizer=optimizer, wait=True)
