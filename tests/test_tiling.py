"""The ``tiling`` section: a transformers causal LM's loss and its MLPs computed over tiles of
tokens. In one process: the same loss and gradients as without tiles, the logits never whole
(what autograd keeps shrinks by more than their bytes), calls without labels untouched, and
bad choices refused naming the key. Under ZeRO-3 with sequence parallelism, the engine's
training is checked against one process in ``test_sequence_parallel.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_strategy.config import ConfigError
from ds_strategy.config._schema import TilingConfig
from ds_strategy.core.activation_checkpointing import SavedTensorMeter
from ds_strategy.core.sequence import apply_tiling, tiled_cross_entropy
from ds_strategy.demos.gpt import GPT, GPTConfig

pytest.importorskip("transformers")

SEQ, VOCAB = 48, 512


def _llama() -> nn.Module:
    from transformers import LlamaForCausalLM

    from tests.inference_common import llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(vocab_size=VOCAB))


def _loss_and_grads(model: nn.Module, tokens: torch.Tensor) -> tuple[float, dict, int]:
    model.zero_grad()
    with SavedTensorMeter(model) as meter:
        out = model(input_ids=tokens, labels=tokens)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.item(), grads, meter.bytes


def test_tiled_loss_and_mlps_give_the_loss_and_gradients_of_the_whole_sequence() -> None:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    plain = _llama()
    want_loss, want_grads, whole_saved = _loss_and_grads(plain, tokens)
    tiled = _llama()
    # a short last tile; twice, as an engine built again on the same model does: tiled once
    for _ in range(2):
        apply_tiling(tiled, TilingConfig(loss=True, mlp=True, tokens=7))
    loss, grads, saved = _loss_and_grads(tiled, tokens)
    assert loss == pytest.approx(want_loss, abs=1e-6)
    for name, want in want_grads.items():
        assert torch.allclose(grads[name], want, atol=1e-6), name
    # the logits (and their log-softmax) and each layer's MLP activations are not kept
    logits = 2 * SEQ * VOCAB * 4
    assert saved < whole_saved - logits, (saved, whole_saved)
    out = tiled(input_ids=tokens, labels=tokens)
    assert out.logits is None and out.loss is not None
    # without labels (generation, evaluation of logits) the model answers as it always did
    with torch.no_grad():
        assert torch.equal(tiled(input_ids=tokens).logits, plain(input_ids=tokens).logits)


def test_the_loss_divides_by_the_count_a_caller_gives() -> None:
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[0, :10] = -100
    plain, tiled = _llama(), _llama()
    apply_tiling(tiled, TilingConfig(loss=True, tokens=16))
    for items in (None, torch.tensor(100)):
        kwargs = {} if items is None else {"num_items_in_batch": items}
        want = plain(input_ids=tokens, labels=labels, **kwargs).loss
        got = tiled(input_ids=tokens, labels=labels, **kwargs).loss
        assert got.item() == pytest.approx(want.item(), abs=1e-6), items


def test_tiled_cross_entropy_keeps_no_logits_for_backward() -> None:
    head = nn.Linear(16, 1000, bias=False)
    hidden = torch.randn(1, 256, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (1, 256))
    with SavedTensorMeter(head) as whole:
        want = nn.functional.cross_entropy(head(hidden).flatten(0, 1), labels[0], reduction="sum")
    with SavedTensorMeter(head) as tiles:
        got = tiled_cross_entropy(hidden, head, labels, tokens=32)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert whole.bytes >= 256 * 1000 * 4  # the logits' log-softmax
    assert tiles.bytes <= hidden.numel() * 4 + labels.numel() * 8  # the inputs' views only
    (g_want,) = torch.autograd.grad(want, hidden)
    (g_got,) = torch.autograd.grad(got, hidden)
    assert torch.allclose(g_got, g_want, atol=1e-5)


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_what_cannot_be_tiled_is_refused_naming_the_key() -> None:
    gpt = GPT(GPTConfig(vocab=64, d=32, layers=1, heads=4, seq=16))
    with pytest.raises(ConfigError, match="tiling.loss: GPT holds no transformers causal LM"):
        apply_tiling(gpt, TilingConfig(loss=True))
    with pytest.raises(ConfigError, match="tiling.mlp: 'mlp' chose no module of GPT"):
        apply_tiling(gpt, TilingConfig(mlp=True))
    with pytest.raises(ConfigError, match="'blocks' would tile whole blocks"):
        apply_tiling(gpt, TilingConfig(mlp=True, mlp_modules="blocks"))
    moe = nn.Module()  # a mixture of experts named mlp routes over the whole batch
    moe.mlp = nn.Module()
    moe.mlp.experts = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ConfigError, match="tiling.mlp: 'mlp' chose no module of Module"):
        apply_tiling(moe, TilingConfig(mlp=True))
    # a chosen module whose output is not one tensor a token fails at its first forward
    pairs = nn.Sequential(_Pair())
    apply_tiling(pairs, TilingConfig(mlp=True, mlp_modules="type:_Pair", tokens=4))
    with pytest.raises(ConfigError, match=r"tiling.mlp: 0 \(_Pair\) does not map each token"):
        pairs(torch.randn(1, 8, 2))
    capped = _llama()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0"):
        apply_tiling(capped, TilingConfig(loss=True))
