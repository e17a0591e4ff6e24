"""glibc's malloc thresholds, set once per process by stage 3 and by the swap tier: see
[Note: the C heap under stage-3 gathers] (``core/heap.py``) and [Note: swapped storages and
the C allocator] (``core/offload/swap.py``)."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ds_strategy
from ds_strategy.demos.gpt import GPT, GPTConfig
from tests.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not Path("/proc/self/status").exists(),
    reason="glibc's malloc and /proc",
)

_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_HEAP_SCRIPT = """
import sys, torch
from ds_strategy.core import heap
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
for step in sys.argv[1].split(","):
    if step == "keep":
        assert heap.keep_freed_blocks(8 << 20)
    elif step == "release":
        assert heap.release_freed_blocks()
    elif step == "keep-refused":
        assert not heap.keep_freed_blocks(8 << 20)
big = torch.ones(30 << 18)  # 30 MiB: freeing its mapping raises glibc's dynamic threshold
del big
base = rss()
blocks = [torch.ones(2 << 20) for _ in range(64)]  # 64 blocks of 8 MiB, as swapping makes
last = blocks[-1]  # the heap's top stays in use
del blocks
print(rss() - base)
"""


def _retained(steps: str, **env: str) -> int:
    """Bytes of 63 freed 8 MiB blocks still resident in a new process after ``steps``."""
    clean = {k: v for k, v in os.environ.items() if k not in _MALLOC_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_SCRIPT, steps],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**clean, **env},
    )
    return int(out.stdout.strip())


def test_swapped_storages_go_back_to_the_system_when_freed() -> None:
    """After the swap tier fixes glibc's mmap threshold, 504 MiB of freed 8 MiB blocks leave
    the process; with the dynamic threshold (every process that never opened a swap
    directory) they stay resident. The swap tier's setting wins over stage 3's, whichever
    came first."""
    assert _retained("none") > 256 << 20
    assert _retained("release") < 32 << 20
    assert _retained("keep,release") < 32 << 20
    assert _retained("release,keep-refused") < 32 << 20


def test_stage3_keeps_freed_blocks_unless_the_environment_chose() -> None:
    """Stage 3's setting keeps freed blocks in the process for the next gather; a threshold
    the environment set is left alone (the way to opt out), and then the blocks go back."""
    assert _retained("keep") > 256 << 20
    one_mib = str(1 << 20)
    assert _retained("keep-refused", MALLOC_MMAP_THRESHOLD_=one_mib) < 32 << 20
    tunables = f"glibc.malloc.mmap_threshold={one_mib}"
    assert _retained("keep-refused", GLIBC_TUNABLES=tunables) < 32 << 20


def faults_worker(rank: int, world: int, keep: bool, d: int = 384) -> list[int]:
    """Minor page faults of each of eight stage-3 steps after three to warm up, every weight
    sharded (units of about 7 MiB, in groups of 2 MiB)."""
    from ds_strategy.core.zero import builders

    if not keep:  # what every stage-3 process did before: glibc's dynamic thresholds
        builders.keep_freed_blocks = lambda largest: False  # type: ignore[assignment]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=2048, d=d, layers=4, heads=4, seq=64))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 1 << 20,
        },
    }
    engine = ds_strategy.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), config)
    g = torch.Generator().manual_seed(rank)
    faults = []
    for step in range(11):
        tokens = torch.randint(0, 2048, (4, 65), generator=g)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        logits = engine(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        if step >= 3:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    engine.destroy()
    return faults


@pytest.mark.slow
def test_warm_stage3_steps_take_a_fraction_of_the_page_faults() -> None:
    """Two CPU ranks at stage 3 free and regrow every unit's buffer twice a step. With
    glibc's dynamic thresholds the heap's top went back to the system and came again, page
    by page; with stage 3's setting warm steps take a small fraction of those faults (a
    few MiB at some steps). Both ranks' steps are summed: how much the dynamic thresholds
    return at a given step varies with how the ranks' calls interleave."""
    kept = sum(map(sum, run_ranks(faults_worker, 2, True, fresh=True)))
    dynamic = sum(map(sum, run_ranks(faults_worker, 2, False, fresh=True)))
    assert dynamic > 8000, (kept, dynamic)  # the test engages the churn
    assert 5 * kept < dynamic, (kept, dynamic)
