"""ZeRO's reduce-scatters and all-gathers through shared memory (``core/shm.py``): the same
results as gloo's, bytes counted the same, calls in flight together, areas that grow, a group
whose ranks cannot see each other's files, a rank that dies, and the engine's switch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_strategy
from ds_strategy.core import shm
from ds_strategy.core.collectives import Comm
from tests.distributed import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(rank: int, size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(size, generator=g) * 4).to(dtype)


def _ours() -> list[str]:
    return sorted(p for p in os.listdir(shm._ROOT) if p.startswith("ds_strategy-"))


def parity_worker(rank: int, world: int) -> dict:
    """Each call through shared memory and through gloo's composed path, on the same inputs;
    several calls in flight at once, completed out of order; a larger message later."""
    shared, plain = Comm(shared_memory=True), Comm()
    out: dict = {"mismatch": [], "scratch": []}
    sizes = [13, 1000, 7, 50_000, 5]  # 50_000 grows the areas
    works, expected = [], []
    for i, size in enumerate(sizes):
        for dtype in DTYPES:
            full = _inputs(rank, world * size, dtype, i)
            mine, ref = torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype)
            works.append(shared.reduce_scatter(mine, full, async_op=True))
            out["scratch"].append(works[-1].scratch_nbytes)
            plain.reduce_scatter(ref, full.clone())
            expected.append((f"rs {size} {dtype}", mine, ref, full))
            part = _inputs(rank, size, dtype, 50 + i)
            gathered, ref_g = (
                torch.empty(world * size, dtype=dtype),
                torch.empty(world * size, dtype=dtype),
            )
            works.append(shared.all_gather(gathered, part, async_op=True))
            plain.all_gather(ref_g, part)
            expected.append((f"ag {size} {dtype}", gathered, ref_g, part))
    for w in reversed(works):  # older calls complete first on their own (see the module note)
        w.wait()
    for name, got, ref, _ in expected:
        if not torch.equal(got, ref):
            out["mismatch"].append(name)
    out["area"] = shared._exchange.area if shared._exchange is not None else 0
    out["aligned"] = out["area"] % 64 == 0
    out["report"] = (shared.take_report(), plain.take_report())
    dist.barrier()
    out["files"] = _ours()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_gives_gloos_results_and_counts_its_bytes(world: int) -> None:
    for r in run_ranks(parity_worker, world):
        assert r["mismatch"] == [], r["mismatch"]
        assert set(r["scratch"]) == {0}  # no receive buffer: the peers' files are read
        assert r["area"] >= (world - 1) * 50_000 * 4  # grown to the largest message (fp32)
        assert r["aligned"]  # so is every area after the first, for any dtype
        ours, gloos = r["report"]  # the same bytes, and the files' set-up as control
        for kind in ("reduce_scatter", "all_gather"):
            assert ours[kind] == gloos[kind] > 0, (kind, ours, gloos)
        assert 0 < ours["control"] <= 8 * world * 2  # a few 4-byte flags per set-up
        assert r["files"] == []  # unlinked as soon as every rank had them mapped


def unseen_worker(rank: int, world: int, root: str) -> dict:
    """Each rank makes its files in a folder of its own: no rank can map another's."""
    shm._ROOT = str(Path(root) / f"rank{rank}")
    os.makedirs(shm._ROOT, exist_ok=True)
    comm = Comm(shared_memory=True)
    full = _inputs(rank, world * 40, torch.float32, 1)
    mine, ref = torch.empty(40), torch.empty(40)
    comm.reduce_scatter(mine, full)
    Comm().reduce_scatter(ref, full.clone())
    return {
        "equal": torch.equal(mine, ref),
        "shared": comm.shared_memory,
        "left": os.listdir(shm._ROOT),
    }


def test_ranks_that_cannot_see_each_others_files_keep_gloo(tmp_path: Path) -> None:
    for r in run_ranks(unseen_worker, 2, str(tmp_path), fresh=True):
        assert r["equal"]
        assert r["shared"] is False  # every rank gave up, together
        assert r["left"] == []


def full_worker(rank: int, world: int) -> dict:
    """Rank 1's ``/dev/shm`` has no room for its file (claiming the pages fails)."""
    if rank == 1:

        def no_room(fd: int, offset: int, size: int) -> None:
            raise OSError(28, "No space left on device")

        shm.os.posix_fallocate = no_room  # type: ignore[attr-defined]
    comm = Comm(shared_memory=True)
    full = _inputs(rank, world * 40, torch.float32, 2)
    mine, ref = torch.empty(40), torch.empty(40)
    comm.reduce_scatter(mine, full)
    Comm().reduce_scatter(ref, full.clone())
    dist.barrier()
    return {"equal": torch.equal(mine, ref), "shared": comm.shared_memory, "files": _ours()}


def test_a_full_dev_shm_keeps_gloo_instead_of_crashing() -> None:
    for r in run_ranks(full_worker, 2, fresh=True):
        assert r["equal"] and r["shared"] is False and r["files"] == []


def test_a_rank_that_died_is_named_not_waited_for() -> None:
    """Waiting on a rank whose process is gone (reaped, or a zombie) raises within a second,
    naming the rank; a live one that never comes raises at the timeout."""
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.0)  # exited, not reaped yet
    assert not shm._alive(reaped.pid) and not shm._alive(zombie.pid)
    assert shm._alive(os.getpid())
    for dead in (reaped.pid, zombie.pid):
        ex = shm.Exchange.__new__(shm.Exchange)
        ex.n, ex.rank, ex.timeout, ex._pids = 2, 0, 60.0, [os.getpid(), dead]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 1 of the group \(process {dead}\) exited"):
            ex._wait_for(lambda r: False, "reduce-scatter")
        assert time.monotonic() - start < 5
    zombie.wait()
    ex._pids, ex.timeout = [os.getpid(), os.getpid()], 0.2
    with pytest.raises(RuntimeError, match="did not reach a all-gather|within 0 s"):
        ex._wait_for(lambda r: False, "all-gather")


def engine_worker(rank: int, world: int, stage: int, shared: bool, machines: int | None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 600,  # several groups, so several calls in flight
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 600,
        },
        "topology": {"shared_memory": shared, "ranks_per_machine": machines},
    }
    engine = ds_strategy.initialize(model, opt, config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 16, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    exchanges = {id(g.comm._exchange): g.comm._exchange for g in engine.plan.groups}
    held = sum(shm.SLOTS * ex.area for ex in exchanges.values() if ex is not None)
    return {
        "weights": [t.clone() for t in engine.full_state_dict().values()],
        "used": held > 0,
        "held": held,
        "reported": engine.memory_report().get("shared_memory", 0),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_engine_trains_the_same_through_shared_memory(stage: int) -> None:
    on = run_ranks(engine_worker, 2, stage, True, None)
    off = run_ranks(engine_worker, 2, stage, False, None)
    apart = run_ranks(engine_worker, 2, stage, True, 1)  # two "machines": gloo across them
    for a, b, c in zip(on, off, apart, strict=True):
        assert a["used"] and not b["used"] and not c["used"]
        assert a["reported"] == a["held"] and b["reported"] == c["reported"] == 0
        for x, y, z in zip(a["weights"], b["weights"], c["weights"], strict=True):
            assert torch.equal(x, y) and torch.equal(x, z)
