"""Weight-only int8 / int4 quantization in one process: the arithmetic against torchao's (which
this project did not write), the stored format, the quantized layers and their kernels, the
swap into a model, and quantization-aware training through the training engine."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

import ds_strategy
from ds_strategy.config import ConfigError, load_config
from ds_strategy.core.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantScheme,
    dequantize,
    prepare_qat,
    quantize,
    quantize_modules,
)
from ds_strategy.core.quant.export import QUANT_META
from ds_strategy.core.quant.modules import resolve_kernel
from ds_strategy.core.quant.scheme import unpack
from ds_strategy.demos import GPT, GPTConfig, gpt_loss
from tests.models import ToyLM

SCHEMES = [
    QuantScheme(8),
    QuantScheme(8, symmetric=False),
    QuantScheme(4, 32),
    QuantScheme(4, 64),
    QuantScheme(4, 128, symmetric=False),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_rounding_is_within_half_a_step_and_the_format_holds(scheme: QuantScheme) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.rand(48, 1)  # rows of very different ranges
    w[3] = 0.0  # an all-zero row stays zero (its scale is clamped, not 0/0)
    qw = quantize(w, scheme)
    g = scheme.group(256)
    assert qw.qweight.dtype == scheme.qdtype
    assert qw.qweight.shape == (48, 256 * scheme.bits // 8)
    assert qw.scales.shape == (48, 256 // g)
    assert (qw.zeros is None) == scheme.symmetric
    back = dequantize(qw, scheme, torch.float32)
    step = qw.scales.repeat_interleave(g, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert back[3].abs().max() == 0
    q = unpack(qw.qweight, scheme)
    levels = 1 << scheme.bits
    if scheme.bits == 8 and scheme.symmetric:
        assert q.min() >= -128 and q.max() <= 127
    else:
        assert q.min() >= 0 and q.max() < levels
    # packing: column 2j in the low nibble, 2j + 1 in the high one
    if scheme.bits == 4:
        assert torch.equal(qw.qweight[:, 0] & 0xF, q[:, 0].to(torch.uint8))
        assert torch.equal(qw.qweight[:, 0] >> 4, q[:, 1].to(torch.uint8))


@pytest.mark.parametrize(("bits", "group"), [(8, None), (4, 32), (4, 64), (4, 128)])
def test_symmetric_rounding_equals_torchaos_fake_quantization(bits: int, group: int | None) -> None:
    """torchao's QAT fake quantizer and this module's quantize -> dequantize agree value for
    value, so what QAT trains with (torchao's) is what the export stores (ours)."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.05
    dtype = torch.int8 if bits == 8 else torch.int4
    if group is None:
        config = IntxFakeQuantizeConfig(dtype, "per_channel", is_symmetric=True)
    else:
        config = IntxFakeQuantizeConfig(dtype, group_size=group, is_symmetric=True)
    theirs = IntxFakeQuantizer(config)(w)
    scheme = QuantScheme(bits, group or 64)
    ours = dequantize(quantize(w, scheme), scheme, torch.float32)
    assert torch.equal(theirs, ours)


def test_asymmetric_rounding_follows_the_float_zero_point_form() -> None:
    """``w' = (q - 2^(b-1)) * scale + zero`` with ``zero = min + scale * 2^(b-1)``: the form
    torch's int4 matmul kernel reads (checked against it on one group)."""
    torch.manual_seed(2)
    w = torch.randn(32, 64)
    s = QuantScheme(4, 32, symmetric=False)
    qw = quantize(w, s)
    q = unpack(qw.qweight, s).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([qw.scales.t(), qw.zeros.t()], dim=-1).contiguous()  # type: ignore[union-attr]
    x = torch.randn(3, 64)
    kernel = torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)
    assert torch.allclose(kernel, x @ dequantize(qw, s, torch.float32).t(), atol=1e-4)


def test_the_kernels_agree() -> None:
    torch.manual_seed(3)
    lin = nn.Linear(128, 96)
    x = torch.randn(5, 7, 128)
    outs = {}
    for kernel in ("torchao", "torch", "dequantize"):
        m = nn.Sequential(nn.Linear(128, 96))
        m[0].load_state_dict(lin.state_dict())
        quantize_modules(m, QuantScheme(8), kernel=kernel)
        assert isinstance(m[0], QuantizedLinear) and m[0].kernel == kernel
        outs[kernel] = m(x)
    assert torch.allclose(outs["torchao"], outs["dequantize"], atol=1e-5)
    assert torch.allclose(outs["torch"], outs["dequantize"], atol=1e-4)
    assert F.cosine_similarity(outs["dequantize"].flatten(), lin(x).flatten(), 0) > 0.999
    assert resolve_kernel(None, QuantScheme(8)) == "torchao"  # torchao is installed here
    assert resolve_kernel(None, QuantScheme(4)) == "dequantize"
    with pytest.raises(ValueError, match="quantization.kernel='torchao' computes with 8-bit"):
        resolve_kernel("torchao", QuantScheme(4))


