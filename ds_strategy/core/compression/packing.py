"""Signs packed eight to a byte, so a 1-bit method sends 1/32 of an fp32 tensor's bytes.

The sign of zero is +1, as DeepSpeed's compression takes it (``x.sign().add(1).bool()``).

>>> unpack_signs(pack_signs(torch.tensor([1.5, -2.0, 0.0])), 3)
tensor([ 1., -1.,  1.])
"""

from __future__ import annotations

import torch

__all__ = ["pack_signs", "unpack_signs"]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x``'s signs (bit set: >= 0) as ``ceil(numel / 8)`` bytes, first element in the high
    bit of the first byte; the last byte's unused bits are 0."""
    flat = (x.reshape(-1) >= 0).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = _BITS.to(flat.device)
    return (flat.view(-1, 8) * bits).sum(dim=1, dtype=torch.uint8)


def unpack_signs(
    packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The first ``numel`` signs in ``packed`` as +1 / -1 of ``dtype``."""
    bits = _BITS.to(packed.device)
    set_ = (packed.reshape(-1, 1) & bits).ne(0).reshape(-1)[:numel]
    return set_.to(dtype).mul_(2).sub_(1)
