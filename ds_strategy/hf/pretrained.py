"""A Hugging Face model built on the meta device, its weights read into the shards by the engine
built on it: ``from_pretrained`` without a whole copy on any rank.

[Note: which class]
``from_pretrained`` on an ``AutoModel*`` class picks the architecture from ``config.json``'s
``architectures``; here that class is built from the config under ``torch.device("meta")`` (no
storage, no initialisation), and :func:`ds_strategy.pretrained` marks it for the engine, which
materialises it one unit at a time (the model's own ``_init_weights`` computing buffers such
as rotary ``inv_freq``) and reads each rank's shard from the files. A config naming no
architecture gets ``AutoModelForCausalLM``; pass ``cls`` for another head.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..core.checkpoint.pretrained import pretrained

__all__ = ["from_pretrained", "resolve_pretrained"]

# what a snapshot needs: the config, the weights and (for the trainers) the tokenizer
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def resolve_pretrained(name_or_path: str | os.PathLike) -> Path:
    """A local directory, or a Hub id downloaded (safetensors weights, config, tokenizer)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or str(name_or_path).startswith((".", "/", "~")):
        raise FileNotFoundError(f"{name_or_path}: not a model directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name_or_path), allow_patterns=_PATTERNS))
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated: all the same to the user
        raise FileNotFoundError(
            f"{name_or_path}: no such local directory, and it could not be fetched from the "
            f"Hub ({type(e).__name__}: {e})"
        ) from e


def from_pretrained(
    name_or_path: str | os.PathLike, cls: Any = None, *, strict: bool = True, **config: Any
) -> nn.Module:
    """The model at ``name_or_path``, built on the meta device and marked to load its weights.

    The engine built on it reads its weights straight into the shards. Any front end builds
    such an engine: ``ZeroTrainer``, ``ZeroAccelerator``, Lightning, Fabric,
    ``ds_strategy.initialize``.

    Args:
        name_or_path: a directory ``save_pretrained`` wrote, or a Hub id.
        cls: the model class (``AutoModelForSequenceClassification``, ``LlamaForCausalLM``).
            Default: the one ``config.json`` names (see the note).
        strict: a parameter the files lack is an error. Otherwise it keeps its
            initialisation.
        **config: overrides of ``config.json`` values, as ``from_pretrained`` takes them.

    Returns:
        The model, on the meta device.

    >>> model = ds_strategy.hf.from_pretrained("meta-llama/Llama-3.2-1B")  # doctest: +SKIP
    >>> engine = ds_strategy.initialize(model, torch.optim.AdamW, "zero3")  # doctest: +SKIP
    """
    path = resolve_pretrained(name_or_path)
    cfg = AutoConfig.from_pretrained(path, **config)
    if cls is None:
        names = getattr(cfg, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        cls = cls or AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(cfg) if hasattr(cls, "from_config") else cls(cfg)
    # float weights in fp32 (the engine's master dtype), whatever the files hold
    model.to(torch.float32)
    return pretrained(model, path, strict=strict)
