"""Ring attention (context parallelism): attention over a sequence split across ranks, with
no rank ever holding the whole ``S x S`` score matrix.

[Note: ring attention]
Each of the ``n`` ranks of a context-parallel group holds one block of ``S / n`` consecutive
tokens: its queries, keys and values. Rank ``i``'s queries attend to every key block ``j``
(under a causal mask only ``j <= i``, and block ``i`` itself triangular). The blocks' partial
results merge exactly with the online softmax of FlashAttention: a running row maximum ``m``,
running denominator ``l`` and running output, rescaled by ``exp(m_old - m_new)`` as each
block arrives. What the forward keeps is the output and the log-sum-exp of every row
(``lse = m + log l``), not the probabilities: the backward recomputes each block's
probabilities as ``exp(scores - lse)`` and forms the gradients block by block
(``dS = P * (dP - rowsum(dO * O))``). The keys' and values' gradients of block ``j`` belong to
rank ``j``: each rank sums its contributions into a full-length buffer and a reduce-scatter
delivers every block to its owner.

The keys and values travel by all-gather (torch's context parallelism does the same by
default; a ring of point-to-point sends moves the same bytes). The gathered keys and values
live during one layer's forward or backward only: the forward keeps this rank's block.

On CPU each block runs torch's fused attention kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, given the whole row's
output and log-sum-exp), which never holds a block's ``s x s`` scores; elsewhere the block's
arithmetic is written out in fp32 (it holds them, one block at a time). The blocks' results
merge in fp32. Grouped-query attention (fewer key and value heads) is expanded per block and
summed back for the gradients. torch's own implementation
(``torch.distributed.tensor.experimental.context_parallel``) dispatches on the CUDA attention
kernels only; this one runs wherever torch does, gloo included.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..collectives import Comm

__all__ = ["ring_attention"]


def _gather_blocks(comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` (``[B, H, s, D]``), stacked: ``[n, B, H, s, D]``."""
    full = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(full.view(-1), x.contiguous().view(-1), kind="context_all_gather")
    return full


def _scatter_blocks(comm: Comm, full: torch.Tensor) -> torch.Tensor:
    """Sum ``[n, B, H, s, D]`` over ranks; this rank's block of it."""
    out = torch.empty(full.shape[1:], dtype=full.dtype, device=full.device)
    comm.reduce_scatter(out.view(-1), full.contiguous().view(-1))
    return out


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads repeated to ``heads`` (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``_expand``: the query heads of one key head summed."""
    b, h, s, d = x.shape
    return x if h == kv_heads else x.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _blocks(rank: int, n: int, causal: bool) -> list[int]:
    return list(range(rank + 1)) if causal else list(range(n))


# -- one block: torch's fused CPU kernel, or the arithmetic written out ------------------------


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:  # a diagonal block: causal inside it
        s = scores.shape[-1]
        above = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output (fp32) and row log-sum-exp (fp32, ``[B, H, s, 1]``)."""
    if q.device.type in _FUSED_DEVICES:  # never holds the block's s x s scores
        out, lse = _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float().unsqueeze(-1)
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.float()), lse


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients, from the whole row's output and log-sum-exp."""
    if q.device.type in _FUSED_DEVICES:
        dq, dk, dv = _FLASH_CPU_BACKWARD(
            dout, q, k, v, out, lse.squeeze(-1), 0.0, causal, scale=scale
        )
        return dq.float(), dk.float(), dv.float()
    p = torch.exp(_scores(q, k, scale, causal) - lse)
    dout, delta = dout.float(), (dout.float() * out.float()).sum(-1, keepdim=True)
    ds = p * (torch.matmul(dout, v.float().transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k.float()) * scale
    return (
        dq,
        torch.matmul(ds.transpose(-1, -2), q.float()) * scale,
        torch.matmul(p.transpose(-1, -2), dout),
    )


_FUSED_DEVICES = ("cpu",)  # where a block runs the fused kernel (the tests also try without)
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        comm: Comm,
        scale: float,
        causal: bool,
    ) -> torch.Tensor:
        keys, values = _gather_blocks(comm, k), _gather_blocks(comm, v)
        heads, rank = q.shape[1], comm.rank
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
        for j in _blocks(rank, keys.shape[0], causal):
            k_j, v_j = _expand(keys[j], heads), _expand(values[j], heads)
            out_j, lse_j = _block_forward(q, k_j, v_j, causal and j == rank, scale)
            merged = torch.logaddexp(lse, lse_j)  # the online softmax (see the note)
            acc = acc * torch.exp(lse - merged) + out_j * torch.exp(lse_j - merged)
            lse = merged
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.scale, ctx.causal = comm, scale, causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, rank = ctx.comm, ctx.comm.rank
        keys, values = _gather_blocks(comm, k), _gather_blocks(comm, v)
        heads, kv_heads = q.shape[1], k.shape[1]
        dout = grad_out.contiguous().to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkeys = torch.zeros(keys.shape, dtype=torch.float32, device=q.device)
        dvalues = torch.zeros_like(dkeys)
        for j in _blocks(rank, keys.shape[0], ctx.causal):
            k_j, v_j = _expand(keys[j], heads), _expand(values[j], heads)
            diagonal = ctx.causal and j == rank
            dq_j, dk_j, dv_j = _block_backward(dout, q, k_j, v_j, out, lse, diagonal, ctx.scale)
            dq += dq_j
            dkeys[j], dvalues[j] = _fold(dk_j, kv_heads), _fold(dv_j, kv_heads)
        dk = _scatter_blocks(comm, dkeys).to(k.dtype)
        dv = _scatter_blocks(comm, dvalues).to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank of ``comm``.

    Rank ``r`` holds the ``r``-th block of consecutive tokens. The result equals
    ``scaled_dot_product_attention`` over the whole sequence, restricted to this rank's
    queries.

    Args:
        q: ``[B, H, s, D]``, this rank's queries.
        k: ``[B, Hkv, s, D]``, this rank's keys; ``Hkv`` divides ``H``.
        v: ``[B, Hkv, s, D]``, this rank's values.
        comm: the context-parallel group; every rank holds ``s`` tokens.
        causal: each token attends to itself and the tokens before it only.
        scale: multiplies the scores; None: ``1 / sqrt(D)``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
            "key/value heads"
        )
    return _RingAttention.apply(q, k, v, comm, scale, causal)  # type: ignore[no-any-return]
