"""Stochastic rounding from fp32 to bf16 or fp16, with noise that does not depend on sharding.

[Note: why stochastic rounding for low-precision masters]
An update smaller than half a unit in the last place of a bf16 weight is lost when it is
rounded to nearest: bf16 keeps 8 significant bits, so a weight of 1.0 ignores any step under
2**-9. With Adam's typical steps of 1e-4 to 1e-3 most updates would vanish. Rounding up with
probability equal to the lost fraction keeps every update in expectation, costs no memory,
and needs nothing kept between steps. Kahan-compensated summation keeps the lost part in a
second bf16 buffer instead; that is 2 more bytes a parameter, which is what the low-precision
master is there to save. The same holds for Adam's second moment: with ``beta2 = 0.999`` its
per-step decay (0.1%) is below bf16's resolution (0.4%), so rounded to nearest it stops
decaying; rounded stochastically it decays as in fp32 on average.

The noise of element ``e`` of a parameter is a hash of ``e`` and a key (the step, the
parameter and which tensor), not a random stream: a rank rounding its piece of the parameter
draws exactly what one process rounding the whole parameter draws for those elements.
"""

from __future__ import annotations

import torch

__all__ = ["rounding_key", "stochastic_round_"]

_M32 = 0xFFFFFFFF


def rounding_key(*parts: int) -> int:
    """A 32-bit key mixed from integers (step, parameter ordinal, tensor), as splitmix64 does.

    Args:
        parts: the integers that make the key distinct.
    """
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return (h ^ (h >> 32)) & _M32


_BLOCK = 1 << 16  # elements drawn from one seeding of the generator


def _bits16(first: int, n: int, key: int, device: torch.device) -> torch.Tensor:
    """``n`` numbers in [0, 2**16) as int32, for elements ``first .. first + n - 1``.

    The elements are cut into blocks of ``_BLOCK`` counted from the parameter's start; each
    block is drawn from a generator seeded by the key and the block's number, so a piece of
    the parameter gets the same numbers as the whole.
    """
    out = torch.empty(n, dtype=torch.int32)
    gen = torch.Generator()
    done = 0
    while done < n:
        block, skip = divmod(first + done, _BLOCK)
        take = min(_BLOCK - skip, n - done)
        gen.manual_seed(rounding_key(key, block))
        drawn = torch.randint(0, 1 << 16, (skip + take,), dtype=torch.int32, generator=gen)
        out[done : done + take] = drawn[skip:]
        done += take
    return out.to(device)


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, first: int, key: int) -> None:
    """Write ``src`` (fp32) into ``dst`` (bf16 or fp16), rounded stochastically.

    Each value goes to one of its two neighbours in ``dst``'s dtype, the farther one with
    probability equal to its share of the gap, so the rounding adds no bias. An fp32 ``dst``
    is a plain copy.

    Args:
        dst: the low-precision tensor written in place, shaped like ``src``.
        src: the fp32 values.
        first: the index of ``src``'s first element in its parameter (sets its noise).
        key: the 32-bit key of this rounding (:func:`rounding_key`).
    """
    if dst.dtype == src.dtype:
        dst.copy_(src)
        return
    flat = src.reshape(-1)
    if dst.dtype == torch.bfloat16:
        # bf16 is fp32's upper half: add 16 random low bits to the magnitude, then cut them
        # off (sign and magnitude are apart in the bits, so both signs round alike)
        noise = _bits16(first, flat.numel(), key, flat.device)
        bits = (flat.view(torch.int32) + noise) & -65536
        dst.view(-1).copy_(bits.view(torch.float32))
        return
    near = flat.to(dst.dtype)
    lost = flat - near.float()
    toward = torch.where(lost > 0, float("inf"), float("-inf")).to(dst.dtype)
    other = torch.nextafter(near, toward)
    gap = other.float() - near.float()
    share = torch.where(gap != 0, lost / gap, torch.zeros_like(lost))
    u = _bits16(first, flat.numel(), key, flat.device).float().add_(0.5).div_(1 << 16)
    dst.view(-1).copy_(torch.where(u < share, other, near))
