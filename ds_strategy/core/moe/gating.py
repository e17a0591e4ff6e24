"""DeepSpeed-MoE's gating, as ``deepspeed.moe.sharded_moe`` defines it.

A gate turns router logits (tokens x experts, in fp32) into a :class:`Routing`: each
token's experts and combine weights, the load-balancing loss ``l_aux`` and the tokens
each expert was chosen by (``exp_counts``, before any is dropped).

[Note: capacity and dropped tokens]
With ``drop_tokens`` an expert takes at most ``capacity`` tokens:
``max(ceil(S / E * capacity_factor * k), min_capacity)`` for ``S`` tokens, ``E`` experts and
``k`` experts a token. Which tokens it keeps follows DeepSpeed:

- top-1: with ``use_rts`` a random priority (Random Token Selection); without it the first
  tokens in order. (DeepSpeed then ranks equal priorities by ``topk``, whose order among
  ties is the kernel's; the first ones is the order that does not depend on it.)
- top-2: every token's first choice in token order, then the second choices after all of
  them; the weights of a token's kept choices are renormalised to sum to 1.
- top-k (k > 2): ``drop_policy="probs"`` keeps the tokens with the highest router
  logit, ``"position"`` the first ones; kept weights are renormalised.

Without ``drop_tokens`` no token is dropped (DeepSpeed pads every expert to the largest
load instead, which changes no output). A dropped choice has expert ``-1`` and weight 0.

>>> logits = torch.tensor([[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
>>> r = top1(logits, capacity_factor=1.0, min_capacity=1, use_rts=False)  # capacity 2
>>> r.experts.view(-1).tolist(), r.exp_counts.tolist()
([0, 0, -1, 1], [3, 1])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = ["Routing", "capacity", "top1", "top2", "topk"]


@dataclass(frozen=True)
class Routing:
    """Where each of ``S`` tokens goes.

    Attributes:
        experts: ``(S, k)`` expert indices; ``-1`` where a choice was dropped.
        weights: ``(S, k)`` combine weights (0 where dropped).
        l_aux: the load-balancing loss.
        exp_counts: tokens that chose each expert, before dropping (``(E,)``, int64).
    """

    experts: torch.Tensor
    weights: torch.Tensor
    l_aux: torch.Tensor
    exp_counts: torch.Tensor


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """Tokens an expert takes at most: ``max(ceil(tokens / experts * factor), min_capacity)``.

    Args:
        tokens: tokens routed in this call.
        experts: experts in the layer.
        factor: the capacity factor, times ``k`` for top-k gating.
        min_capacity: the floor.

    >>> capacity(10, 4, 1.0, 1), capacity(10, 4, 2.0, 8)
    (3, 8)
    """
    return max(math.ceil(tokens / experts * factor), min_capacity)


def _first_come(mask: torch.Tensor, cap: int, before: torch.Tensor | None = None) -> torch.Tensor:
    """``mask`` (S x E, 0/1) keeping each expert's first ``cap`` tokens, after ``before``'s."""
    place = torch.cumsum(mask, dim=0) - 1
    if before is not None:
        place = place + before.sum(dim=0, keepdim=True)
    return mask * (place < cap)


def _routing(
    masks: list[torch.Tensor], weights: list[torch.Tensor], l_aux: torch.Tensor, counts
) -> Routing:
    chosen = torch.stack([m.argmax(dim=1) for m in masks], dim=1)
    kept = torch.stack([m.sum(dim=1) > 0 for m in masks], dim=1)
    w = torch.stack(weights, dim=1)
    return Routing(torch.where(kept, chosen, -1), w * kept, l_aux, counts.to(torch.int64))


def top1(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> Routing:
    """DeepSpeed's ``top1gating``: each token to its most probable expert, weighted by that
    probability (not renormalised); ``l_aux = E * sum(mean gate * mean load)``.

    Args:
        logits: ``(S, E)`` router logits, fp32.
        capacity_factor: see [Note: capacity and dropped tokens].
        min_capacity: the least capacity.
        used_token: ``(S,)`` 1 for tokens to route, 0 for the others (padding).
        noisy_gate_policy: ``"RSample"`` picks by logits plus Gumbel noise.
        drop_tokens: enforce the capacity.
        use_rts: Random Token Selection among an expert's tokens.
    """
    gates = F.softmax(logits, dim=1)
    num_experts = gates.shape[1]
    pick = gates
    if noisy_gate_policy == "RSample":
        pick = logits + _gumbel(logits)
    mask1 = F.one_hot(pick.argmax(dim=1), num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.view(-1, 1).to(mask1.dtype)
    counts = mask1.sum(dim=0)
    l_aux = torch.sum(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts
    if drop_tokens:
        cap = capacity(gates.shape[0], num_experts, capacity_factor, min_capacity)
        if use_rts:
            priority = mask1 * torch.rand(mask1.shape, device=mask1.device)
            top = torch.topk(priority, k=min(cap, priority.shape[0]), dim=0).indices
            mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top, 1)
        else:
            mask1 = _first_come(mask1, cap)
    weight = (gates * mask1).sum(dim=1)
    return _routing([mask1], [weight], l_aux, counts)


def top2(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    second_expert_sampling: bool = True,
) -> Routing:
    """DeepSpeed's ``top2gating``: the most probable expert, and a second chosen by logits
    (plus Gumbel noise with ``second_expert_sampling``); the two weights renormalised;
    ``l_aux = E * E * mean(mean gate * mean first-choice load)``.

    Args:
        logits: ``(S, E)`` router logits, fp32.
        capacity_factor: see [Note: capacity and dropped tokens] (doubled for two choices).
        min_capacity: the least capacity.
        drop_tokens: enforce the capacity.
        second_expert_sampling: DeepSpeed's ``top2_2nd_expert_sampling`` (training only).
    """
    gates = F.softmax(logits, dim=1)
    num_experts = gates.shape[1]
    mask1 = F.one_hot(gates.argmax(dim=1), num_experts)
    second = logits + _gumbel(logits) if second_expert_sampling else logits
    mask2 = F.one_hot(second.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1), num_experts)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    counts = (mask1 + mask2).sum(dim=0)
    if drop_tokens:
        cap = capacity(gates.shape[0], num_experts, 2 * capacity_factor, min_capacity)
        mask1, mask2 = _first_come(mask1, cap), _first_come(mask2, cap, before=mask1)
    g1, g2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    return _routing([mask1, mask2], [g1 / denom, g2 / denom], l_aux, counts)


def topk(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    drop_policy: str = "probs",
) -> Routing:
    """DeepSpeed's ``topkgating``: the ``k`` largest logits, their probabilities renormalised;
    ``l_aux = E * E / k * mean(mean gate * mean load)``.

    Args:
        logits: ``(S, E)`` router logits, fp32.
        k: experts a token.
        capacity_factor: see [Note: capacity and dropped tokens] (times ``k``).
        min_capacity: the least capacity.
        drop_tokens: enforce the capacity.
        drop_policy: ``"probs"`` or ``"position"`` (which tokens an expert keeps).
    """
    gates = F.softmax(logits, dim=1)
    num_experts = gates.shape[1]
    top_logits, top_idx = torch.topk(logits, k=k, dim=1)
    mask = torch.zeros_like(gates).scatter_(1, top_idx, 1)
    counts = mask.sum(dim=0)
    l_aux = torch.mean(gates.mean(dim=0) * mask.mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        cap = capacity(gates.shape[0], num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            # DeepSpeed ranks an expert's tokens by their chosen logits (0 where not chosen)
            scored = torch.zeros_like(gates).scatter(1, top_idx, top_logits)
            keep = torch.topk(scored, k=min(cap, gates.shape[0]), dim=0).indices
            mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
        elif drop_policy == "position":
            mask = _first_come(mask, cap)
        else:
            raise ValueError(f"drop_policy={drop_policy!r}: choose 'probs' or 'position'")
    masked = gates * mask
    masked = masked / torch.clamp(
        masked.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps
    )
    kept = mask.gather(1, top_idx) > 0
    weights = masked.gather(1, top_idx)
    return Routing(torch.where(kept, top_idx, -1), weights * kept, l_aux, counts.to(torch.int64))


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(torch.rand_like(like).clamp_min(1e-20)).clamp_min(1e-20))
