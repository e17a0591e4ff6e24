"""Error-compensated 1-bit compression and the two-phase compressed all-reduce of DeepSpeed's
1-bit optimizers.

[Note: compressed all-reduce]
Each rank (as a *worker*) adds its worker error to its tensor, sends the signs of each of the
W chunks to the rank owning that chunk (all-to-all of packed bytes) with one scale, and keeps
what the compression lost as its new worker error. Each rank (as a *server*) averages its
chunk over the workers (each worker's signs times its scale), adds its server error,
compresses again (signs plus one scale) and keeps the loss as its server error; an all-gather
of the packed server chunks gives every rank the same result. Bytes a rank sends: the signs
of the tensor twice (n/8 bytes each way, less its own chunk), plus a few scales.

The scale of a compressed vector is ``norm(x) / sqrt(numel)`` (the root mean square), so
``scale * sign(x)`` has the norm of ``x``.
"""

from __future__ import annotations

import math

import torch

from ..collectives import Comm
from .packing import pack_signs, unpack_signs

__all__ = ["compress_signs", "compressed_all_reduce", "decompress_signs"]


def compress_signs(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + error`` as (packed signs, scale); ``error`` becomes what the compression lost
    (``x + error - scale * sign``), in place. ``x`` is not changed."""
    corrected = x.reshape(-1) + error.reshape(-1)
    scale = corrected.norm() / math.sqrt(max(corrected.numel(), 1))
    packed = pack_signs(corrected)
    signs = unpack_signs(packed, corrected.numel(), corrected.dtype)
    error.copy_((corrected - scale * signs).view_as(error))
    return packed, scale.reshape(1)


def decompress_signs(packed: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    return unpack_signs(packed, numel, scale.dtype).mul_(scale)


def compressed_all_reduce(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    comm: Comm,
    kind: str = "onebit",
) -> torch.Tensor:
    """The average of ``x`` over ``comm``'s ranks, 1-bit compressed both ways with error
    compensation (see the note). ``x.numel()`` must divide by ``8 * world``; ``worker_error``
    is ``x``'s size, ``server_error`` one chunk's (``numel / world``). Returns a new tensor;
    ``comm`` counts the bytes under ``kind``."""
    world = comm.world_size
    n = x.numel()
    if n % (8 * world):
        raise ValueError(f"compressed_all_reduce: {n} elements do not divide by 8 x {world}")
    chunk = n // world
    packed, scale = compress_signs(x, worker_error)
    received = torch.empty_like(packed)
    comm.all_to_all(received, packed, kind=kind)  # chunk j of every worker to rank j
    scales = scale.new_empty(world)
    comm.all_gather(scales, scale, kind=kind)
    rows = received.view(world, chunk // 8)
    total = torch.zeros(chunk, dtype=x.dtype, device=x.device)
    for w in range(world):
        total += decompress_signs(rows[w], scales[w], chunk)
    server_packed, server_scale = compress_signs(total / world, server_error)
    gathered = received.new_empty(world * (chunk // 8))
    comm.all_gather(gathered, server_packed, kind=kind)
    server_scales = scale.new_empty(world)
    comm.all_gather(server_scales, server_scale, kind=kind)
    parts = gathered.view(world, chunk // 8)
    out = [decompress_signs(parts[w], server_scales[w], chunk) for w in range(world)]
    return torch.cat(out).view_as(x)
