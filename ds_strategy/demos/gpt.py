"""A demo module of ds_strategy: a small GPT (pre-norm blocks in an ``nn.ModuleList``, each one
a ZeRO-3 unit; causal attention; tied embedding/head), its initialisation and loss, for the
example, the recipes and the benchmarks. Plain PyTorch; imports only torch and the stdlib."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    d: int = 512
    layers: int = 8
    heads: int = 8
    seq: int = 128
    tie_embeddings: bool = True  # the head reuses the token embedding's weight

    def __post_init__(self) -> None:
        for name in ("vocab", "d", "layers", "heads", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.d % self.heads:
            raise ValueError(f"GPTConfig.d ({self.d}) must be a multiple of heads ({self.heads})")


class KVCache:
    """Keys and values of the tokens a generation has seen, one ``(k, v)`` per block, so each
    new token attends to them without recomputing them (``GPT.forward(idx, cache=...)``)."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.length = 0  # tokens cached so far

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.layers[i] if i < len(self.layers) else None

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        while len(self.layers) <= i:
            self.layers.append(None)
        self.layers[i] = (k, v)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        if c.d % c.heads:
            raise ValueError(f"d={c.d} must be divisible by heads={c.heads}")
        self.heads = c.heads
        self.head_dim = c.d // c.heads
        self.ln1 = nn.LayerNorm(c.d)
        self.qkv = nn.Linear(c.d, 3 * c.d)
        self.proj = nn.Linear(c.d, c.d)
        self.ln2 = nn.LayerNorm(c.d)
        self.fc = nn.Linear(c.d, 4 * c.d)
        self.out = nn.Linear(4 * c.d, c.d)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, index: int = 0
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # qkv's outputs are laid out head by head (q, k, v of head 0, then of head 1, ...), so
        # a tensor-parallel split of them gives each rank whole heads: the head count is read
        # from the tensor, not assumed
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        )
        past = cache.layer(index) if cache is not None else None
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        if cache is not None:
            cache.store(index, k, v)
        start = k.shape[2] - t  # tokens before these
        if start == 0 or t == 1:  # causal from the start, or one new token that sees all
            a = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(start)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward part, on normalised tokens."""
        return self.out(F.gelu(self.fc(x)))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.d)
        self.wpe = nn.Embedding(c.seq, c.d)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.d)
        self.head = nn.Linear(c.d, c.vocab, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.wte.weight
        self.apply(init_weights)

    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of every position of ``idx``; with ``cache`` (generation), ``idx`` continues
        the tokens the cache holds, and their keys and values are added to it.
        ``position_ids``: where the tokens sit in their sequences (a block of a sequence split
        across ranks); by default they start at 0, or after the cached tokens."""
        start = cache.length if cache is not None else 0
        if position_ids is None:
            end = start + idx.shape[1]
            position_ids = torch.arange(start, end, device=idx.device)
        else:  # a block of a longer sequence: its last position must have an embedding
            end = int(position_ids.max()) + 1 if position_ids.numel() else 0
        if end > self.config.seq:
            raise ValueError(
                f"{end} positions: this GPT has {self.config.seq} "
                "(GPTConfig.seq); keep prompt plus generated tokens within it"
            )
        x = self.wte(idx) + self.wpe(position_ids)
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache, i)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.head(self.ln_f(x))

    def new_cache(self) -> KVCache:
        """An empty KV cache for generation (``forward(idx, cache=...)``)."""
        return KVCache()


class _Embed(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class _Head(nn.Module):
    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def as_sequential(model: GPT) -> nn.Sequential:
    """The same modules as layers (embeddings, each block, final norm and head), for pipeline
    stages; the model must not tie its head to the embedding."""
    if model.config.tie_embeddings:
        raise ValueError("as_sequential: build the GPT with tie_embeddings=False")
    return nn.Sequential(_Embed(model.wte, model.wpe), *model.blocks, _Head(model.ln_f, model.head))


def gpt_layers(**config: Any) -> nn.Sequential:
    """A GPT (``GPTConfig`` keywords; the head untied) as pipeline layers: a factory for
    ``ds-strategy estimate --model ds_strategy.demos.gpt:gpt_layers --pipeline-stages N``."""
    return as_sequential(GPT(GPTConfig(**{**config, "tie_embeddings": False})))


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation (N(0, 0.02), zero biases); usable as a ``param_init_fn``."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def split_text(text: str, holdout: float) -> tuple[str, str]:
    """The text to train on and the held-out tail (its last ``holdout`` fraction)."""
    cut = len(text) - int(len(text) * holdout)
    return text[:cut], text[cut:]


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, seq: int, batch: int = 16) -> float:
    """exp(mean next-token cross-entropy) of ``model`` over ``tokens`` (1-D), read in
    consecutive windows of ``seq`` predictions (the last partial window dropped)."""
    n = (tokens.numel() - 1) // seq
    if n == 0:
        raise ValueError(f"perplexity: {tokens.numel()} tokens are fewer than seq+1={seq + 1}")
    windows = tokens[: n * seq + 1].unfold(0, seq + 1, seq)
    total = 0.0
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        logits = model(chunk[:, :-1]).float()
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        ).item()
    return float(torch.tensor(total / (n * seq)).exp())


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
