"""The all-to-all of Ulysses sequence parallelism, differentiable.

[Note: Ulysses' exchange]
Each of the ``P`` ranks of a sequence-parallel group holds ``S / P`` consecutive tokens of
every sequence (rank ``r`` the ``r``-th block). Attention needs whole sequences. Ulysses
trades the split: before attention each rank sends head block ``j`` of its tokens to rank
``j``; then rank ``j`` holds ``H / P`` heads over all ``S`` tokens (``seq_to_heads``). After
attention the inverse exchange (``heads_to_seq``) gives each rank its own tokens back, every
head. Each is the other's gradient. Both move a tensor's bytes once, ``(P - 1) / P`` of it
over the wire, whatever ``S``: what grows with the sequence is the attention itself.

Tensors are laid out ``[batch, heads, tokens, head_dim]``, as ``scaled_dot_product_attention``
takes them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..collectives import Comm

__all__ = ["heads_to_seq", "seq_to_heads"]


def _seq_to_heads(comm: Comm, x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    p = comm.world_size
    b, h, s, d = x.shape
    # chunk j of dim 0 goes to rank j: our tokens of its head block
    send = x.reshape(b, p, h // p, s, d).transpose(0, 1).contiguous()
    got = _exchange(comm, send, dtype)
    # chunk r came from rank r: head block ours, tokens block r
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)


def _heads_to_seq(comm: Comm, x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    p = comm.world_size
    b, h, s, d = x.shape
    # chunk j of dim 0 goes to rank j: token block j of our heads
    send = x.reshape(b, h, p, s // p, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _exchange(comm, send, dtype)
    # chunk r came from rank r: our tokens, head block r
    return got.transpose(0, 1).reshape(b, p * h, s // p, d)


def _exchange(comm: Comm, send: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """All-to-all over dim 0, in ``dtype`` on the wire (None: as it is)."""
    wire = send if dtype is None or dtype == send.dtype else send.to(dtype)
    got = torch.empty_like(wire)
    comm.all_to_all(got, wire, kind="sequence_all_to_all")
    return got if got.dtype == send.dtype else got.to(send.dtype)


class _Exchange(torch.autograd.Function):
    """Either exchange; its gradient is the other."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: Comm, dtype: torch.dtype | None, to_heads: bool
    ) -> torch.Tensor:
        ctx.comm, ctx.dtype, ctx.to_heads = comm, dtype, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(comm, x, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(ctx.comm, grad.contiguous(), ctx.dtype), None, None, None


def seq_to_heads(x: torch.Tensor, comm: Comm, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, H, S/P, D]`` (this rank's tokens, every head) to ``[B, H/P, S, D]`` (every
    token, this rank's heads).

    Args:
        x: this rank's tokens; ``H`` must divide by the group's size ``P``.
        comm: the sequence-parallel group.
        dtype: the dtype on the wire (``seq_parallel_communication_data_type``); None: ``x``'s.
    """
    if comm.world_size == 1:
        return x
    return _Exchange.apply(x.contiguous(), comm, dtype, True)  # type: ignore[no-any-return]


def heads_to_seq(x: torch.Tensor, comm: Comm, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B, H/P, S, D]`` back to ``[B, H, S/P, D]``: the inverse of :func:`seq_to_heads`.

    Args:
        x: this rank's heads over every token.
        comm: the sequence-parallel group.
        dtype: the dtype on the wire; None: ``x``'s.
    """
    if comm.world_size == 1:
        return x
    return _Exchange.apply(x.contiguous(), comm, dtype, False)  # type: ignore[no-any-return]
