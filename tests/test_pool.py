"""The session's rank pool (``tests/pool.py``): ranks started once and reused; a rank raising,
hanging or exiting fails only its own call, and the next one runs on new ranks; nothing a test
changes in a rank reaches the next test."""

from __future__ import annotations

import datetime
import os
import random
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import WorkerError, run_ranks
from tests.pool import RankPool, RankPools, active


def _pool(pools: RankPools, world: int = 2) -> RankPool:
    assert active() is pools  # run_ranks goes through the session's pools
    return pools.pool(world)


def pid_worker(rank: int, world: int) -> tuple[int, int, int]:
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return os.getpid(), dist.get_world_size(), int(t.item())


def test_ranks_are_started_once_and_reused(rank_pools: RankPools) -> None:
    first = run_ranks(pid_worker, 2)
    starts = _pool(rank_pools).starts
    second = run_ranks(pid_worker, 2)
    assert [r[1:] for r in first] == [(2, 3), (2, 3)]
    assert [r[0] for r in first] == [r[0] for r in second] == _pool(rank_pools).pids
    assert _pool(rank_pools).starts == starts  # no new processes for the second call
    assert os.getpid() not in _pool(rank_pools).pids
    three = run_ranks(pid_worker, 3)  # another world size, another pool
    assert [r[1:] for r in three] == [(3, 6)] * 3


def raising_worker(rank: int, world: int, other: str) -> None:
    if rank == 1:
        raise ValueError("rank 1 was told to fail")
    if other == "barrier":
        dist.barrier()  # fails once rank 1 has gone: its teardown closes the connection
    else:
        time.sleep(3600)  # outside any collective: never reports


