"""Mixture of experts: DeepSpeed-MoE's layer and gating, and expert parallelism."""

from .dispatch import exchange_rows, run_experts
from .gating import Routing, capacity, top1, top2, topk
from .layer import (
    Experts,
    MoE,
    MOELayer,
    TopKGate,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

__all__ = [
    "MOELayer",
    "Experts",
    "MoE",
    "Routing",
    "TopKGate",
    "capacity",
    "exchange_rows",
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
    "run_experts",
    "top1",
    "top2",
    "topk",
]
