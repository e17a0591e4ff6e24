"""Quantization-aware training: the layers an inference quantization would convert train with
fake-quantized weights (``quantization.qat: true`` in a training config).

[Note: which fake quantization]
Forward computes with ``dequantize(quantize(w))`` (``scheme.py``), backward passes the
gradient straight through to ``w`` (the straight-through estimator). Where torchao is
installed and the scheme is symmetric, the layers are torchao's ``FakeQuantizedLinear`` /
``FakeQuantizedEmbedding`` with an ``IntxFakeQuantizeConfig`` (per channel at 8 bits, per
group at 4); otherwise (asymmetric, or no torchao) the layers below, which round the same way.
Either way the weights a trained model exports (``save_quantized``, or ``init_inference``
quantizing on load) are exactly the integers training saw: ``tests/test_quant.py`` compares
torchao's fake quantization with this module's, value by value.

The swap keeps every ``nn.Parameter`` object (and so its name, its ties and the optimizer
built over it): only the module around it changes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .modules import _candidates, _quiet_import, _set_submodule, fitting
from .scheme import QuantScheme, dequantize, quantize

__all__ = ["FakeQuantEmbedding", "FakeQuantLinear", "fake_quantize", "prepare_qat"]


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``w`` rounded as ``scheme`` stores it, with the gradient passed straight through."""
    rounded = dequantize(quantize(w, scheme), scheme, w.dtype)
    return w + (rounded - w).detach()


class FakeQuantLinear(nn.Linear):
    scheme: QuantScheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quantize(self.weight, self.scheme), self.bias)


class FakeQuantEmbedding(nn.Embedding):
    scheme: QuantScheme

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        w = fake_quantize(self.weight, self.scheme)
        return F.embedding(
            idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
        )


def _ours(m: nn.Module, scheme: QuantScheme) -> nn.Module:
    cls = FakeQuantLinear if isinstance(m, nn.Linear) else FakeQuantEmbedding
    new = cls.__new__(cls)
    # same parameters, hooks and settings (their dicts copied, not shared); another forward
    new.__dict__.update({k: v.copy() if isinstance(v, dict) else v for k, v in vars(m).items()})
    new.scheme = scheme  # type: ignore[assignment]
    return new


def _torchao(m: nn.Module, scheme: QuantScheme) -> nn.Module | None:
    if not scheme.symmetric:
        return None  # torchao's asymmetric weight fake quantization rounds differently
    try:
        with _quiet_import():
            from torchao.quantization.qat import IntxFakeQuantizeConfig
            from torchao.quantization.qat.embedding import FakeQuantizedEmbedding
            from torchao.quantization.qat.linear import FakeQuantizedLinear
    except ImportError:
        return None
    dtype = torch.int8 if scheme.bits == 8 else torch.int4  # type: ignore[attr-defined]
    config: IntxFakeQuantizeConfig
    if scheme.bits == 8:
        config = IntxFakeQuantizeConfig(dtype, "per_channel", is_symmetric=True)
    else:
        config = IntxFakeQuantizeConfig(dtype, group_size=scheme.group_size, is_symmetric=True)
    if isinstance(m, nn.Linear):
        new: nn.Module = FakeQuantizedLinear.from_linear(m, weight_config=config)
        new.bias = m.bias
    else:
        new = FakeQuantizedEmbedding.from_embedding(m, weight_config=config)
    new.weight = m.weight  # the same parameter, also when the model is on the meta device
    return new


def prepare_qat(
    model: nn.Module,
    scheme: QuantScheme,
    *,
    embeddings: bool = True,
    modules_to_not_convert: list[str] | tuple[str, ...] = (),
    use_torchao: bool = True,
) -> dict[str, str]:
    """Swap the layers a quantization with these settings would convert for fake-quantized
    ones, in place; return {module name: which implementation} (``torchao`` or ``ds_strategy``)."""
    import re

    skip = [re.compile(p) for p in modules_to_not_convert]
    done: dict[str, str] = {}
    for group in fitting(_candidates(model, embeddings, skip).values(), scheme, []):
        for name, m in group:
            new = _torchao(m, scheme) if use_torchao else None
            done[name] = "ds_strategy" if new is None else "torchao"
            _set_submodule(model, name, new if new is not None else _ours(m, scheme))
    return done
