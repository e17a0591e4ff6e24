"""Which modules tensor parallelism splits, and how: the automatic plan for the model families
it knows, or the config's explicit ``tensor_parallel.plan``.

[Note: the automatic plan]
- The package's demo GPT (``ds_strategy.demos.gpt``): in every block ``qkv`` and ``fc`` are
  split column-wise (output features; ``qkv`` is laid out head by head, so each rank gets whole
  heads with their q, k and v), ``proj`` and ``out`` row-wise (input features, partial outputs
  summed). Embeddings, norms and the head are replicated.
- Hugging Face Llama-family models (Llama, Mistral, Qwen2, ... : attention with ``q_proj``,
  ``k_proj``, ``v_proj``, ``o_proj``, an MLP with ``gate_proj``, ``up_proj``, ``down_proj``):
  q/k/v/gate/up column-wise, o/down row-wise; embeddings, norms and ``lm_head`` replicated.
- Hugging Face GPT-2 (``Conv1D`` layers, whose weight is stored (in, out), transposed from
  ``nn.Linear``'s): the fused ``c_attn`` column-wise as three blocks (q | k | v, each rank gets
  its heads of each: style ``colwise_qkv``, and the attention's ``split_size`` becomes the
  rank's width), ``c_fc`` column-wise, both ``c_proj`` row-wise. Cross-attention layers
  (``q_attn``) stay replicated.
Attention heads (and key/value heads) must divide by the tensor-parallel size, or the error
names the layer and the numbers. A model with none of these layers is an error naming its
first ``nn.Linear`` and how to write a plan.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol, TypeGuard

import torch
from torch import nn

from ...config import ConfigError

__all__ = ["FUSED_CHUNKS", "is_conv1d", "resolve_plan"]

# column-wise styles of fused layers: how many equal blocks their outputs are
FUSED_CHUNKS = {"colwise_qkv": 3}

_GPT_BLOCK = {"qkv": "colwise", "fc": "colwise", "proj": "rowwise", "out": "rowwise"}
_LLAMA_ATTENTION = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "o_proj": "rowwise",
}
_LLAMA_MLP = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
_GPT2_ATTENTION = {"c_attn": "colwise_qkv", "c_proj": "rowwise"}
_GPT2_MLP = {"c_fc": "colwise", "c_proj": "rowwise"}


class Conv1DLike(Protocol):
    """GPT-2's ``Conv1D``: a linear layer whose weight is stored (in, out)."""

    nx: int  # in features
    nf: int  # out features
    weight: torch.Tensor


def is_conv1d(module: nn.Module | None) -> TypeGuard[Conv1DLike]:
    """GPT-2's ``Conv1D`` (transformers.pytorch_utils), known by its shape, not imported: a
    linear layer whose weight is (in features ``nx``, out features ``nf``)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    )


def _features(module: nn.Module | None) -> tuple[int, int] | None:
    """(in, out) features of a layer tensor parallelism can split, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return int(module.nx), int(module.nf)
    return None


PLAN_HELP = (
    'write a plan in the config: "tensor_parallel": {"autotp_size": T, "plan": '
    '{"<module-name regex>": "colwise" | "rowwise" | "replicate"}}; pair each column-wise '
    "layer with the row-wise layer that reads its output"
)


def resolve_plan(model: nn.Module, size: int, explicit: Mapping[str, str]) -> dict[str, str]:
    """Module name -> ``"colwise"`` / ``"rowwise"`` for every module to split over ``size``
    ranks (``explicit``: the config's patterns, else the automatic plan)."""
    plan = _explicit(model, explicit) if explicit else _automatic(model, size)
    if not plan:
        first = next((n for n, m in model.named_modules() if isinstance(m, nn.Linear)), None)
        where = f"its first nn.Linear, {first!r}, and every other layer" if first else "no layer"
        raise ConfigError(
            f"tensor_parallel.autotp_size={size}: no tensor-parallel plan for "
            f"{type(model).__name__} ({where} matched: the automatic plan knows the demo GPT, "
            f"GPT-2 and Llama-family models); {PLAN_HELP}",
            key="tensor_parallel.plan",
        )
    for name, style in plan.items():
        _check_divisible(model.get_submodule(name), name, style, size)
    return plan


def _explicit(model: nn.Module, patterns: Mapping[str, str]) -> dict[str, str]:
    compiled = [(re.compile(p), s) for p, s in patterns.items()]
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        style = next((s for p, s in compiled if name and p.fullmatch(name)), None)
        if style is None or style == "replicate":
            continue
        if _features(module) is None:
            raise ConfigError(
                f"tensor_parallel.plan: {name!r} is a {type(module).__name__}; column-wise and "
                "row-wise splits apply to nn.Linear (and GPT-2 Conv1D) layers (leave the "
                "others replicated)",
                key="tensor_parallel.plan",
            )
        plan[name] = style
    return plan


def _automatic(model: nn.Module, size: int) -> dict[str, str]:
    plan: dict[str, str] = {}
    heads_of = _hf_heads(model)
    for name, module in model.named_modules():
        children = dict(module.named_children())
        prefix = f"{name}." if name else ""
        for table in (_GPT_BLOCK, _LLAMA_ATTENTION, _LLAMA_MLP):
            if all(isinstance(children.get(k), nn.Linear) for k in table):
                plan.update({prefix + k: v for k, v in table.items()})
                if table is _GPT_BLOCK:
                    _check_heads(f"{prefix}qkv", {"heads": getattr(module, "heads", 1)}, size)
                if table is _LLAMA_ATTENTION:  # the layer's config, else the model's
                    heads = _hf_heads(module) or heads_of
                    if heads:
                        _check_heads(f"{prefix}q_proj", heads, size)
        for table in (_GPT2_ATTENTION, _GPT2_MLP):
            if not all(is_conv1d(children.get(k)) for k in table):
                continue
            if table is _GPT2_ATTENTION:
                if hasattr(module, "q_attn") or not hasattr(module, "split_size"):
                    continue  # cross-attention: its c_attn holds k | v only
                heads = {"num_heads": int(getattr(module, "num_heads", 1))}
                _check_heads(f"{prefix}c_attn", heads, size)
            plan.update({prefix + k: v for k, v in table.items()})
    return plan


def _hf_heads(model: nn.Module) -> dict[str, int]:
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        return {}
    return {
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
    }


def _check_heads(layer: str, heads: Mapping[str, int], size: int) -> None:
    for what, n in heads.items():
        if n % size:
            raise ConfigError(
                f"tensor_parallel.autotp_size={size} does not divide {what}={n} of {layer!r}: "
                "each rank must hold whole attention heads; choose a size that divides it",
                key="tensor_parallel.autotp_size",
            )


def _check_divisible(layer: nn.Module, name: str, style: str, size: int) -> None:
    in_features, out_features = _features(layer) or (0, 0)
    features, dim = (
        (in_features, "in_features") if style == "rowwise" else (out_features, "out_features")
    )
    parts = size * FUSED_CHUNKS.get(style, 1)
    if features % parts:
        blocks = f" x {parts // size} blocks" if parts > size else ""
        raise ConfigError(
            f"tensor_parallel: {name!r} ({style}) has {dim}={features}, not divisible by "
            f"autotp_size={size}{blocks}; choose an autotp_size dividing it, or leave the "
            "layer out of tensor_parallel.plan",
            key="tensor_parallel.autotp_size",
        )
