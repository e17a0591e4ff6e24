"""Block quantization to int8, and ZeRO++'s quantized collectives: qwZ's all-gather
(``zero_optimization.zero_quantized_weights``) and qgZ's reduce-scatter
(``zero_quantized_gradients``). A flat group reaches them through its transport
(``transports.py``).

[Note: qwZ's all-gather]
ZeRO-3 gathers every unit's parameters before its forward and again before its backward. With
``zero_quantized_weights`` each rank sends its shard as int8, one fp32 scale per block of
``BLOCK`` elements (symmetric: ``scale = max|x| / 127``, ``q = round(x / scale)``), and every
rank rebuilds the full parameters from the gathered blocks: about 1/4 of fp32's bytes (1/2 of
bf16's), plus 4 bytes per block. The shard itself, and so the optimizer's weights, stay
exact: only the copy the layers compute with is rounded, by at most half a step of its
block's scale. The int8 blocks and scales in flight are counted as transient memory until
the gather completes.
"""

from __future__ import annotations

import torch

from ..collectives import Comm, Work
from ..hierarchical import HierarchicalComm

__all__ = [
    "BLOCK",
    "block_dequantize",
    "block_quantize",
    "quantized_all_gather",
    "quantized_reduce_scatter",
]

BLOCK = 256


def block_quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1-D) as int8 blocks of ``block`` elements (the last padded with zeros) and one
    fp32 scale per block.

    >>> q, s = block_quantize(torch.tensor([0.5, -1.0, 0.25, 0.0]), block=2)
    >>> q.tolist(), [round(v, 5) for v in s.tolist()]
    ([64, -127, 127, 0], [0.00787, 0.00197])
    """
    n = x.numel()
    blocks = -(-n // block)
    padded = x.new_zeros(blocks * block, dtype=torch.float32)
    padded[:n] = x.reshape(-1)
    view = padded.view(blocks, block)
    scales = view.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(view / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scales


def block_dequantize(
    q: torch.Tensor, scales: torch.Tensor, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The first ``numel`` values of ``q`` (int8 blocks) times their blocks' ``scales``,
    written to ``out`` (any float dtype) when given."""
    values = (q.view(scales.numel(), -1).float() * scales[:, None]).view(-1)[:numel]
    if out is None:
        return values
    out.copy_(values.view_as(out))
    return out


def quantized_all_gather(
    comm: Comm, full: torch.Tensor, shard: torch.Tensor, async_op: bool = True
) -> tuple[Work, int]:
    """Fill ``full`` with every rank's ``shard``, sent block-quantized (see the note); bytes
    filed as ``qwz``. Returns the work (its ``wait()`` dequantizes) and the bytes of the int8
    blocks and scales held until then."""
    n, world = shard.numel(), comm.world_size
    q, scales = block_quantize(shard)
    q_all = q.new_empty(world * q.numel())
    s_all = scales.new_empty(world * scales.numel())
    works = [
        comm.all_gather(q_all, q, async_op=True, kind="qwz"),
        comm.all_gather(s_all, scales, async_op=True, kind="qwz"),
    ]

    def rebuild() -> None:
        for w in works:
            w.wait()
        rows = full.view(world, n)
        qs, ss = q_all.view(world, -1), s_all.view(world, -1)
        for r in range(world):
            block_dequantize(qs[r], ss[r], n, out=rows[r])

    work = Work(None, then=rebuild)
    if not async_op:
        work.wait()
    held = q_all.numel() * q_all.element_size() + s_all.numel() * s_all.element_size()
    return work, held


# [Note: qgZ's reduce-scatter]
# With ``zero_quantized_gradients`` stage 3's gradient reduce-scatter sends int8 blocks too:
# each rank quantizes the chunk meant for every other rank (blocks of BLOCK, one fp32 scale
# each), an all-to-all delivers them, and each rank adds up the dequantized chunks it
# received. Over a two-level ``HierarchicalComm`` this runs inside the machine first (the
# machine's sum of every machine's blocks, as in its reduce-scatter), then across machines
# on those sums, re-quantized once. No error is carried to the next step: each rank's part
# is off by at most half a step of its block's scale at each level, which is the bound the
# tests check.


def _quantized_all_to_all_sum(comm: Comm, rows: torch.Tensor) -> torch.Tensor:
    """Row ``r`` of ``rows`` (``world x k``) to rank ``r`` as int8 blocks; returns the sum of
    the dequantized rows this rank received (``k`` values, fp32)."""
    world, k = rows.shape
    kp = -(-k // BLOCK) * BLOCK
    padded = rows.new_zeros(world, kp, dtype=torch.float32)
    padded[:, :k] = rows
    q, scales = block_quantize(padded.view(-1))
    q_in, s_in = torch.empty_like(q), torch.empty_like(scales)
    # the fp32 rows: padded, then the dequantized values (the same size) in its place
    with comm.holding(padded, q, scales, q_in, s_in):
        comm.all_to_all(q_in, q, kind="qgz")
        comm.all_to_all(s_in, scales, kind="qgz")
        del padded
        values = q_in.view(-1, BLOCK).float() * s_in[:, None]
        return values.view(world, kp)[:, :k].sum(dim=0)


def quantized_reduce_scatter(comm: Comm, out: torch.Tensor, full: torch.Tensor) -> Work:
    """Sum ``full`` over ``comm``'s ranks, this rank's chunk into ``out``, sent as int8 blocks
    (see the note); two levels when ``comm`` is hierarchical. Completes before it returns."""
    if isinstance(comm, HierarchicalComm):
        m, per = comm.machines, comm.intra.world_size
        blocks = full.view(m, per, -1).transpose(0, 1).reshape(per, -1)  # (L, M*c)
        with comm.holding(blocks):  # through the first level, which adds its own
            mid = _quantized_all_to_all_sum(comm.intra, blocks)
        del blocks
        with comm.holding(mid):
            out.copy_(_quantized_all_to_all_sum(comm.inter, mid.view(m, -1)))
        return Work(None)
    if comm.world_size == 1:
        out.copy_(full)
        return Work(None)
    out.copy_(_quantized_all_to_all_sum(comm, full.view(comm.world_size, -1)))
    return Work(None)
