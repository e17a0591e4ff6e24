"""Hugging Face model directories for inference: the model built from its ``config.json`` with
its parameters on the meta device (``AutoModelForCausalLM.from_config``), the directory as its
weights, and its tokenizer when it has one."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..core.inference.building import LoadedModel, params_on_meta

__all__ = ["load_model_directory"]


def load_model_directory(path: Path) -> LoadedModel:
    config = AutoConfig.from_pretrained(path)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model, path, tokenizer)
