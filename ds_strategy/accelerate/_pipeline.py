"""A :class:`ZeroAccelerator` whose config has a ``pipeline`` section (``stages > 1``): the
model becomes a :class:`~ds_strategy.core.pipeline.PipelineEngine` and the loop calls
``loss = model.train_batch(inputs, targets)``, as with DeepSpeed's pipeline engine (one call
runs ``gradient_accumulation_steps`` micro-batches, clips, steps optimizer and scheduler).

[Note: data-parallel sharding]
Every stage of one pipeline reads the same samples, so loaders are sharded over the
data-parallel ranks (``dp_size = num_processes // stages``, ``dp_rank = process_index %
dp_size``, as in ``core.pipeline.Mesh``). One loader batch is this rank's share of a step:
``gradient_accumulation_steps x train_micro_batch_size_per_gpu`` samples.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils.deepspeed import DummyScheduler
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ..config import ZeroConfig
from ..config.loop import fill_auto
from ..core.pipeline import PipelineEngine
from ..core.pipeline.loop import LOOP, PipelineModel, refusing, schedule_does
from ..core.pipeline.mesh import loader_micro_batch
from ._front import EngineOptimizer, Front, torch_optimizer
from ._private import mark_prepared, track
from .plugin import ZeroPlugin

__all__ = ["PipelineFront", "PipelineOptimizer"]


class PipelineOptimizer(EngineOptimizer):
    """This rank's shard of the engine's optimizer, which ``train_batch`` steps and zeroes, so
    ``step()`` and ``zero_grad()`` do nothing."""

    def __init__(self, model: PipelineModel) -> None:
        super().__init__(model.engine)
        self.model = model

    @property
    def step_was_skipped(self) -> bool:
        return self.model.step_was_skipped

    def step(self, closure: object = None) -> None:
        if closure is not None:
            raise ValueError(schedule_does("optimizer.step(closure)", "step"))

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass


class PipelineFront(Front):
    """The accelerator's pipeline side; checks at construction what would fail after the build."""

    trained: PipelineEngine | None = None
    model: PipelineModel | None
    model_kind = "the model (an nn.Sequential or a list of layers)"
    engine_schedulers = (LRScheduler, DummyScheduler)  # stepped inside train_batch
    backward = refusing(
        "accelerator.backward", "backward", f"write `{LOOP}` (it also steps the optimizer)"
    )
    check_accumulate = refusing(
        "accumulate()",
        "accumulate",
        "drop accumulate() and feed loader batches of gradient_accumulation_steps x "
        "train_micro_batch_size_per_gpu samples",
    )
    no_sync = refusing("no_sync()", "no_sync", f"drop no_sync() and write `{LOOP}`")
    clip_grad_norm_ = refusing(
        "clip_grad_norm_",
        "clip_grad_norm_",
        "set gradient_clipping in the ZeRO config (or ZeroPlugin(gradient_clipping=...) for "
        "'auto'); model.engine.get_global_grad_norm() returns the last norm",
    )
    clip_grad_value_ = refusing(
        "clip_grad_value_",
        "clip_grad_value_",
        "set gradient_clipping (global-norm clipping) in the ZeRO config",
    )
    prepare_scheduler = scheduler_alone = refusing(
        "an lr scheduler prepared alone",
        "scheduler",
        "pass the scheduler to the same prepare() call as the model and optimizer",
    )

    def __init__(self, acc: Accelerator, cfg: ZeroConfig, plugin: ZeroPlugin) -> None:
        super().__init__(acc, cfg, plugin)
        stages = cfg.layout.stages
        if plugin.loss_fn is None or not callable(plugin.loss_fn):
            raise ValueError(
                f"pipeline.stages={stages}: a pipeline computes the loss on its last stage; pass "
                "ZeroPlugin(loss_fn=fn) with fn(output, target) -> scalar loss of one micro-batch"
            )
        world = acc.num_processes
        if world % stages:
            raise ValueError(
                f"pipeline.stages={stages}: {world} process(es) do not divide into {stages} "
                f"stages; launch a multiple of {stages} processes (accelerate launch "
                "--num_processes) or change pipeline.stages"
            )
        self.dp_size = world // stages
        self.dp_rank = acc.process_index % self.dp_size

    def is_model(self, obj: Any) -> bool:
        if isinstance(obj, nn.Module):
            return True
        layers = isinstance(obj, (list, tuple)) and bool(obj)
        return layers and all(isinstance(m, nn.Module) for m in obj)

    def prepare_loader(self, loader: Any) -> Any:
        """Shard ``loader`` over the data-parallel ranks (see the module note)."""
        acc = self.acc
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
            self.batch_sizes.append(size)
        out = prepare_data_loader(
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
        mark_prepared(out)
        track(acc, "dataloader", out)
        return out

    def _check_batch(self, size: int) -> None:
        engine = self.trained
        if engine is not None and engine.micro_batch_size is not None:
            loader_micro_batch(size, engine.micro_batches, engine.micro_batch_size)

    def _micro_batch(self) -> int | None:
        if not self.batch_sizes:
            return None
        gas_cfg = self.cfg.gradient_accumulation_steps
        gas = gas_cfg if isinstance(gas_cfg, int) else self.acc.gradient_accumulation_steps
        return loader_micro_batch(min(self.batch_sizes), gas)

    def build(
        self, layers: Any, user_optimizer: Any, sched: Any
    ) -> tuple[PipelineModel, PipelineOptimizer, Any]:
        cfg = fill_auto(self.cfg, self.facts(user_optimizer, self.dp_size, self._micro_batch()))
        optimizer = torch_optimizer(cfg, user_optimizer)
        if isinstance(sched, DummyScheduler):  # the engine builds its scheduler from the callable
            sched = sched.lr_scheduler_callable
        loss_fn = self.plugin.loss_fn
        assert loss_fn is not None  # (__init__ refused a plugin without one)
        engine = PipelineEngine(layers, optimizer, cfg, loss_fn, lr_scheduler=sched)
        fix = f"write `{LOOP}` (or model.eval_batch(inputs, targets) for the loss without training)"
        self.trained, self.model = engine, PipelineModel(engine, fix)
        for size in self.batch_sizes:  # loaders prepared before the model
            self._check_batch(size)
        self.adopt_steps(engine.micro_batches)
        wrapper = PipelineOptimizer(self.model)  # what prepare returns for the optimizer
        return self.model, wrapper, self.register(self.model, wrapper, engine.lr_scheduler)
