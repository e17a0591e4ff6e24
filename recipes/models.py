"""A character-level GPT for the recipes: pre-norm blocks in an ``nn.ModuleList`` (each block
becomes one ZeRO-3 unit), causal attention, tied embedding and head. Plain PyTorch; nothing
here knows about ds_strategy."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"model.d={d} must be divisible by model.heads={heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    def __init__(
        self, vocab: int, d: int, layers: int, heads: int, seq: int, tie_embeddings: bool = True
    ) -> None:
        super().__init__()
        self.seq = seq
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie_embeddings:
            self.head.weight = self.wte.weight
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(vocab: int, cfg: Any) -> CharGPT:
    """A :class:`CharGPT` from a ``model`` config node."""
    return CharGPT(vocab, cfg.d, cfg.layers, cfg.heads, cfg.seq, cfg.tie_embeddings)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy of a batch of windows ``(batch, seq + 1)``."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def generate(
    model: CharGPT, prompt: torch.Tensor, n: int, temperature: float = 0.8, seed: int = 0
) -> torch.Tensor:
    """Sample ``n`` tokens after ``prompt`` (1-D), one at a time."""
    gen = torch.Generator().manual_seed(seed)
    idx = prompt.view(1, -1)
    for _ in range(n):
        logits = model(idx[:, -model.seq :])[0, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return idx[0, prompt.numel() :]
