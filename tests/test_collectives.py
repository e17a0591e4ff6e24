"""``Comm``'s reduce-scatter and all-gather on gloo (built from all-to-all and broadcasts,
see [Note: gloo's reduce-scatter and all-gather]) give the native collectives' results and
count the same bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_strategy.core.collectives import Comm, Lent
from tests.distributed import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def worker(rank: int, world: int) -> dict:
    comm = Comm()
    out: dict = {"composed": comm.reduce_needs_scratch}
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(10 + rank)
        full = (torch.randn(world * 13, generator=g) * 4).to(dtype)
        mine, native = torch.empty(13, dtype=dtype), torch.empty(13, dtype=dtype)
        work = comm.reduce_scatter(mine, full, async_op=True)
        scratch = work.scratch_nbytes
        work.wait()
        dist.reduce_scatter_tensor(native, full.clone())
        exact = sum(  # every rank's input, summed in float64
            (torch.randn(world * 13, generator=torch.Generator().manual_seed(10 + r)) * 4)
            .to(dtype)
            .double()
            for r in range(world)
        )[rank * 13 : (rank + 1) * 13]
        shard = torch.randn(13, generator=g).to(dtype)
        gathered, native_gathered = torch.empty(world * 13, dtype=dtype), torch.empty_like(full)
        comm.all_gather(gathered, shard)
        dist.all_gather_into_tensor(native_gathered, shard)
        out[dtype] = {
            "rs_err": float((mine.double() - exact).abs().max()),
            "native_err": float((native.double() - exact).abs().max()),
            "scratch": scratch,
            "full_bytes": full.numel() * full.element_size(),
            "gather_equal": torch.equal(gathered, native_gathered),
        }
    # a shard that is already the rank's chunk of the output (stages 1/2) is not copied
    full = torch.zeros(world * 5)
    full.view(world, -1)[rank].fill_(rank + 1)
    comm.all_gather(full, full.view(world, -1)[rank])
    out["in_place"] = full.view(world, -1)[:, 0].tolist()
    out["report"] = comm.take_report()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_composed_collectives_match_native(world: int) -> None:
    for rank, r in enumerate(run_ranks(worker, world)):
        assert r["composed"]
        for dtype in DTYPES:
            d = r[dtype]
            # no worse than gloo's own reduce-scatter against the float64 sum
            tol = 0 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * 16
            assert d["rs_err"] <= max(d["native_err"], 1e-5) + tol, (rank, dtype, d)
            assert d["scratch"] == d["full_bytes"], (rank, dtype, d)
            assert d["gather_equal"], (rank, dtype)
        assert r["in_place"] == [float(i + 1) for i in range(world)]
        # bytes of the ring algorithms: (N-1)/N of the full buffer per collective (each
        # call's count is truncated to whole bytes)
        per_kind = sum((world - 1) * 13 * torch.empty(0, dtype=dt).element_size() for dt in DTYPES)
        assert abs(r["report"]["reduce_scatter"] - per_kind) < len(DTYPES), r["report"]
        in_place = (world - 1) * 5 * 4
        assert abs(r["report"]["all_gather"] - per_kind - in_place) < len(DTYPES) + 1


def released_worker(rank: int, world: int) -> dict:
    """Reference counts of an asynchronous collective's buffers once ``wait()`` returns."""
    comm = Comm()
    counts: dict[str, list[int]] = {"reduce_scatter": [], "all_reduce": [], "all_gather": []}
    for _ in range(20):
        full, out = torch.randn(world * 50_000), torch.empty(50_000)
        work = comm.reduce_scatter(out, full, async_op=True)
        recv = work.scratch  # the receive buffer gloo writes into
        work.wait()
        counts["reduce_scatter"] += [full._use_count(), out._use_count()]
        if recv is not None:  # dropped by the work: only this name holds it now
            counts["reduce_scatter"].append(recv._use_count())
        del recv
        work = comm.all_reduce(full, async_op=True)
        work.wait()
        counts["all_reduce"].append(full._use_count())
        shard = torch.randn(50_000)
        work = comm.all_gather(full, shard, async_op=True)
        work.wait()
        counts["all_gather"] += [full._use_count(), shard._use_count()]
    return counts


@pytest.mark.parametrize("world", [2, 3])
def test_an_async_collective_holds_no_buffer_once_waited(world: int) -> None:
    """[Note: a collective's buffers outlive its wait]: gloo's worker thread lets go of the
    tensors after marking the work done; ``Work.wait`` returns only once it has, so every
    buffer is held by its caller alone (one reference) whatever the scheduling."""
    for counts in run_ranks(released_worker, world):
        for kind, seen in counts.items():
            assert seen and set(seen) == {1}, (kind, seen)


def test_a_buffer_held_past_patience_turns_the_waiting_off_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Something other than gloo's thread keeping a tensor (here a view, which holds its
    base) must not cost every later collective the patience: one warning, then no waiting."""
    monkeypatch.setattr(Lent, "PATIENCE", 0.05)
    monkeypatch.setattr(Lent, "enabled", True)
    t = torch.zeros(8)
    lent = Lent(t)
    held = t.view(-1)  # taken after the count: as if the collective still held it
    with pytest.warns(RuntimeWarning, match="no longer waiting for them to be freed"):
        lent.settle()
    assert not Lent.enabled
    later = Lent(t)  # nothing is marked any more: settling returns at once
    later.settle()
    assert later._marks == [] and held.numel() == 8
