"""Expert parallelism: a model's experts spread over the expert-parallel ranks.

[Note: expert parallelism]
The ``ep`` ranks of an expert group (``RankLayout``'s ``"ep"``: consecutive data-parallel
ranks) hold ``E / ep`` experts each: group rank ``r`` holds experts ``[r*L, (r+1)*L)``. Two
kinds of layer are taken:

- transformers' fused experts (Mixtral, Qwen-MoE, OLMoE... in transformers 5): a module
  with ``num_experts`` and 3-D parameters ``(num_experts, ...)`` called as
  ``experts(hidden, top_k_index, top_k_weights)``. Each parameter keeps its own slice of
  experts (the tensor is cut in place, so the user's optimizer still holds it), and its
  forward sends the tokens to their experts' ranks (``dispatch.py``) and runs the model's
  own expert code there. The router, and its auxiliary loss, are the model's, unchanged.
- :class:`~ds_strategy.core.moe.MoE` layers (DeepSpeed's), whose ``deepspeed_experts`` hold
  this rank's experts already (built with the same ``ep_size``), or every expert (built
  with ``ep_size=1``: the others are dropped here).

Expert parameters are ZeRO-sharded over the expert-data-parallel group (``"edp"``: the
ranks holding the same experts), the rest over all data-parallel ranks. Their gradients
are summed over ``"edp"`` and scaled as the others are, by the data-parallel size: each
expert's gradient already sums every rank of its expert group through the all-to-all.
A checkpoint names an expert parameter by the whole model's name and places this rank's
part in the whole tensor (:class:`ExpertParam`), so it loads at any ``ep_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...config import ConfigError
from ..collectives import Comm
from .dispatch import run_experts
from .layer import MoE
from .names import renumber

__all__ = ["ExpertParam", "ExpertParallel", "expert_layers", "layer_ep_size"]


@dataclass(frozen=True)
class ExpertParam:
    """Where this rank's expert parameter sits in the whole model.

    Attributes:
        name: the whole model's name (a module list's global expert index).
        shape: the whole parameter's shape (every expert, for a fused tensor).
        offset: elements of the whole, flattened, before this rank's part.
        local_name: its name in this rank's model.
        fused: a fused tensor (its part is a slice of dimension 0), not one expert's own.
        experts: its layer's experts on each rank.
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    local_name: str
    fused: bool
    experts: int


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers 5's experts: ``num_experts`` and ``(num_experts, ...)`` parameters, a
    ``down_proj`` among them."""
    n = getattr(module, "num_experts", None)
    params = dict(module.named_parameters(recurse=False))
    return (
        isinstance(n, int)
        and not isinstance(module, MoE)
        and "down_proj" in params
        and all(p.dim() >= 2 and p.shape[0] == n for p in params.values())
    )


def expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's expert modules: transformers' fused experts and ``MoE`` layers.

    Args:
        model: the model.
    """
    return [
        (name, m) for name, m in model.named_modules() if isinstance(m, MoE) or _is_fused_experts(m)
    ]


def layer_ep_size(model: nn.Module) -> int:
    """The ``ep_size`` the model's ``MoE`` layers were built with (1 without any).

    Args:
        model: the model.
    """
    sizes = {m.ep_size for _, m in model.named_modules() if isinstance(m, MoE)}
    if len(sizes) > 1:
        raise ConfigError(
            f"the model's MoE layers were built with different ep_size values {sorted(sizes)}: "
            "build them all with one (it is the engine's moe.ep_size)",
            key="moe.ep_size",
        )
    return sizes.pop() if sizes else 1


