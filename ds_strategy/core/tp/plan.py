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
Attention heads (and key/value heads) must divide by the tensor-parallel size, or the error
names the layer and the numbers. A model with none of these layers is an error naming its
first ``nn.Linear`` and how to write a plan.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

__all__ = ["resolve_plan"]

_GPT_BLOCK = {"qkv": "colwise", "fc": "colwise", "proj": "rowwise", "out": "rowwise"}
_LLAMA_ATTENTION = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "o_proj": "rowwise",
}
_LLAMA_MLP = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}

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
        raise ValueError(
            f"tensor_parallel.autotp_size={size}: no tensor-parallel plan for "
            f"{type(model).__name__} ({where} matched: the automatic plan knows the demo GPT and "
            f"Llama-family models); {PLAN_HELP}"
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
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"tensor_parallel.plan: {name!r} is a {type(module).__name__}; column-wise and "
                "row-wise splits apply to nn.Linear layers (leave the others replicated)"
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
                if table is _LLAMA_ATTENTION and heads_of:
                    _check_heads(f"{prefix}q_proj", heads_of, size)
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
            raise ValueError(
                f"tensor_parallel.autotp_size={size} does not divide {what}={n} of {layer!r}: "
                "each rank must hold whole attention heads; choose a size that divides it"
            )


def _check_divisible(layer: nn.Module, name: str, style: str, size: int) -> None:
    assert isinstance(layer, nn.Linear)
    features, dim = (
        (layer.out_features, "out_features")
        if style == "colwise"
        else (layer.in_features, "in_features")
    )
    if features % size:
        raise ValueError(
            f"tensor_parallel: {name!r} ({style}) has {dim}={features}, not divisible by "
            f"autotp_size={size}"
        )