def test_the_swap_keeps_ties_skips_what_it_must_and_names_it() -> None:
    torch.manual_seed(4)
    model = ToyLM(vocab=64, d=32)
    x = torch.randint(0, 64, (2, 9))
    ref = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = quantize_modules(model, QuantScheme(4, 32), modules_to_not_convert=["frozen"])
    # the tied embedding and head share one quantized table
    assert isinstance(model.embed, QuantizedEmbedding) and isinstance(model.head, QuantizedLinear)
    assert model.head.qweight is model.embed.qweight and model.head.scales is model.embed.scales
    # MultiheadAttention reads out_proj.weight itself: its out_proj stays a Linear subclass
    assert type(model.attn.out_proj).__name__ == "NonDynamicallyQuantizableLinear"
    assert type(model.frozen_proj) is nn.Linear  # excluded by name
    # fc1's 32 inputs fit group 32; fc2's 95 do not and stay in full precision, with a warning
    assert isinstance(model.blocks[0].fc1, QuantizedLinear)
    assert type(model.blocks[0].fc2) is nn.Linear and "blocks.0.fc2" in plan.skipped
    assert any("kept in full precision" in str(w.message) for w in caught)
    assert plan.weights["head"] == "embed.weight"
    out = model(x)
    assert F.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.98


def test_quantization_config_is_checked() -> None:
    cfg = load_config({"quantization": {"bits": 4, "group_size": 32, "symmetric": False}})
    assert (cfg.quantization.bits, cfg.quantization.group_size) == (4, 32)
    with pytest.raises(ConfigError, match="quantization.bits"):
        load_config({"quantization": {"bits": 3}})
    with pytest.raises(ConfigError, match="qat trains with fake-quantized weights"):
        load_config({"quantization": {"qat": True}})
    with pytest.raises(ConfigError, match=r"modules_to_not_convert\[0\]"):
        load_config({"quantization": {"bits": 8, "modules_to_not_convert": ["("]}})
    with pytest.raises(ConfigError, match="list of strings"):
        load_config({"quantization": {"bits": 8, "modules_to_not_convert": "lm_head"}})
    with pytest.raises(ConfigError, match="did you mean 'group_size'"):
        load_config({"quantization": {"bits": 8, "group_sise": 32}})


def test_qat_swaps_layers_around_the_same_parameters_and_passes_gradients() -> None:
    torch.manual_seed(5)
    for use_torchao in (True, False):
        model = GPT(GPTConfig(vocab=48, d=64, layers=1, heads=2, seq=16))
        before = {name: id(p) for name, p in model.named_parameters()}
        done = prepare_qat(model, QuantScheme(4, 32), use_torchao=use_torchao)
        assert set(done.values()) == {"torchao" if use_torchao else "ds_strategy"}
        assert {name: id(p) for name, p in model.named_parameters()} == before
        assert model.head.weight is model.wte.weight
        loss = gpt_loss(model, torch.randint(0, 48, (2, 17)))
        loss.backward()
        assert model.blocks[0].qkv.weight.grad is not None
        assert model.blocks[0].qkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("stage", [0, 3])
def test_qat_trains_through_the_engine_and_exports_what_it_trained(
    stage: int, tmp_path: Path
) -> None:
    """A model trained with fake-quantized weights computes, after ``save_quantized`` and
    ``init_inference``, what it computed in training (the same integers)."""
    torch.manual_seed(6)
    cfg = GPTConfig(vocab=48, d=64, layers=2, heads=2, seq=16)
    model = GPT(cfg)
    quant = {"bits": 4, "group_size": 32, "qat": True}
    engine = ds_strategy.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        {
            # every weight sharded at stage 3: the export reads shapes from the gathered state
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "quantization": quant,
        },
    )
    assert engine.qat and set(engine.qat) >= {"wte", "head", "blocks.0.qkv"}
    losses = []
    batch = torch.randint(0, 48, (4, 17))
    for _ in range(6):
        loss = gpt_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    path = engine.save_quantized(tmp_path / "q.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()[QUANT_META])
        assert meta["bits"] == 4 and "blocks.1.fc" in meta["modules"]
        keys = set(f.keys())  # noqa: SIM118 - safe_open is not a container
        assert "blocks.1.fc.qweight" in keys and "blocks.1.fc.weight" not in keys
        assert f.get_tensor("blocks.1.fc.qweight").dtype == torch.uint8
    x = torch.randint(0, 48, (3, 12))
    with torch.no_grad():
        trained = engine(x)
    served = ds_strategy.init_inference(lambda: GPT(cfg), checkpoint=path)
    assert isinstance(served.module.blocks[1].fc, QuantizedLinear)
    assert torch.allclose(served(x), trained, atol=1e-5)
    with pytest.raises(ValueError, match="quantization.qat with tensor_parallel"):
        ds_strategy.core.assembly._prepare_qat(GPT(cfg), engine.config, tp=2)
