"""The recipes' model: the package's demo GPT (``ds_strategy/demos/gpt.py``: pre-norm blocks in an
``nn.ModuleList``, each one ZeRO-3 unit; causal attention; tied embedding and head) over
characters, its loss and a sampler. Plain PyTorch; nothing here knows about ds_strategy."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ds_strategy.demos.gpt import GPT, GPTConfig


def build_model(vocab: int, cfg: Any) -> GPT:
    """The package's demo GPT (``ds_strategy/demos/gpt.py``) sized by a ``model`` config node."""
    return GPT(GPTConfig(vocab, cfg.d, cfg.layers, cfg.heads, cfg.seq, cfg.tie_embeddings))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy of a batch of windows ``(batch, seq + 1)``."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def generate(
    model: GPT, prompt: torch.Tensor, n: int, temperature: float = 0.8, seed: int = 0
) -> torch.Tensor:
    """Sample ``n`` tokens after ``prompt`` (1-D), one at a time."""
    gen = torch.Generator().manual_seed(seed)
    idx = prompt.view(1, -1)
    for _ in range(n):
        logits = model(idx[:, -model.config.seq :])[0, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return idx[0, prompt.numel() :]
