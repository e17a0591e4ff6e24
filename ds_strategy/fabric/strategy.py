"""``ZeroStrategy`` for Lightning Fabric: ``fabric.setup``/``backward``/``clip_gradients``/
``save``/``load`` mapped onto :class:`~ds_strategy.ZeroEngine` s (one per ``fabric.setup``
call: a GAN's generator and discriminator, a frozen teacher next to a student; one per
optimizer of ``fabric.setup(model, opt_g, opt_d)``, see ``core/several.py``), with no
sharding logic; and its precision plugin, which only carries the flag to the config."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer

from ..core.engine import ZeroEngine
from ..core.loop import load_all, norm_only, save_all
from ..core.optimizers import evaluation_optimizer, move_schedulers
from ..frontends.engines import move_real_tensors
from ..frontends.lightning_base import FlagPrecision, LightningZeroBase
from ..frontends.lightning_private import (
    BackwardSyncControl,
    Sharded,
    Stateful,
    check_strict_keys,
    convert_stateful,
    joint_setup_error,
    set_backward_sync_control,
)

__all__ = ["ZeroFabricPrecision", "ZeroStrategy"]


class ZeroFabricPrecision(FlagPrecision, Precision):
    """Carries ``Fabric(precision=...)`` to the ZeRO strategy.

    The strategy maps it onto its config::

        fabric = Fabric(strategy="zero3", precision="32-true")
        assert fabric.strategy.precision.precision == "32-true"
    """

    front = "Fabric"


class _EngineSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync(model)`` is the engine's ``no_sync()``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, ZeroEngine):
            raise TypeError(
                "fabric.no_backward_sync() needs the model returned by fabric.setup() under the "
                "ZeRO strategy"
            )
        return module.no_sync()


class ZeroStrategy(LightningZeroBase, DDPStrategy, Sharded):
    """ZeRO stage 0-3 for ``lightning.Fabric``.

    It is registered as ``zero1`` ... ``zero3_offload``. A ``strategy="ddp"`` loop runs
    unchanged. ``fabric.setup`` returns the engine and its rebuilt optimizer; a scheduler moves
    onto it. ``fabric.save`` and ``fabric.load`` use a sharded directory. ``clip_gradients``
    clips by global norm at an accumulation boundary. Before one, the request waits and None is
    returned. ``zero_grad()`` is unnecessary. Example::

        fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
        fabric.backward(model(x).square().mean())
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    """

    front = "Fabric"
    precision_attr = "precision"
    not_set_up = "the ZeRO engine exists once fabric.setup(model, ...) has run"

    say_which = "say which, fabric.backward(loss, model=model) (the model fabric.setup returned)"

    def _init_front(self) -> None:
        set_backward_sync_control(self, _EngineSyncControl())

    precision_class = ZeroFabricPrecision
    precision = property(LightningZeroBase.plugin, LightningZeroBase.set_plugin)

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create modules on the meta device under stage 3, until ``fabric.setup`` builds units.

        Not with tensor parallelism, which splits real weights.

        Args:
            empty_init: ``True`` uses the meta device at any stage; ``False`` never does.
        """
        if not self._meta_init(empty_init):
            return super().module_init_context(empty_init)
        return torch.device("meta")

    def module_to_device(self, module: nn.Module) -> None:
        move_real_tensors(module, self.root_device)  # the engine materialises meta tensors

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Wrap ``module`` and its optimizer in a :class:`~ds_strategy.ZeroEngine`.

        With several optimizers, each gets an engine over the submodules holding its
        parameters. The module then comes back as it is, its submodules sharded.

        Args:
            module: the model.
            optimizers: its optimizers, built on its parameters.
            scheduler: an lr scheduler; it moves onto the engine's optimizer.

        Returns:
            The engine (or the module), the engines' optimizers, and the scheduler.
        """
        scheds = [scheduler] if scheduler is not None else []
        if len(optimizers) > 1:
            several = self._add(self._build_several(module, optimizers, scheds, None))
            return module, [e.optimizer for e in several.trained], scheduler
        engine = self._setup(module, optimizers[0])
        move_schedulers(engine, scheds)
        return engine, [engine.optimizer], scheduler

    # the engine, never DDP: the strategy takes only DDPStrategy's process handling
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        """Wrap ``module`` for evaluation (no optimizer state is kept).

        Args:
            module: the model.

        Returns:
            The engine.
        """
        return self._setup(module, evaluation_optimizer)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise ValueError(joint_setup_error(self))

    def _setup(self, module: nn.Module, optimizer: Any) -> ZeroEngine:
        return self._add(self._build_engine(module, optimizer, None))  # accumulating as configured

    @property
    def engines(self) -> list[ZeroEngine]:
        """The engines of every ``fabric.setup`` call, in order.

        A model set up with several optimizers has one per optimizer, then its frozen
        submodules' one.
        """
        return self._job.engines

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.precision.pre_backward(tensor, module)
        self._job.backward(tensor, *args, module=module, **kwargs)
        self.precision.post_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The engine's step, at accumulation boundaries, clipping as configured or asked.

        Args:
            optimizer: an optimizer ``fabric.setup`` returned.
            **kwargs: a ``closure`` is refused.
        """
        if kwargs.get("closure") is not None:
            raise ValueError("the ZeRO strategy cannot run optimizer.step(closure)")
        self._job.step(optimizer)

    def clip_gradients_norm(  # type: ignore[override]
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor | None:
        """Clip the gradients by their global L2 norm, as ``clip_grad_norm_`` does.

        Args:
            module: the model ``fabric.setup`` returned.
            optimizer: its optimizer.
            max_norm: the largest norm allowed.
            norm_type: 2; ZeRO clips by L2 norm only.
            error_if_nonfinite: ignored. An fp16 overflow's non-finite norm is returned, not
                raised.

        Returns:
            The norm before clipping; None before an accumulation boundary.
        """
        if float(norm_type) != 2.0:
            raise ValueError(norm_only(f"norm_type={norm_type}", "norm_type=2"))
        norm = self._job.clip(float(max_norm), module, optimizer)
        return None if norm is None else torch.tensor(norm)

    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        use = "fabric.clip_gradients(model, optimizer, max_norm=...)"
        raise ValueError(norm_only("fabric.clip_gradients(clip_val=...)", use))

    def _named(self, state: dict[str, Any]) -> tuple[dict[str, ZeroEngine], list[str]]:
        """The engines of the models in ``state`` by name, and the other entries' keys."""
        engines, rest = self._job.named(state)
        if not engines:
            raise ValueError(
                "the state must hold the model set up by fabric.setup under the ZeRO "
                "strategy: pass state={'model': model, ...}"
            )
        return engines, rest

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save one sharded checkpoint directory. Collective.

        Entries other than the models and their optimizers travel as its ``client_state``.
        Several models, or a model set up with several optimizers, save every engine under one
        commit point.

        Args:
            path: the directory; rank 0's name is used on every rank.
            state: the models set up here, their optimizers and any other entries, by name.
            storage_options: not supported; leave it ``None``.
            filter: not supported; leave it ``None``.
        """
        if storage_options is not None or filter is not None:
            raise TypeError(
                "fabric.save(..., storage_options/filter) is not supported by the ZeRO strategy: "
                "the engine writes the sharded state itself"
            )
        engines, rest = self._named(state)
        client_state = convert_stateful(self, {k: state[k] for k in rest})
        save_all(engines, self._checkpoint_path(path), client_state)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore the engines, then the other entries of ``state``. Collective.

        Args:
            path: the directory :meth:`save_checkpoint` wrote. A file is loaded as Fabric
                loads one.
            state: the models set up here and the other entries to restore, by name.
            strict: an entry of ``state`` the checkpoint lacks is an error.
            weights_only: only ``False`` (a trusted file) unpickles arbitrary data.

        Returns:
            The saved entries ``state`` did not ask for.
        """
        path = self._checkpoint_path(path)
        if not path.is_dir():
            return super().load_checkpoint(path, state, strict, weights_only)
        if not isinstance(state, dict) or not state:
            raise ValueError(
                "loading a ZeRO checkpoint directory needs the set-up model in the state: "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        engines, wanted = self._named(state)
        trust = weights_only is False  # the file is trusted
        saved = load_all(engines, path, trust_checkpoint=trust) or {}
        check_strict_keys(wanted, saved.keys(), strict=strict)
        for name in [k for k in wanted if k in saved]:
            if isinstance(state[name], Stateful):
                state[name].load_state_dict(saved.pop(name))
            else:
                state[name] = saved.pop(name)
        return saved
