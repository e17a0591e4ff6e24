"""The demo GPT with DeepSpeed-style mixture-of-experts layers in place of its MLPs.

Each block's MLP becomes the template of an :class:`~ds_strategy.moe.MoE` layer: every expert
starts as a copy of it (as DeepSpeed's experts copy the module they are given), and the
router is initialised like the GPT's other layers. Building the layers with ``ep_size=1``
(the default) gives the same model on every rank whatever the expert-parallel size; the
engine's ``moe.ep_size`` then keeps each rank's own experts. The loss adds
``aux_loss_coef`` times the blocks' load-balancing losses (:meth:`MoEGPT.loss`).

>>> model = MoEGPT(GPTConfig(vocab=32, d=16, layers=1, heads=2, seq=8), num_experts=4, k=2)
>>> tokens = torch.randint(0, 32, (2, 8))
>>> float(model.loss(tokens).detach()) > 0
True
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from ..core.moe import MoE
from .gpt import GPT, Block, GPTConfig

__all__ = ["MoEGPT"]


class _MLP(nn.Module):
    def __init__(self, fc: nn.Linear, out: nn.Linear) -> None:
        super().__init__()
        self.fc, self.out = fc, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class _MoEBlock(Block):
    """A block whose MLP is a mixture of experts; it keeps its layer's last ``l_aux``."""

    moe: MoE

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, _ = self.moe(x)
        return out


class MoEGPT(GPT):
    """The demo GPT, every block's MLP a mixture of ``num_experts`` experts.

    Args:
        c: the GPT's sizes.
        num_experts: experts in each layer.
        k: experts a token.
        ep_size: ranks the layers' experts are spread over (see the module note).
        aux_loss_coef: the weight of the load-balancing losses in :meth:`loss`.
        **moe: the rest of ``MoE``'s arguments (``capacity_factor``, ``drop_tokens``...).
    """

    def __init__(
        self,
        c: GPTConfig,
        num_experts: int = 4,
        k: int = 1,
        ep_size: int = 1,
        aux_loss_coef: float = 0.01,
        **moe: Any,
    ) -> None:
        super().__init__(c)
        self.aux_loss_coef = aux_loss_coef
        for block in self.blocks:
            assert isinstance(block, Block)
            template = _MLP(block.fc, block.out)
            del block.fc, block.out
            layer = MoE(c.d, template, num_experts, ep_size, k, **moe)
            nn.init.normal_(layer.deepspeed_moe.gate.wg.weight, std=0.02)
            block.__class__ = _MoEBlock
            block.moe = layer
            block.l_aux = torch.zeros(())

    def l_aux(self) -> torch.Tensor:
        """The sum of the blocks' load-balancing losses from the last forward."""
        return torch.stack([cast(_MoEBlock, b).l_aux for b in self.blocks]).sum()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over ``tokens`` plus the weighted load-balancing loss.

        Args:
            tokens: ``(batch, seq)`` token ids.
        """
        logits = self(tokens[:, :-1])
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )
        return ce + self.aux_loss_coef * self.l_aux()
