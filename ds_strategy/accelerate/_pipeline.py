"""A :class:`ZeroAccelerator` whose ZeRO config has a ``pipeline`` section (``stages > 1``).

The model becomes a :class:`~ds_strategy.core.pipeline.PipelineEngine` and the loop calls
``loss = model.train_batch(inputs, targets)`` per batch, as with DeepSpeed's pipeline engine:
one call runs the whole schedule over ``gradient_accumulation_steps`` micro-batches of
``train_micro_batch_size_per_gpu`` samples, reduces, clips (the config's
``gradient_clipping``, by the global norm across stages) and steps the optimizer and the lr
scheduler.

[Note: data-parallel sharding]
Every stage of one pipeline must read the same samples (the first stage their inputs, the
last their targets), so dataloaders are sharded over the data-parallel ranks, not over all
processes: ``dp_size = num_processes // stages`` and ``dp_rank = process_index % dp_size``,
the layout of :class:`~ds_strategy.core.pipeline.Mesh` (known from the config before any
model is built). One loader batch is this data-parallel rank's share of a step:
``gradient_accumulation_steps x train_micro_batch_size_per_gpu`` samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from accelerate.data_loader import prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler
from torch import nn

from ..config import ZeroConfig
from ..core.pipeline import PipelineEngine
from . import _state
from ._driver import EngineSchedulerWrapper
from ._resolve import AcceleratorFacts, resolve, torch_optimizer

if TYPE_CHECKING:
    from .accelerator import ZeroAccelerator

__all__ = ["PipelineFrontEnd", "PipelineModel", "PipelineOptimizer", "pipeline_front_end"]

_LOOP = "loss = model.train_batch(inputs, targets)"
_REFUSED = {
    "backward": (
        "accelerator.backward: under a pipeline config the loss is computed and "
        f"back-propagated inside the schedule; write `{_LOOP}` (it also steps the optimizer)"
    ),
    "clip_grad_norm_": (
        "clip_grad_norm_: under a pipeline config train_batch clips by the global norm across "
        "stages; set gradient_clipping in the ZeRO config (or ZeroPlugin(gradient_clipping=...) "
        "for 'auto'); model.engine.get_global_grad_norm() returns the last norm"
    ),
    "clip_grad_value_": (
        "clip_grad_value_ is not available under a pipeline config; set gradient_clipping "
        "(global-norm clipping) in the ZeRO config"
    ),
    "accumulate": (
        "accumulate(): under a pipeline config train_batch runs gradient_accumulation_steps "
        "micro-batches itself; drop accumulate() and feed loader batches of "
        "gradient_accumulation_steps x train_micro_batch_size_per_gpu samples"
    ),
    "no_sync": (
        "no_sync(): under a pipeline config train_batch reduces gradients once per step "
        f"itself; drop no_sync() and write `{_LOOP}`"
    ),
    "prepare_scheduler": (
        "under a pipeline config the engine steps the lr scheduler inside train_batch; pass "
        "the scheduler to the same prepare() call as the model and optimizer"
    ),
}


def pipeline_front_end(acc: ZeroAccelerator, cfg: ZeroConfig) -> PipelineFrontEnd | None:
    """The pipeline side of ``acc`` when ``cfg`` has ``pipeline.stages > 1``, else None.
    Checks now what would otherwise fail after the model is built."""
    stages = int(cfg.pipeline.stages)
    if stages <= 1:
        return None
    loss_fn = acc.zero_plugin.loss_fn
    if loss_fn is None or not callable(loss_fn):
        raise ValueError(
            f"pipeline.stages={stages}: a pipeline computes the loss on its last stage; pass "
            "ZeroPlugin(loss_fn=fn) with fn(output, target) -> scalar loss of one micro-batch"
        )
    mp = str(acc.state.mixed_precision)
    if mp != "no":
        raise ValueError(
            f"mixed_precision={mp!r}: mixed precision is not available with a pipeline config "
            "in this release; launch with mixed_precision 'no' (or remove the pipeline section)"
        )
    world = acc.num_processes
    if world % stages:
        raise ValueError(
            f"pipeline.stages={stages}: {world} process(es) do not divide into {stages} stages; "
            f"launch a multiple of {stages} processes (accelerate launch --num_processes) or "
            "change pipeline.stages"
        )
    return PipelineFrontEnd(acc, stages, loss_fn)


class PipelineModel(nn.Module):
    """What ``accelerator.prepare`` returns for the model under a pipeline config.

    ``train_batch(inputs, targets)`` / ``eval_batch(inputs, targets)`` run the schedule on
    this data-parallel rank's batch and return the global batch's mean loss on every rank
    (collective: call them on every process, with the batch its loader yielded). ``module``
    holds this rank's stage: its layers, under their index in the full ``nn.Sequential``;
    ``engine`` is the :class:`~ds_strategy.core.pipeline.PipelineEngine`.
    """

    def __init__(self, engine: PipelineEngine) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine
        self.step_was_skipped = False

    def train_batch(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        self.module.train()
        skipped = self.engine.skipped_steps
        loss = self.engine.train_batch(inputs, targets)
        self.step_was_skipped = self.engine.skipped_steps != skipped
        return loss

    def eval_batch(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        self.module.eval()
        return self.engine.eval_batch(inputs, targets)

    def forward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            "a pipeline model is not called directly: each rank holds one stage; write "
            f"`{_LOOP}` (or model.eval_batch(inputs, targets) for the loss without training)"
        )

    @property
    def stage_id(self) -> int:
        return self.engine.stage_id

    @property
    def num_stages(self) -> int:
        return self.engine.num_stages

    @property
    def data_parallel_rank(self) -> int:
        return self.engine.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        return self.engine.data_parallel_size

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps


class PipelineOptimizer(AcceleratedOptimizer):
    """What ``prepare`` returns for the optimizer: this rank's shard of the engine's
    optimizer. ``train_batch`` already stepped it and zeroed the gradients, so ``step()`` and
    ``zero_grad()`` do nothing (a loop written for plain Accelerate keeps working)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: PipelineModel) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._model = model

    def step(self, closure: object = None) -> None:
        if closure is not None:
            raise ValueError(
                f"optimizer.step(closure): under a pipeline config `{_LOOP}` steps the optimizer"
            )

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass

    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``train_batch`` skipped its step (a non-finite gradient norm)."""
        return self._model.step_was_skipped


class PipelineFrontEnd:
    """The state a :class:`ZeroAccelerator` keeps for a pipeline config: the data-parallel
    layout, the loaders' batch sizes and, once prepared, the model."""

    def __init__(self, acc: ZeroAccelerator, stages: int, loss_fn: Callable[..., Any]) -> None:
        self.acc = acc
        self.stages = stages
        self.loss_fn = loss_fn
        self.dp_size = acc.num_processes // stages
        self.dp_rank = acc.process_index % self.dp_size
        self.model: PipelineModel | None = None
        self._batch_sizes: list[int] = []

    @property
    def engine(self) -> PipelineEngine | None:
        return self.model.engine if self.model is not None else None

    def refuse(self, what: str) -> NoReturn:
        raise RuntimeError(_REFUSED[what])

    def owns(self, model: Any) -> bool:
        m = self.model
        return m is not None and (model is m or model is m.module or model is m.engine)

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self, args: tuple[Any, ...]) -> Any:
        out = list(args)
        for i, obj in enumerate(args):
            if isinstance(obj, torch.utils.data.DataLoader):
                out[i] = self.prepare_loader(obj)
        models = [i for i, o in enumerate(args) if _is_layers(o)]
        opts = [i for i, o in enumerate(args) if isinstance(o, (torch.optim.Optimizer, DummyOptim))]
        scheds = [
            i
            for i, o in enumerate(args)
            if isinstance(o, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))
        ]
        if models or opts:
            if len(models) != 1 or len(opts) != 1 or len(scheds) > 1:
                raise ValueError(
                    "under a pipeline config prepare() needs the model (an nn.Sequential or a "
                    "list of layers) and its optimizer in the same call, one of each, with at "
                    f"most one lr scheduler (got {len(models)} model(s), {len(opts)} "
                    f"optimizer(s), {len(scheds)} scheduler(s))"
                )
            sched = args[scheds[0]] if scheds else None
            model, optimizer, owned = self._prepare_engine(args[models[0]], args[opts[0]], sched)
            out[models[0]], out[opts[0]] = model, optimizer
            if scheds:
                out[scheds[0]] = owned
        elif scheds:
            self.refuse("prepare_scheduler")
        return tuple(out) if len(out) > 1 else out[0]

    def prepare_loader(self, loader: torch.utils.data.DataLoader) -> Any:
        """Shard ``loader`` over the data-parallel ranks (see the module note)."""
        acc = self.acc
        if getattr(loader, "_is_accelerate_prepared", False):
            return loader
        if acc.dispatch_batches:
            raise ValueError(
                "dispatch_batches=True is not available with a pipeline config (process 0 "
                "would deal batches to every stage); leave DataLoaderConfiguration's "
                "dispatch_batches unset or False"
            )
        size = loader.batch_size
        if size is not None and acc.split_batches:
            if size % self.dp_size:
                raise ValueError(
                    f"split_batches: the loader's batch of {size} does not split over "
                    f"{self.dp_size} data-parallel ranks; use a multiple of {self.dp_size}"
                )
            size //= self.dp_size
        if size is not None:
            self._check_batch(size)
            self._batch_sizes.append(size)
        prepared = prepare_data_loader(
            loader,
            acc.device,
            num_processes=self.dp_size,
            process_index=self.dp_rank,
            split_batches=acc.split_batches,
            put_on_device=acc.device_placement,
            rng_types=acc.rng_types.copy(),
            dispatch_batches=False,
            even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader,
        )
        prepared._is_accelerate_prepared = True
        acc._dataloaders.append(prepared)
        return prepared

    def _check_batch(self, size: int) -> None:
        engine = self.engine
        if engine is None:
            return
        gas, micro = engine.micro_batches, engine.micro_batch_size
        if micro is not None and size != gas * micro:
            raise ValueError(
                f"this loader yields {size} samples per data-parallel rank but train_batch "
                f"takes gradient_accumulation_steps={gas} x train_micro_batch_size_per_gpu="
                f"{micro} = {gas * micro}; use batch_size={gas * micro} (per data-parallel "
                "rank) or change those keys"
            )

    def _resolved(self, cfg: ZeroConfig, optimizer: Any) -> ZeroConfig:
        acc = self.acc
        gas_cfg = cfg.gradient_accumulation_steps
        gas = gas_cfg if isinstance(gas_cfg, int) else acc.gradient_accumulation_steps
        micro = None
        if self._batch_sizes:
            batch = min(self._batch_sizes)
            if batch % gas:
                raise ValueError(
                    f"the loader's batch of {batch} samples per data-parallel rank does not "
                    f"divide into gradient_accumulation_steps={gas} micro-batches; use a "
                    f"batch_size that is a multiple of {gas}"
                )
            micro = batch // gas
        dummy = optimizer if isinstance(optimizer, DummyOptim) else None
        facts = AcceleratorFacts(
            world_size=self.dp_size,
            mixed_precision="no",
            gradient_accumulation_steps=acc.gradient_accumulation_steps,
            micro_batch_size=micro,
            gradient_clipping=acc.zero_plugin.gradient_clipping,
            optimizer_lr=dummy.lr if dummy else None,
            optimizer_weight_decay=dummy.weight_decay if dummy else None,
        )
        return resolve(cfg, facts)

    def _prepare_engine(
        self, model: Any, user_optimizer: Any, sched: Any
    ) -> tuple[PipelineModel, PipelineOptimizer, EngineSchedulerWrapper | None]:
        if self.model is not None:
            raise ValueError(
                "this ZeroAccelerator already prepared a pipeline model; create another "
                "ZeroAccelerator for another model"
            )
        acc = self.acc
        cfg = self._resolved(acc._zero_config_source, user_optimizer)
        optimizer = torch_optimizer(cfg, user_optimizer)
        lr_scheduler = sched
        if isinstance(sched, DummyScheduler):
            lr_scheduler = sched.lr_scheduler_callable
        engine = PipelineEngine(model, optimizer, cfg, self.loss_fn, lr_scheduler=lr_scheduler)
        self.model = PipelineModel(engine)
        for size in self._batch_sizes:  # loaders prepared before the model
            self._check_batch(size)
        acc._adopt_accumulation_steps(engine.micro_batches)
        wrapper = PipelineOptimizer(engine.optimizer, self.model)
        acc._models.append(self.model)
        acc._optimizers.append(wrapper)
        owned = None
        if engine.lr_scheduler is not None:  # saved with the engine's checkpoint
            owned = EngineSchedulerWrapper(engine.lr_scheduler, wrapper)
        return self.model, wrapper, owned

    # -- weights and checkpoints ---------------------------------------------------------------

    def state_dict(self, unwrap: bool) -> dict[str, torch.Tensor]:
        """The whole model's fp32 weights on every rank (collective), keyed like the
        ``nn.Sequential``'s ``state_dict()``."""
        assert self.engine is not None
        state = self.engine.full_state_dict()
        return state if unwrap else {f"module.{k}": v for k, v in state.items()}

    def save_state(
        self, output_dir: str | None, safe_serialization: bool, unsupported: dict[str, Any]
    ) -> str:
        """Every stage's ZeRO checkpoint under ``<output_dir>/zero_checkpoint/stage_<k>``,
        plus Accelerate's schedulers, samplers and RNG states. Collective."""
        assert self.engine is not None
        if unsupported:
            raise TypeError(f"ZeroAccelerator.save_state does not support {', '.join(unsupported)}")
        return _state.save_state(self.acc, self.engine, output_dir, safe_serialization)  # type: ignore[arg-type]

    def load_state(
        self, input_dir: str | None, unsupported: dict[str, Any], trust_checkpoint: bool
    ) -> None:
        """Restore what :meth:`save_state` wrote, into a pipeline with the same stages."""
        assert self.engine is not None
        if unsupported:
            raise TypeError("ZeroAccelerator.load_state takes no load_kwargs or model kwargs")
        _state.load_state(self.acc, self.engine, input_dir, trust_checkpoint)  # type: ignore[arg-type]

    def free(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
        self.model = None
        self._batch_sizes = []


def _is_layers(obj: Any) -> bool:
    if isinstance(obj, PipelineModel):
        return False
    if isinstance(obj, nn.Module):
        return True
    return (
        isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(m, nn.Module) for m in obj)
    )
