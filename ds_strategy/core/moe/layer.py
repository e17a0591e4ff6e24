"""A mixture-of-experts layer with DeepSpeed-MoE's interface: ``MoE(hidden_size, expert,
num_experts, ep_size, k, ...)`` returning ``(output, l_aux, exp_counts)``.

Its parameters carry DeepSpeed's names (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<i>...``), so a DeepSpeed-MoE model script runs
with its import changed and DeepSpeed's checkpoints map onto it. Each rank builds
``num_experts / ep_size`` copies of ``expert``, as DeepSpeed does; the engine gives the layer
its expert-parallel group (``core/moe/parallel.py``). Without an engine, ``ep_size`` must be 1.

>>> layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2, drop_tokens=False)
>>> out, l_aux, counts = layer(torch.randn(2, 3, 8))
>>> out.shape, int(counts.sum())
(torch.Size([2, 3, 8]), 12)
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from ..collectives import Comm
from .dispatch import run_experts
from .gating import Routing, top1, top2, topk

__all__ = [
    "MOELayer",
    "MoE",
    "Experts",
    "TopKGate",
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
]


class TopKGate(nn.Module):
    """The router: a bias-free linear layer computed in fp32, and DeepSpeed's gating.

    Args:
        model_dim: the hidden size.
        num_experts: experts in the layer (all ranks together).
        k: experts a token.
        capacity_factor: see [Note: capacity and dropped tokens] in gating.py.
        eval_capacity_factor: the same in evaluation.
        min_capacity: the least capacity.
        noisy_gate_policy: ``None``, ``"Jitter"`` (inputs times U(0.99, 1.01)) or
            ``"RSample"`` (top-1 by logits plus Gumbel noise), in training.
        drop_tokens: enforce the capacity.
        use_rts: Random Token Selection (top-1).
        top2_2nd_expert_sampling: Gumbel noise on the second choice (top-2).
        drop_policy: ``"probs"`` or ``"position"`` (top-k, k > 2).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        drop_policy: str = "probs",
    ) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k}: a token goes to between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r}: choose None, 'Jitter' or 'RSample'"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.drop_policy = drop_policy

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        """The routing of ``input``'s tokens.

        Args:
            input: ``(S, model_dim)`` tokens.
            used_token: ``(S,)`` 1 for tokens to route (top-1 only), or None for all.
        """
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noisy = self.noisy_gate_policy if self.training else None
            return top1(
                logits, factor, self.min_capacity, used_token, noisy, self.drop_tokens, self.use_rts
            )
        if self.k == 2:
            return top2(
                logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling
            )
        return topk(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.drop_policy)


class Experts(nn.Module):
    """This rank's experts: ``num_local_experts`` copies of ``expert`` (DeepSpeed's layout).

    Their parameters are marked as DeepSpeed marks them (``allreduce = False`` and the
    expert group's ``group_name``), which :func:`split_params_into_different_moe_groups_for_optimizer`
    reads.

    Args:
        expert: the module each expert copies; maps ``(rows, hidden)`` to ``(rows, hidden)``.
        num_local_experts: copies on this rank.
        expert_group_name: DeepSpeed's name of the expert group (``ep_size_<n>``).
    """

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        for p in self.deepspeed_experts.parameters():
            p.allreduce = False  # type: ignore[attr-defined]
            p.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each row through its expert. Every expert runs, on no rows if none came, so each
        has a gradient (of zeros) as in a DeepSpeed capacity buffer.

        Args:
            rows: ``(N, hidden)`` tokens.
            local: ``(N,)`` the local expert of each row.
        """
        out: torch.Tensor | None = None
        for j, expert in enumerate(self.deepspeed_experts):
            mine = (local == j).nonzero().view(-1)
            y = expert(rows[mine])
            y = y[0] if isinstance(y, tuple) else y
            if out is None:
                out = rows.new_zeros((rows.shape[0], *y.shape[1:]), dtype=y.dtype)
            out = out.index_copy(0, mine, y)
        assert out is not None
        return out


class MOELayer(nn.Module):
    """The gate, this rank's experts and the exchange between them.

    Args:
        gate: the router.
        experts: this rank's experts.
        ep_size: ranks the experts are spread over.
        num_local_experts: experts on each rank.
    """

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int, num_local_experts: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_comm: Comm | None = None  # set by the engine (core/moe/parallel.py)
        self.l_aux: torch.Tensor = torch.zeros(())
        self.exp_counts: torch.Tensor = torch.zeros(0, dtype=torch.int64)

    def forward(self, *input: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``input[0]`` (``input[1]``: top-1's used tokens)."""
        x = input[0]
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat, input[1] if len(input) > 1 else None)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        if self.ep_size > 1 and self.ep_comm is None:
            raise RuntimeError(
                f"this MoE layer spreads its experts over ep_size={self.ep_size} ranks: give the "
                "model to ds_strategy.initialize (or a strategy), which sets up the expert "
                "group, or build the layer with ep_size=1"
            )
        comm = self.ep_comm if self.ep_size > 1 else None
        out = run_experts(
            flat, routing.experts, routing.weights, comm, self.num_local_experts, self.experts
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])


