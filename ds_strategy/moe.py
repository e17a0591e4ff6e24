"""Mixture of experts with DeepSpeed-MoE's interface: ``from ds_strategy.moe import MoE`` in
place of ``from deepspeed.moe.layer import MoE``.

:class:`MoE` returns ``(output, l_aux, exp_counts)`` as DeepSpeed's does. The engine spreads
its experts over ``ep_size`` ranks (the layer's own, or the config's ``moe.ep_size``).
transformers' MoE models need no change: ``{"moe": {"ep_size": 2}}`` spreads theirs.
``split_params_into_different_moe_groups_for_optimizer`` (DeepSpeed's ``deepspeed.moe.utils``
helper) gives the experts param groups of their own.
"""

from .core.moe import (
    Experts,
    MoE,
    MOELayer,
    Routing,
    TopKGate,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
    top1,
    top2,
    topk,
)

__all__ = [
    "MOELayer",
    "Experts",
    "MoE",
    "Routing",
    "TopKGate",
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
    "top1",
    "top2",
    "topk",
]
