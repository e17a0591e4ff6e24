"""Small models that exercise what real models do to a sharding engine."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 3 * d - 1)  # odd sizes: shards straddle parameters
        self.fc2 = nn.Linear(3 * d - 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class ToyLM(nn.Module):
    """Tied embedding/head, a ModuleList of blocks, an attention layer whose forward reads
    ``out_proj.weight`` without calling ``out_proj``, a block applied twice, a frozen
    parameter, a buffer, and a parameter that never gets a gradient."""

    def __init__(self, vocab: int = 37, d: int = 24, n_blocks: int = 3, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        # No biases: the key bias has a mathematically zero gradient (softmax is shift-invariant),
        # whose float noise Adam would amplify into differences unrelated to sharding.
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=False)
        self.frozen_proj = nn.Linear(d, d)
        self.frozen_proj.requires_grad_(False)
        self.unused = nn.Linear(d, 5)  # never called: its parameters get no gradient
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))

    def reset_parameters(self) -> None:
        """The buffer's value again: what builds it on the meta device calls this."""
        with torch.no_grad():
            self.scale.fill_(0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[0](h)  # the same block called a second time
        a, _ = self.attn(h, h, h, need_weights=False)
        h = h + a + self.scale * self.frozen_proj(h)
        return self.head(h)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with their own hyper-parameters."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    if kind == "adamw":
        return torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": 0.1},
                {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3},
            ],
            lr=1e-2,
        )
    if kind.startswith("onebit"):  # "onebitadam@5": a 1-bit optimizer frozen after 5 steps
        from ds_strategy.core.optim import OneBitAdam, OneBitLamb

        name, _, freeze = kind.partition("@")
        dense = make_optimizer({"onebitadam": "adamw", "onebitlamb": "lamb"}[name], model)
        keep = ("params", "lr", "weight_decay", "betas")  # the dense twin's hyper-parameters
        groups = [{k: g[k] for k in keep} for g in dense.param_groups]
        cls = {"onebitadam": OneBitAdam, "onebitlamb": OneBitLamb}[name]
        return cls(groups, freeze_step=int(freeze or 10**9))
    if kind == "adamw-nobc" or kind.startswith("zeroone@"):
        # DeepSpeed's FusedAdam without bias correction, and 0/1 Adam (which applies none)
        # "zeroone@F,V,L,H": var_freeze_step, var_update_scaler, local_step_scaler/_clipper
        from ds_strategy.core.optim import Adam, ZeroOneAdam

        # a tenth of AdamW's rates: without bias correction the first steps are ~3 x lr
        # sign steps, which turn the rounding differences of two loops into visible ones
        groups = [{"params": g["params"], "lr": g["lr"] / 10, "weight_decay": g["weight_decay"]}
                  for g in make_optimizer("adamw", model).param_groups]  # fmt: skip
        if kind == "adamw-nobc":
            return Adam(groups, bias_correction=False)
        f, v, ls, lc = (int(x) for x in kind.partition("@")[2].split(","))
        return ZeroOneAdam(groups, var_freeze_step=f, var_update_scaler=v,
                           local_step_scaler=ls, local_step_clipper=lc)  # fmt: skip
    if kind == "lamb":
        from ds_strategy.core.optim import Lamb

        return Lamb(
            [
                {"params": decay, "weight_decay": 0.01},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=0.02,
            betas=(0.9, 0.99),
        )
    if kind == "sgd":
        return torch.optim.SGD(
            [{"params": decay, "weight_decay": 1e-3}, {"params": no_decay, "lr": 0.05}],
            lr=0.1,
            momentum=0.9,
        )
    raise ValueError(kind)


def batches(
    steps: int, micro: int, global_batch: int, seq: int = 9, vocab: int = 37, seed: int = 0
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq), generator=g) for _ in range(steps * micro)]
