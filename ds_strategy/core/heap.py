"""glibc's malloc set, once per process, for how the engine allocates host memory.

[Note: the C heap under stage-3 gathers]
A stage-3 group's full buffer is freed at every release and grown again at the next gather
(``flat_params.py``), twice a step for every unit. glibc's malloc serves a block above its
mmap threshold with a mapping of its own, unmapped when freed, and a smaller one from its
heap, which gives memory back to the system only from the top, once more than its trim
threshold is free there. Both thresholds are dynamic: a freed mapping raises the mmap
threshold to its size (at most 32 MiB) and the trim threshold to twice that. So at stage 3 on
CPU ranks the heap's top kept shrinking and growing: with 2 ranks of a 29.5M-parameter GPT
each rank took 12,000-25,000 page faults a step (the floor and stages 1-2: none), each a page
the kernel zeroes again, and the step took 1.13-1.17x the no-communication floor's in three
runs where the same runs with the thresholds fixed took 1.03-1.09x and no page faults.

So a stage-3 engine computing on the CPU fixes both (:func:`keep_freed_blocks`): the mmap
threshold above the largest flat group, so every group's buffer comes from the heap, and the
trim threshold at ``max(1 GiB, 4 x`` that), so the freed buffers stay in the process for the
next gather, as a caching allocator keeps a GPU's. The process's resident memory then stays
near its peak instead of falling between the gathers; the engine's own accounting of model
state (``memory_report``) does not change.

The swap tier wants the opposite (see [Note: swapped storages and the C allocator] in
``offload/swap.py``): freed blocks must leave the process, or its resident memory grows by
gigabytes it no longer holds. It wins: :func:`release_freed_blocks` fixes a 1 MiB mmap
threshold and puts the trim threshold back, and a later :func:`keep_freed_blocks` changes
nothing. Neither touches what the environment chose (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` or ``glibc.malloc`` tunables): that is also how to opt out.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable

__all__ = ["RELEASE_MMAP_THRESHOLD", "keep_freed_blocks", "release_freed_blocks"]

RELEASE_MMAP_THRESHOLD = 1 << 20  # the swap tier's: every block above 1 MiB in its own mapping
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_DEFAULT_TRIM = 128 * 1024  # glibc's own trim threshold
_DYNAMIC_MMAP_MAX = 32 << 20  # the highest glibc's dynamic mmap threshold goes (64-bit)
_MIN_TRIM = 1 << 30
_MIB = 1 << 20

# what this process has set: None (nothing yet), "release" or "keep"; and keep's threshold
_mode: str | None = None
_kept_mmap = 0


def _environment_chose(*names: str) -> bool:
    """Whether the environment set one of glibc's malloc thresholds itself."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(f"MALLOC_{n.upper()}_" in os.environ or f"malloc.{n}" in tunables for n in names)


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6").mallopt  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def release_freed_blocks() -> bool:
    """Freed blocks above 1 MiB go back to the system when freed (the swap tier's setting;
    see the note). Sticky: :func:`keep_freed_blocks` changes nothing after it. False where
    the C library is not glibc or the environment chose the mmap threshold."""
    global _mode
    if _mode == "release":
        return True
    mallopt = _mallopt()
    if mallopt is None or _environment_chose("mmap_threshold"):
        return False
    if not mallopt(_M_MMAP_THRESHOLD, RELEASE_MMAP_THRESHOLD):
        return False
    if _mode == "keep" and not _environment_chose("trim_threshold"):
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
    _mode = "release"
    return True


def keep_freed_blocks(largest: int) -> bool:
    """Blocks up to ``largest`` bytes come from the heap and stay in the process when freed,
    for the next stage-3 gather (see the note). False where the swap tier released them
    first, the C library is not glibc, or the environment chose a threshold.

    Args:
        largest: bytes of the largest block the engine frees and allocates again (its
            largest flat group's full buffer).
    """
    global _mode, _kept_mmap
    if _mode == "release":
        return False
    mallopt = _mallopt()
    if mallopt is None or _environment_chose("mmap_threshold", "trim_threshold"):
        return False
    mmap = max(_DYNAMIC_MMAP_MAX, (largest // _MIB + 1) * _MIB, _kept_mmap)
    if not (
        mallopt(_M_MMAP_THRESHOLD, mmap) and mallopt(_M_TRIM_THRESHOLD, max(_MIN_TRIM, 4 * mmap))
    ):
        return False
    _mode, _kept_mmap = "keep", mmap
    return True
