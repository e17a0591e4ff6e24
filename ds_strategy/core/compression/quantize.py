"""Block quantization to int8, and the quantized all-gather of ZeRO++'s qwZ
(``zero_optimization.zero_quantized_weights``).

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

__all__ = ["BLOCK", "block_dequantize", "block_quantize", "quantized_all_gather"]

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
