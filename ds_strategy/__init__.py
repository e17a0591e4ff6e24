"""ds_strategy: ZeRO-style sharded training for PyTorch on ``torch.distributed``.

>>> import torch, ds_strategy
>>> model = torch.nn.Linear(4, 2)
>>> engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
...                                 {"zero_optimization": {"stage": 1}})
>>> engine.stage
1
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _logging  # noqa: F401 - the package logger's own handler (see _logging.py)
from .config import ConfigError, ZeroConfig, load_config, zero_config
from .core.checkpoint.consolidate import consolidate
from .core.checkpoint.deepspeed.export import convert
from .core.checkpoint.lock import CheckpointBusyError
from .core.checkpoint.pretrained import LoadedWeights, pretrained
from .core.checkpoint.sharded import CheckpointWriteError
from .core.checkpoint.trust import UntrustedContentError
from .core.checkpoint.validate import CheckpointError
from .core.collectives import Comm, init_process_group_from_env
from .core.engine import ZeroEngine
from .core.faults import RankFailedError, together
from .core.sequence import tiled_cross_entropy

if TYPE_CHECKING:
    from .core.inference import InferenceEngine
    from .core.inference.building import ModelFileError
    from .core.pipeline import PipelineEngine

__all__ = [
    "CheckpointBusyError",
    "CheckpointError",
    "CheckpointWriteError",
    "ConfigError",
    "InferenceEngine",
    "LoadedWeights",
    "ModelFileError",
    "PipelineEngine",
    "RankFailedError",
    "UntrustedContentError",
    "ZeroConfig",
    "ZeroEngine",
    "consolidate",
    "convert",
    "init_inference",
    "initialize",
    "load_config",
    "pretrained",
    "tiled_cross_entropy",
    "zero_config",
]
__version__ = "0.1.0"


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    config: Any = None,
    *,
    lr_scheduler: Any = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> ZeroEngine | PipelineEngine:
    """Wrap ``model`` and ``optimizer`` in a :class:`ZeroEngine` sharded as ``config`` says.

    Args:
        model: the model. It may live on the meta device; then every module needs
            ``reset_parameters()`` or ``param_init_fn``. ZeRO-3 materialises it one unit at a
            time. A pipeline config takes an ``nn.Sequential`` or a list of layers. Its items
            may also be callables that build one layer each. Each rank builds (or materialises
            from meta) only its own stage's layers.
        optimizer: a ``torch.optim.Optimizer`` built on ``model.parameters()``. The engine
            rebuilds it over this rank's shards, with the same param groups and
            hyper-parameters. Or a callable ``params -> Optimizer``. Or None, to build one from
            the config's ``optimizer`` section.
        config: a dict, a path to a ``.json``/``.yaml`` file, a :class:`ZeroConfig` or an
            omegaconf node. Keys follow DeepSpeed's config names.
        lr_scheduler: an lr scheduler built on ``optimizer``, or a callable
            ``optimizer -> scheduler``. It steps at every optimizer step.
        process_group: the data-parallel group. Default: the default group. When none exists,
            it is initialised from ``torchrun`` / ``accelerate launch`` / SLURM variables.
        param_init_fn: ``fn(module)`` initialising a module's own parameters after
            materialisation from the meta device.
        loss_fn: ``fn(output, target) -> loss`` of one micro-batch. Give it with an
            ``nn.Sequential`` model and a ``pipeline`` config section.

    Returns:
        A :class:`ZeroEngine`. With ``loss_fn``, a
        :class:`~ds_strategy.core.pipeline.PipelineEngine`, driven by ``train_batch``.

    Example:
        >>> import torch, ds_strategy
        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> engine = ds_strategy.initialize(model, optimizer, {"zero_optimization": {"stage": 2}})
        >>> loss = engine(torch.randn(8, 4)).square().mean()
        >>> _ = engine.backward(loss)
        >>> engine.step()
        >>> engine.stage
        2
    """
    init_process_group_from_env()
    with together(Comm(process_group)):  # a config one rank cannot read fails every rank
        stages = _pipeline_stages(config)
    if loss_fn is not None or stages > 1:
        return _pipeline_engine(
            model, optimizer, config, loss_fn, lr_scheduler, process_group, param_init_fn
        )
    return ZeroEngine(
        model,
        optimizer,
        config,
        lr_scheduler=lr_scheduler,
        process_group=process_group,
        param_init_fn=param_init_fn,
    )


def init_inference(
    model: Any,
    config: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    tensor_parallel: int | dict[str, Any] | None = None,
    quantization: int | dict[str, Any] | None = None,
    checkpoint: Any = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    require_checksums: bool = True,
    trust_remote_code: bool = False,
) -> InferenceEngine:
    """A model ready for inference.

    The engine runs ``engine(inputs)`` and ``engine.generate(input_ids, ...)``. It also has
    ``engine.memory_report()``, ``engine.save_quantized(path)`` and ``engine.destroy()``.

    Args:
        model: an ``nn.Module``, with its weights or on the meta device with ``checkpoint``.
            Or a callable building one, or ``'package.module:factory'``. Or a Hugging Face
            model directory, or a directory with a ``ds_model.json`` (what the example job
            saves). Its parameters are built on the meta device; each rank reads only its part.
        config: the training config format (dict, path, ``ZeroConfig``). Its
            ``zero_optimization`` section with ``stage: 3`` (and ``offload_param``) gives
            ZeRO-Inference. It may hold a ``tensor_parallel`` section. It may hold a
            ``quantization`` section: ``bits`` (8 or 4), ``group_size``, ``symmetric``,
            ``modules_to_not_convert``. ``bf16`` / ``fp16`` set the dtype.
        dtype: ``torch.float32`` / ``bfloat16`` / ``float16`` (or ``"fp32"`` ...). It
            overrides the config's.
        tensor_parallel: the tensor-parallel size (or a ``tensor_parallel`` section).
        quantization: the bits (or a ``quantization`` section).
        checkpoint: the weights: a ds_strategy checkpoint, a ``.safetensors`` file or a
            directory of them. The checkpoint may come from any world size, stage or
            tensor-parallel layout.
        process_group: the ranks that hold and run the model. Default: the default group.
        require_checksums: refuse a checkpoint that records no checksums. ``False`` accepts
            one.
        trust_remote_code: let a model directory's ``ds_model.json`` name a factory outside
            ``ds_strategy``. That is code the directory's author chose, imported and run here.
            When off, such a directory is refused with the factory's name.

    Returns:
        An :class:`InferenceEngine`.

    >>> import torch, ds_strategy
    >>> engine = ds_strategy.init_inference(torch.nn.Sequential(torch.nn.Linear(64, 8)),
    ...                                     quantization=8)
    >>> engine(torch.randn(2, 64)).shape
    torch.Size([2, 8])
    """
    from .core.inference import InferenceEngine

    return InferenceEngine(
        model,
        config,
        dtype=dtype,
        tensor_parallel=tensor_parallel,
        quantization=quantization,
        checkpoint=checkpoint,
        process_group=process_group,
        require_checksums=require_checksums,
        loaders=(_hf_model_directory,),
        trust_remote_code=trust_remote_code,
    )


def _hf_model_directory(path: Any) -> Any:
    """A Hugging Face model directory (``config.json``) as a meta-device model, its weights and
    its tokenizer; ``None`` for any other directory (``ds_strategy.hf`` builds it: the only
    module that imports transformers)."""
    from pathlib import Path

    if not (Path(path) / "config.json").is_file():
        return None
    from .hf.models import load_model_directory

    return load_model_directory(Path(path))


# the public sub-packages, listed by dir() beside __all__ (imported on first use)
_SUBPACKAGES = ("accelerate", "cli", "config", "fabric", "hf", "lightning")


def __dir__() -> list[str]:
    """The public names (``__all__``, the lazily imported ones included), the version and the
    public sub-packages; not the modules and helpers ``__init__`` itself uses."""
    return sorted({*__all__, "__version__", *_SUBPACKAGES})


def __getattr__(name: str) -> Any:
    if name == "PipelineEngine":
        from .core.pipeline import PipelineEngine

        return PipelineEngine
    if name == "InferenceEngine":
        from .core.inference import InferenceEngine

        return InferenceEngine
    if name == "ModelFileError":
        from .core.inference.building import ModelFileError

        return ModelFileError
    raise AttributeError(f"module 'ds_strategy' has no attribute {name!r}")


def _pipeline_stages(config: Any) -> int:
    with warnings.catch_warnings():  # the engine loads the config again and warns then
        warnings.simplefilter("ignore")
        return load_config(config).layout.stages


def _pipeline_engine(
    model: Any,
    optimizer: Any,
    config: Any,
    loss_fn: Any,
    lr_scheduler: Any,
    process_group: Any,
    param_init_fn: Any,
) -> PipelineEngine:
    if loss_fn is None:
        raise ValueError(
            "pipeline.stages > 1: a pipeline computes the loss on its last stage; pass "
            "loss_fn=fn(output, target) to ds_strategy.initialize and train with "
            "engine.train_batch(inputs, targets)"
        )
    from .core.pipeline import PipelineEngine  # torch.distributed.pipelining is slow to import

    if process_group is not None:
        raise ValueError(
            "process_group: a pipeline builds its own groups from the default group; leave it unset"
        )
    return PipelineEngine(
        model, optimizer, config, loss_fn, lr_scheduler=lr_scheduler, param_init_fn=param_init_fn
    )


from ._lightning_hook import register_when_lightning_is_imported  # noqa: E402

# zero1..zero3_offload in Lightning's Trainer and Fabric registries, once Lightning is imported
register_when_lightning_is_imported()
