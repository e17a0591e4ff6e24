"""Tokens to their experts' ranks and back: expert parallelism's all-to-all.

[Note: dispatching tokens]
``ep`` ranks hold ``L`` experts each: rank ``r`` holds experts ``[r*L, (r+1)*L)``. Each rank
routes its own tokens. :func:`run_experts` sorts a rank's (token, choice) pairs by expert,
so the rows for rank ``r`` are consecutive, and tells every rank how many rows of each of
its experts come (one small all-to-all of counts). The rows travel in one all-to-all with
uneven splits; each rank runs its experts on what it received, and the results come back
by the reverse all-to-all. Every token is sent, so the result is dropless: the same
arithmetic as one process holding every expert. The combine weights multiply the results
where the tokens live, so their gradient stays local. Backward runs the two all-to-alls
reversed (:class:`_Rows`).

>>> x = torch.ones(3, 2)
>>> out = run_experts(x, torch.tensor([[0], [1], [-1]]), torch.full((3, 1), 0.5), None, 2,
...                   lambda rows, local: rows * (local + 1).view(-1, 1))
>>> out[:, 0].tolist()
[0.5, 1.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import FunctionCtx

from ..collectives import Comm

__all__ = ["exchange_rows", "run_experts"]

KIND = "expert_all_to_all"


class _Saved(FunctionCtx):
    comm: Comm
    out_splits: list[int]
    in_splits: list[int]


class _Rows(torch.autograd.Function):
    """Rows to ranks by ``in_splits``, ``out_splits`` from each; backward the reverse."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        comm: Comm,
        out_splits: list[int],
        in_splits: list[int],
    ) -> torch.Tensor:
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits  # type: ignore[attr-defined]
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), KIND, out_splits=out_splits, in_splits=in_splits)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        saved: _Saved = ctx  # type: ignore[assignment]
        back = _Rows.apply(grad.contiguous(), saved.comm, saved.in_splits, saved.out_splits)
        return back, None, None, None


def exchange_rows(
    x: torch.Tensor, comm: Comm, out_splits: Sequence[int], in_splits: Sequence[int]
) -> torch.Tensor:
    """``x``'s rows to ``comm``'s ranks, ``in_splits[r]`` of them to rank ``r``, differentiable.

    Args:
        x: the rows, grouped by destination in rank order.
        comm: the expert-parallel group.
        out_splits: rows this rank receives from each rank.
        in_splits: rows this rank sends to each rank.
    """
    if comm.world_size == 1:
        return x
    out: torch.Tensor = _Rows.apply(x, comm, list(out_splits), list(in_splits))
    return out


def run_experts(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    comm: Comm | None,
    num_local: int,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each token's weighted sum of its experts' outputs, the experts spread over ``comm``.

    See [Note: dispatching tokens].

    Args:
        hidden: ``(S, H)`` this rank's tokens.
        experts: ``(S, k)`` global expert indices; a negative one is a dropped choice.
        weights: ``(S, k)`` the combine weights.
        comm: the expert-parallel group; None: every expert is on this rank.
        num_local: experts each rank holds.
        compute: ``(rows, local expert index of each row) -> outputs``, this rank's experts.
    """
    world = comm.world_size if comm is not None else 1
    s, k = experts.shape
    flat = experts.reshape(-1)
    token = torch.arange(s, device=hidden.device).repeat_interleave(k)
    kept = (flat >= 0).nonzero().view(-1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    sorted_experts, tokens = flat[order], token[order]
    per_expert = torch.bincount(sorted_experts, minlength=world * num_local).cpu()
    incoming = per_expert.clone()
    if comm is not None and world > 1:
        comm.all_to_all(incoming, per_expert, "control")  # rank r's counts for my experts
    send = per_expert.view(world, num_local).sum(dim=1).tolist()
    recv_by_expert = incoming.view(world, num_local)
    recv = recv_by_expert.sum(dim=1).tolist()
    rows = hidden[tokens]
    if comm is not None:
        rows = exchange_rows(rows, comm, recv, send)
    local = torch.arange(num_local).repeat(world).repeat_interleave(recv_by_expert.view(-1))
    out = compute(rows, local.to(hidden.device))
    back = exchange_rows(out, comm, send, recv) if comm is not None else out
    scale = weights.reshape(-1)[order].to(back.dtype).unsqueeze(1)
    combined = torch.zeros_like(hidden, dtype=back.dtype)
    return combined.index_add(0, tokens, back * scale).to(hidden.dtype)
