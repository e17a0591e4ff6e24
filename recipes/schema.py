"""The recipes' config schema, registered in Hydra's ConfigStore as structured configs.

[Note: why the strategy presets are registered from code]
The ``strategy`` group's options are the package's presets (``ds_strategy.config.presets``:
``zero1`` ... ``zero3_offload``) and the ``precision`` group's its precision fragments: the same
presets a user passes by name to ``ds_strategy.initialize``, not copies that drift. Each strategy preset is merged into
ds_strategy's own schema (``ds_strategy.config.config_schema()``), so every ZeRO key is typed
and a misspelt override (``strategy.zero_optimization.stgae=3``) fails at composition naming
the key, exactly as ``trainer.max_stepz=3`` fails against :class:`TrainerConfig`. A precision
preset is stored with ``package="strategy"``: it merges into the strategy node (its ``bf16``
and ``fp16`` sections), after the strategy preset, so ``precision=`` always wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ds_strategy.config import config_schema
from ds_strategy.config.presets import PRECISIONS, precision_fragment, preset, preset_names

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = Path(__file__).resolve().parent / "conf"


@dataclass
class ModelConfig:
    """A character-level GPT (``recipes/models.py``)."""

    d: int = 64  # embedding width
    layers: int = 2
    heads: int = 4
    seq: int = 64  # context length in characters
    tie_embeddings: bool = True


@dataclass
class DataConfig:
    """A text file of the repository, read as characters (no download)."""

    path: str = "README.md"  # relative to the repository root, or absolute
    batch_size: int = 8  # sequences per rank per micro-step
    stride: int = 16  # distance between the starts of two training windows
    num_workers: int = 0


@dataclass
class TrainerConfig:
    """Loop settings; the names are Lightning Trainer arguments, which the Accelerate
    recipe reads the same way."""

    accelerator: str = "cpu"  # cpu | gpu | auto
    devices: int = 2  # processes on this machine
    num_nodes: int = 1
    max_steps: int = 60  # optimizer steps
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    sample_chars: int = 200  # characters generated after training (0: none)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])


@dataclass
class RecipeConfig:
    strategy: Any = None  # a ds_strategy config node (see the note at the top)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0


def register() -> None:
    """Store the schema and the ``strategy`` / ``precision`` options; idempotent."""
    cs = ConfigStore.instance()
    cs.store(name="recipe_schema", node=RecipeConfig)
    for name in preset_names():
        node = OmegaConf.merge(config_schema(), preset(name))
        cs.store(group="strategy", name=name, node=node)
    for name in PRECISIONS:
        node = OmegaConf.create(precision_fragment(name))
        cs.store(group="precision", name=name, node=node, package="strategy")


def check_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not have. Composition already refuses a misspelt
    override; this catches one forced in with ``+`` (``+trainer.max_stepz=3``), which Hydra
    appends even to a structured node."""
    import difflib
    from dataclasses import fields

    for name in ("model", "data", "trainer", "optim"):
        known = [f.name for f in fields(RecipeConfig.__dataclass_fields__[name].default_factory())]
        for key in cfg[name]:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f", did you mean {name}.{close[0]}?" if close else f" (known: {known})"
                raise ValueError(f"{name}.{key}: unknown key{hint}")


def engine_config(cfg: DictConfig) -> Any:
    """The composed ``strategy`` node as a validated ``ds_strategy.ZeroConfig`` (after
    :func:`check_keys`); an unknown ZeRO key fails here naming it."""
    import ds_strategy

    check_keys(cfg)
    return ds_strategy.load_config(cfg.strategy)


def precision_name(zero_config: Any) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` from a ZeroConfig's precision sections."""
    if zero_config.bf16.enabled is True:
        return "bf16"
    if zero_config.fp16.enabled is True:
        return "fp16"
    return "fp32"


def lightning_precision(zero_config: Any) -> str:
    """The Trainer ``precision`` flag that agrees with the config (a contradiction is an
    error in ZeroStrategy)."""
    name = precision_name(zero_config)
    if name == "bf16":
        return "bf16-mixed" if zero_config.bf16.master_weights else "bf16-true"
    return {"fp16": "16-mixed", "fp32": "32-true"}[name]


def corpus_path(cfg: DictConfig) -> Path:
    path = Path(cfg.data.path)
    path = path if path.is_absolute() else REPO / path
    if not path.is_file():
        raise FileNotFoundError(
            f"data.path={cfg.data.path!r}: no such file ({path}); give a text file, relative to "
            f"the repository root ({REPO}) or absolute"
        )
    return path


@dataclass
class GenerateConfig:
    """``recipes/generate.py``: a trained model served by ``ds_strategy.init_inference`` with
    the ``strategy`` node as its config (``zero3``: ZeRO-Inference; its ``quantization``,
    ``tensor_parallel`` and ``offload_param`` sections apply)."""

    strategy: Any = None
    model_path: str = "???"  # a model directory (ds_model.json or Hugging Face) or a factory
    checkpoint: Any = None  # weights, when the model directory does not hold them
    prompt: str = "ZeRO"
    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Any = None
    top_p: Any = None
    seed: int = 0
    devices: int = 1  # processes (started through torchrun when > 1)


def register_generate() -> None:
    """The generation recipe's schema next to the shared ``strategy`` / ``precision`` options."""
    register()
    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)
