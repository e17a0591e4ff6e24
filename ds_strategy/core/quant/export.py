"""The quantized file format on disk, and the export of a trained model to it.

A quantized ``.safetensors`` file holds every tensor of the model under its own name, except
that each quantized layer ``m`` has ``m.qweight``, ``m.scales`` (and ``m.zeros``) instead of
``m.weight`` (a weight tied to several layers, under the first one's name only). Its metadata
key :data:`QUANT_META` is JSON: ``bits``, ``group_size``, ``symmetric`` and the quantized
``modules``. ``init_inference`` reads such a file as it is (``core/inference``), and both
``InferenceEngine.save_quantized`` and ``ZeroEngine.save_quantized`` write one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.weights_file import stream_safetensors
from .modules import _candidates, fitting
from .qat import FakeQuantEmbedding, FakeQuantLinear
from .scheme import QuantScheme, quantize

__all__ = ["QUANT_META", "quant_meta", "write_quantized_state"]

QUANT_META = "ds_strategy.quantization"


def quant_meta(scheme: QuantScheme, modules: list[str]) -> dict[str, str]:
    """The metadata entry a quantized file carries."""
    text = json.dumps(
        {
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            "symmetric": scheme.symmetric,
            "modules": modules,
        }
    )
    return {QUANT_META: text}


def _trained_layers(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    scheme: QuantScheme,
    embeddings: bool,
    skip: list[str],
) -> list[list[str]]:
    """Names of the layers a quantization converts, grouped by shared weight: plain layers
    and the fake-quantized ones quantization-aware training put in their place."""
    linear: tuple[type, ...] = (nn.Linear, FakeQuantLinear)
    embedding: tuple[type, ...] = (nn.Embedding, FakeQuantEmbedding)
    try:  # torchao's, when training used them (imported only if torchao already is)
        import sys

        if "torchao" in sys.modules:
            from torchao.quantization.qat.embedding import FakeQuantizedEmbedding
            from torchao.quantization.qat.linear import FakeQuantizedLinear

            linear += (FakeQuantizedLinear,)
            embedding += (FakeQuantizedEmbedding,)
    except ImportError:
        pass
    patterns = [re.compile(p) for p in skip]
    groups = _candidates(model, embeddings, patterns, linear, embedding).values()

    def columns(name: str, module: nn.Module) -> int:  # from the full weights: a ZeRO-3
        return int(state[f"{name}.weight"].shape[1])  # module's own are released

    return [[name for name, _ in g] for g in fitting(groups, scheme, [], columns)]


def write_quantized_state(
    state: dict[str, torch.Tensor],
    model: nn.Module,
    scheme: QuantScheme,
    path: Path,
    *,
    embeddings: bool = True,
    modules_to_not_convert: list[str] | tuple[str, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Write ``state`` (the full weights of ``model``, keyed like its ``state_dict()``) to
    ``path`` in the quantized format; return the quantized layers' names."""
    groups = _trained_layers(model, state, scheme, embeddings, list(modules_to_not_convert))
    out: dict[str, torch.Tensor] = {}
    replaced: dict[str, list[str]] = {}  # first layer -> its stored tensors' names
    dropped: set[str] = set()
    for names in groups:
        first = names[0]
        weight = state[f"{first}.weight"]
        replaced[first] = []
        for kind, t in quantize(weight, scheme).tensors().items():
            keep = t if kind == "qweight" else t.to(dtype)
            replaced[first].append(f"{first}.{kind}")
            out[f"{first}.{kind}"] = keep
        dropped.update(f"{n}.weight" for n in names)
    ordered: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in dropped:
            layer = name[: -len(".weight")]
            for stored in replaced.get(layer, []):
                ordered[stored] = out[stored]
            continue
        ordered[name] = t.to(dtype) if t.is_floating_point() else t
    modules = [n for names in groups for n in names]
    entries: list[tuple[str, torch.dtype, list[int]]] = [
        (n, t.dtype, list(t.shape)) for n, t in ordered.items()
    ]
    stream_safetensors(path, entries, iter(ordered.values()), quant_meta(scheme, modules))
    return modules