class MoE(nn.Module):
    """DeepSpeed-MoE's layer: ``forward(hidden_states) -> (output, l_aux, exp_counts)``.

    Args:
        hidden_size: the tokens' size.
        expert: the module each expert copies.
        num_experts: experts in the layer, over every rank.
        ep_size: ranks the experts are spread over; it divides ``num_experts``.
        k: experts a token.
        capacity_factor: see [Note: capacity and dropped tokens] in gating.py.
        eval_capacity_factor: the same in evaluation.
        min_capacity: the least capacity.
        use_residual: Residual MoE: a dense copy of ``expert`` beside the experts, mixed by
            a learnt 2-way softmax.
        noisy_gate_policy: ``None``, ``"Jitter"`` or ``"RSample"``.
        drop_tokens: enforce the capacity (False: dropless).
        use_rts: Random Token Selection (top-1).
        use_tutel: accepted for DeepSpeed's signature; Tutel's kernels are not used.
        enable_expert_tensor_parallelism: must be False (experts are not split further).
        top2_2nd_expert_sampling: Gumbel noise on the second choice (top-2).
        drop_policy: ``"probs"`` or ``"position"`` (top-k, k > 2).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        drop_policy: str = "probs",
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep_size={ep_size}: each rank "
                "holds num_experts / ep_size experts; choose an ep_size that divides it"
            )
        if enable_expert_tensor_parallelism:
            raise ValueError(
                "enable_expert_tensor_parallelism: experts split over tensor-parallel ranks are "
                "not supported; leave it False"
            )
        self.use_residual = use_residual
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
            drop_policy,
        )
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)`` for ``hidden_states`` (``(..., hidden_size)``).

        Args:
            hidden_states: the tokens.
            used_token: 1 for tokens to route (top-1), or None for all.
        """
        args = (hidden_states,) if used_token is None else (hidden_states, used_token)
        output = self.deepspeed_moe(*args)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


ParamGroup = dict[str, object]  # an optimizer's param group: its params and options


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert's (DeepSpeed's mark: ``allreduce`` False).

    Args:
        param: a parameter.
    """
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: ParamGroup | list[ParamGroup] | tuple[ParamGroup, ...],
) -> list[ParamGroup]:
    """DeepSpeed's helper of that name: each group's expert parameters moved to a group of
    their own per expert group (its options copied, ``name`` the expert group's, ``moe``
    True), after the groups given.

    Args:
        param_groups: a param group (a dict with ``params`` and ``name``) or several.
    """
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    moe: dict[tuple[str, str], ParamGroup] = {}
    for group in groups:
        kept = []
        for p in cast(list[torch.Tensor], group["params"]):
            if not is_moe_param(p):
                kept.append(p)
                continue
            name = str(getattr(p, "group_name", None))
            key = (str(group.get("name")), name)
            if key not in moe:
                moe[key] = {**group, "name": name, "moe": True, "params": []}
            cast(list[torch.Tensor], moe[key]["params"]).append(p)
        group["params"] = kept
    return groups + list(moe.values())