class ExpertParallel:
    """A model's experts spread over ``comm`` (see [Note: expert parallelism]).

    Args:
        model: the model, every expert still on each rank (or, for ``MoE`` layers, as
            built with ``ep_size``).
        comm: this rank's expert group.
        data: the expert-data-parallel group (ranks holding the same experts).
    """

    def __init__(self, model: nn.Module, comm: Comm, data: Comm) -> None:
        self.comm, self.data = comm, data
        self.size, self.rank = comm.world_size, comm.rank
        self.params: dict[int, ExpertParam] = {}
        # the other ranks' experts of layers built whole: the user's optimizer may hold them
        self.dropped: frozenset[int] = frozenset()
        names = {id(p): n for n, p in model.named_parameters()}
        layers = expert_layers(model)
        if not layers:
            raise ConfigError(
                f"moe.ep_size={self.size}, but the model has no expert layer: expert "
                "parallelism takes transformers' MoE experts (Mixtral, Qwen-MoE, OLMoE...) and "
                "ds_strategy.moe.MoE layers; set moe.ep_size to 1",
                key="moe.ep_size",
            )
        for where, module in layers:
            if isinstance(module, MoE):
                self._take_layer(module, where)
            else:
                self._take_fused(module, names)

    # -- the layers ------------------------------------------------------------------------

    def _check_divides(self, experts: int, where: str) -> int:
        if experts % self.size:
            raise ConfigError(
                f"moe.ep_size={self.size} does not divide the {experts} experts of {where}: "
                "each rank holds the same number; choose an ep_size dividing it",
                key="moe.ep_size",
            )
        return experts // self.size

    def _take_fused(self, module: nn.Module, names: dict[int, str]) -> None:
        total = int(module.num_experts)  # type: ignore[arg-type]
        local = self._check_divides(total, type(module).__name__)
        first = self.rank * local
        for _, p in module.named_parameters(recurse=False):
            shape = tuple(p.shape)
            per = p[0].numel()
            with torch.no_grad():
                p.data = p.data[first : first + local].clone()  # the same Parameter, cut
            name = names[id(p)]
            self.params[id(p)] = ExpertParam(name, shape, first * per, name, True, local)
        module.num_experts = local  # type: ignore[assignment]
        inner = type(module).forward.__get__(module)
        module.forward = _expert_forward(module, inner, self.comm, local)  # type: ignore[method-assign]

    def _take_layer(self, layer: MoE, where: str) -> None:
        moe = layer.deepspeed_moe
        local = self._check_divides(layer.num_experts, "an MoE layer")
        if layer.ep_size == 1 and self.size > 1:  # built whole: keep this rank's experts
            first = self.rank * local
            every = list(moe.experts.deepspeed_experts)
            kept = every[first : first + local]
            mine = {id(p) for m in kept for p in m.parameters()}
            others = {id(p) for m in every for p in m.parameters()} - mine
            self.dropped = self.dropped | others
            moe.experts.deepspeed_experts = nn.ModuleList(kept)
            moe.experts.num_local_experts = local
        elif layer.ep_size != self.size:
            raise ConfigError(
                f"an MoE layer was built with ep_size={layer.ep_size}, and the engine's "
                f"moe.ep_size is {self.size}: build the layers with the engine's, or with 1",
                key="moe.ep_size",
            )
        layer.ep_size = moe.ep_size = self.size
        layer.num_local_experts = moe.num_local_experts = local
        layer.expert_group_name = f"ep_size_{self.size}"
        for p in moe.experts.parameters():
            p.group_name = layer.expert_group_name  # type: ignore[attr-defined]
        moe.ep_comm = self.comm
        first = self.rank * local
        prefix = f"{where}." if where else ""
        for n, p in moe.experts.named_parameters():  # this rank's names, once narrowed
            name = f"{prefix}deepspeed_moe.experts.{n}"
            whole = renumber(name, first)
            self.params[id(p)] = ExpertParam(whole, tuple(p.shape), 0, name, False, local)

    def rekey(self, replaced: dict[int, nn.Parameter]) -> None:
        """Follow parameters that materialising the model replaced (old id -> new one).

        Args:
            replaced: the sharding plan's ``replaced``.
        """
        self.params = {id(replaced[k]) if k in replaced else k: v for k, v in self.params.items()}

    # -- what the engine asks --------------------------------------------------------------

    def is_expert(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of this rank's expert parameters.

        Args:
            p: a parameter of the model.
        """
        return id(p) in self.params

    def other_names(self) -> list[str]:
        """The whole model's names of the experts other ranks hold (a module list's; a
        fused tensor is named the same on every rank)."""
        return [
            renumber(info.local_name, r * info.experts)
            for info in self.params.values()
            if not info.fused
            for r in range(self.size)
            if r != self.rank
        ]

    def full_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (this rank's, its experts whole over ``data``) with every expert: the
        parts joined over the expert group under the whole model's names. Collective.

        Args:
            state: names -> full tensors of this rank's model.
        """
        by_local = {info.local_name: info for info in self.params.values()}
        out = {k: v for k, v in state.items() if k not in by_local}
        for local_name in [k for k in state if k in by_local]:  # the same order on each rank
            info, mine = by_local[local_name], state[local_name].contiguous()
            full = mine.new_empty((self.size, *mine.shape))
            self.comm.all_gather(full.view(-1), mine.view(-1))
            if info.fused:
                out[info.name] = full.flatten(0, 1) if mine.dim() else full
            else:
                for r in range(self.size):
                    out[renumber(local_name, r * info.experts)] = full[r]
        return out


def _expert_forward(
    module: nn.Module, inner: Callable[..., torch.Tensor], comm: Comm, local: int
) -> Callable[..., torch.Tensor]:
    """``experts(hidden, top_k_index, top_k_weights)`` with the tokens sent to their
    experts' ranks; ``inner`` (the model's own forward) runs this rank's experts."""

    def compute(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        out = inner(rows, ids.view(-1, 1), ones)
        if rows.shape[0] == 0:  # no token came: still a gradient (of zeros) for each weight
            out = out + sum(p.reshape(-1)[:1].sum() for p in module.parameters(recurse=False)) * 0
        return out

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(hidden_states, top_k_index, top_k_weights, comm, local, compute)

    return forward