def hanging_worker(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(3600)
    dist.barrier()


def exiting_worker(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.slow
def test_a_rank_raising_fails_only_its_call(rank_pools: RankPools) -> None:
    pool = _pool(rank_pools)
    run_ranks(pid_worker, 2)
    pids, starts = pool.pids, pool.starts
    # rank 0 in a collective fails too, but the cause is reported first, with its traceback
    with pytest.raises(WorkerError) as err:
        run_ranks(raising_worker, 2, "barrier", timeout=120)
    text = str(err.value)
    assert text.startswith("rank 1: ValueError: rank 1 was told to fail"), text
    assert "Traceback" in text and "raising_worker" in text
    assert set(err.value.errors) == {0, 1}  # both reported: the ranks are reused
    assert run_ranks(pid_worker, 2)[0][1:] == (2, 3)
    assert (pool.pids, pool.starts) == (pids, starts)
    # rank 0 never reports: after the grace period the pool is killed, not waited on
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="^rank 1: ValueError") as err:
        run_ranks(raising_worker, 2, "sleep", timeout=120)
    assert time.monotonic() - t0 < 30 and set(err.value.errors) == {1}
    assert run_ranks(pid_worker, 2)[0][1:] == (2, 3)
    assert pool.starts == starts + 1


@pytest.mark.slow
def test_a_rank_hanging_fails_its_call_naming_the_test_and_the_rank(
    rank_pools: RankPools,
) -> None:
    pool = _pool(rank_pools)
    run_ranks(pid_worker, 2)
    before = pool.pids
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        run_ranks(hanging_worker, 2, timeout=4, pg_timeout=300)
    assert time.monotonic() - t0 < 30
    text = str(err.value)
    assert "test_a_rank_hanging_fails_its_call_naming_the_test_and_the_rank" in text, text
    assert "rank(s) [0, 1] did not finish within 4s" in text, text
    after = run_ranks(pid_worker, 2)
    assert [r[1:] for r in after] == [(2, 3), (2, 3)]
    assert not set(before) & {r[0] for r in after}  # new processes


@pytest.mark.slow
def test_a_rank_exiting_fails_its_call(rank_pools: RankPools) -> None:
    pool = _pool(rank_pools)
    run_ranks(pid_worker, 2)
    starts = pool.starts
    with pytest.raises(WorkerError, match=r"rank 1 \(exit code 3\) died without a report") as err:
        run_ranks(exiting_worker, 2, timeout=120)
    assert "test_a_rank_exiting_fails_its_call" in str(err.value)
    assert [r[1:] for r in run_ranks(pid_worker, 2)] == [(2, 3), (2, 3)]
    assert pool.starts == starts + 1


def test_every_rank_raising_keeps_the_pool(rank_pools: RankPools) -> None:
    """Every rank reported (an expected failure): the ranks are as good as new."""
    pool = _pool(rank_pools)
    run_ranks(pid_worker, 2)
    pids, starts = pool.pids, pool.starts
    with pytest.raises(WorkerError, match="ZeroDivisionError") as err:
        run_ranks(dividing_worker, 2)
    assert set(err.value.errors) == {0, 1}
    run_ranks(pid_worker, 2)
    assert pool.pids == pids and pool.starts == starts


def half_made_group_worker(rank: int, world: int) -> None:
    """Leaves this rank as a failed ``init_process_group`` does: no default group, but torch's
    group counter already advanced (a peer that raised and left can close the connection while
    this rank is still joining)."""
    # both ranks have finished joining the call's group before rank 0 closes its side: else
    # rank 1 may still be connecting when the connection closes, and fail in the harness
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        store = dist.HashStore()  # nobody else joins it: the rendezvous times out
        dist.init_process_group(
            "gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=1)
        )


def test_a_rank_left_with_a_half_made_group_joins_the_next_call(rank_pools: RankPools) -> None:
    """Group names come from a counter that only destroying the default group resets; a rank
    whose init failed would otherwise join the next call under another name and hang it."""
    pool = _pool(rank_pools)
    run_ranks(pid_worker, 2)
    pids = pool.pids
    with pytest.raises(WorkerError) as err:
        run_ranks(half_made_group_worker, 2, timeout=120)
    assert set(err.value.errors) == {0}
    assert len(run_ranks(pid_worker, 2, timeout=60)) == 2
    assert pool.pids == pids  # the ranks were fit for reuse


def dividing_worker(rank: int, world: int) -> None:
    dist.barrier()
    _ = 1 / 0


# -- isolation ---------------------------------------------------------------------------------


def changing_worker(rank: int, world: int, marker: str) -> dict[str, Any]:
    """Reads what a new process would see, then changes all of it."""
    seen = {
        "env": os.environ.get("POOL_TEST_VAR"),
        "parent_env": os.environ.get("POOL_TEST_FROM_PARENT"),
        "cwd": os.getcwd(),
        "torch": torch.rand(3).tolist(),
        "random": random.random(),
        "threads": torch.get_num_threads(),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "all_reduce": dist.all_reduce.__name__,
        "groups": len(dist.distributed_c10d._world.pg_map),
    }
    os.environ["POOL_TEST_VAR"] = marker
    os.chdir("/")
    torch.manual_seed(1234 + rank)
    random.seed(99)
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    dist.new_group([0, 1])
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: original(*a, **k)  # a counter a test forgot to undo
    return seen


def test_nothing_a_test_changes_reaches_the_next(
    rank_pools: RankPools, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _pool(rank_pools)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POOL_TEST_FROM_PARENT", "one")
    first = run_ranks(changing_worker, 2, "first")
    pids = pool.pids
    monkeypatch.setenv("POOL_TEST_FROM_PARENT", "two")
    second = run_ranks(changing_worker, 2, "second")
    assert pool.pids == pids  # the same processes, reset
    for a, b in zip(first, second, strict=True):
        assert a["env"] is None and b["env"] is None
        assert (a["parent_env"], b["parent_env"]) == ("one", "two")  # the caller's environment
        assert a["cwd"] == b["cwd"] == str(tmp_path)
        assert a["torch"] == b["torch"] and a["random"] == b["random"]
        assert b["threads"] == 1 and b["dtype"] == "torch.float32" and b["grad"] is True
        assert b["all_reduce"] == "all_reduce" and b["groups"] == a["groups"] == 1


def thread_worker(rank: int, world: int) -> None:
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="left-behind", daemon=True).start()


@pytest.mark.slow
def test_a_thread_left_running_gets_new_ranks_next(rank_pools: RankPools) -> None:
    pool = _pool(rank_pools)
    run_ranks(pid_worker, 2)
    starts = pool.starts
    assert run_ranks(thread_worker, 2) == [None, None]  # the call itself succeeds
    run_ranks(pid_worker, 2)
    assert pool.starts == starts + 1


def startup_env_worker(rank: int, world: int) -> tuple[int, str | None]:
    return os.getpid(), os.environ.get("POOL_TEST_AT_START")


@pytest.mark.launcher
def test_fresh_ranks_on_request(rank_pools: RankPools, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(rank_pools)
    run_ranks(pid_worker, 2)
    monkeypatch.setenv("POOL_TEST_AT_START", "yes")
    fresh = run_ranks(startup_env_worker, 2, fresh=True)
    assert [r[1] for r in fresh] == ["yes", "yes"]
    assert not {r[0] for r in fresh} & set(pool.pids)


def mesh_worker(rank: int, world: int, extra_groups: int) -> bool:
    """A DTensor op's result on a mesh made in this call: its mesh's groups are this call's
    (torch caches sharding results per mesh shape; a stale entry holds an earlier call's mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    for _ in range(extra_groups):  # group names differ between the two calls
        dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))["tp"]  # sub-groups
    out = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]).detach() * 2
    return out.device_mesh.get_group().group_name == mesh.get_group().group_name


def test_torch_caches_do_not_carry_a_mesh_into_the_next_test(rank_pools: RankPools) -> None:
    assert run_ranks(mesh_worker, 2, 5) == [True, True]
    assert run_ranks(mesh_worker, 2, 0) == [True, True]


def test_ports_come_from_outside_the_ephemeral_range_one_block_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rendezvous port is never one the kernel could hand to another job's connection, two
    xdist workers never offer the same one, and a port someone listens on is passed over."""
    import socket

    from benchmarks import _ranks

    low = _ranks._ephemeral_low()
    blocks: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setattr(_ranks, "_next_port", [])
        blocks[worker] = {_ranks.free_port() for _ in range(20)}
    assert not blocks["gw0"] & blocks["gw1"]
    assert all(1024 <= p < low for ports in blocks.values() for p in ports)
    assert all(len(ports) == 20 for ports in blocks.values())  # each call a new port
    monkeypatch.setattr(_ranks, "_next_port", [0])
    taken = _ranks.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        _ranks._next_port[0] -= 1  # offer the same port again: it is listened on now
        assert _ranks.free_port() == taken + 1
