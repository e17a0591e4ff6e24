"""Faults that must never hang or lose a checkpoint: one rank failing in any phase of
initialisation, save or load; a save killed at every step of putting a checkpoint in place;
two jobs saving into one directory; a full disk."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.checkpoint import reshard, store
from ds_strategy.core.checkpoint.lock import CheckpointBusyError
from ds_strategy.core.checkpoint.manager import complete_in_every_stage
from tests.distributed import run_ranks
from tests.models import ToyLM, batches
from tests.pool import fork_context
from tests.test_checkpoint_manage import GB, _opt, train
from tests.test_pipeline import _config as _pipe_config
from tests.test_pipeline import mlp, mse

# -- one rank fails, the others must fail within seconds ---------------------------------------

SECONDS = 10.0  # a rank left waiting would sit in gloo until the 60 s process-group timeout


def _disk_full() -> contextlib.AbstractContextManager:
    """This rank's file syncs fail with ENOSPC, as a full disk reports a write whose blocks
    were allocated late (ext4's delayed allocation, NFS)."""
    return mock.patch.object(os, "fsync", side_effect=OSError(errno.ENOSPC, "No space left"))


def _meet(shared: Path, name: str, rank: int) -> None:
    """Wait (through files, not collectives) until both ranks have reached ``name``."""
    (shared / f"{name}.{rank}").touch()
    deadline = time.monotonic() + 45
    while not (shared / f"{name}.{1 - rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _attempt(
    name: str,
    rank: int,
    shared: Path,
    call: Callable[[], Any],
    inject: Callable[[], contextlib.AbstractContextManager] | None,
    failing_rank: int,
    root: Path,
) -> dict[str, Any]:
    """Run ``call`` on every rank with ``inject`` active on ``failing_rank`` only; the ranks
    then meet through files, so a failed rank stays alive (as a caller that catches the
    error and goes on) while the other is timed, and neither moves on before both have
    looked for what the attempt left behind."""
    start = time.monotonic()
    error = None
    try:
        with inject() if inject is not None and rank == failing_rank else contextlib.nullcontext():
            call()
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    _meet(shared, f"{name} done", rank)
    leftovers = sorted(p.name for p in root.glob("*.tmp")) if root.is_dir() else []
    _meet(shared, f"{name} checked", rank)
    return {"error": error, "seconds": seconds, "leftovers": leftovers}


def one_rank_fails_worker(rank: int, world: int, shared: str) -> dict[str, Any]:
    shared_dir = Path(shared)
    root = shared_dir / "root"
    out: dict[str, Any] = {}

    def engine(config: dict | None = None) -> ds_strategy.ZeroEngine:
        torch.manual_seed(0)
        model = ToyLM()
        return ds_strategy.initialize(
            model, _opt(model), config or {"zero_optimization": {"stage": 2}}
        )

    def run(name: str, call: Callable[[], Any], inject: Any = None, failing: int = 0) -> None:
        out[name] = _attempt(name, rank, shared_dir, call, inject, failing, root)

    # initialisation
    missing = str(shared_dir / f"no_such_config_on_rank_{rank}.json")
    run(
        "init: config file missing",
        lambda: ds_strategy.initialize(
            ToyLM(),
            None,
            missing if rank == 0 else {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        ),
    )
    other = ToyLM()

    def init_optimizer() -> None:
        model = ToyLM()
        opt = _opt(other) if rank == 0 else _opt(model)
        ds_strategy.initialize(model, opt, {})

    run("init: optimizer over another model", init_optimizer)

    def init_meta() -> None:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

        def init_fn(m: nn.Module) -> None:
            if rank == 0:
                raise RuntimeError("out of memory materialising a layer")
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()

        ds_strategy.initialize(
            model,
            lambda ps: torch.optim.SGD(ps, lr=0.1),
            {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
            param_init_fn=init_fn,
        )

    run("init: materialising a stage-3 unit", init_meta)

    e = engine()
    train(e, batches(1, 1, GB), rank, world)
    e.save_checkpoint(root, tag="good")
    real_mkdir = Path.mkdir

    def read_only(self: Path, *a: Any, **k: Any) -> None:
        if self.name.endswith(".tmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        real_mkdir(self, *a, **k)

    # saving
    run(
        "save: read-only mount",
        lambda: e.save_checkpoint(root, tag="s1"),
        lambda: mock.patch.object(Path, "mkdir", read_only),
    )
    run(
        "save: client_state that cannot be saved",
        lambda: e.save_checkpoint(root, tag="s2", client_state=(lambda: 0) if rank == 0 else {}),
    )
    run("save: disk full", lambda: e.save_checkpoint(root, tag="s3"), _disk_full)
    run(
        "save: checksums unreadable",
        lambda: e.save_checkpoint(root, tag="s4"),
        lambda: mock.patch.object(
            store, "record_checksums", side_effect=OSError(errno.EIO, "Input/output error")
        ),
    )

    def async_save() -> None:
        e.save_checkpoint(root, tag="s5", async_save=True)
        e.wait_for_checkpoint()

    run("save: asynchronous, disk full", async_save, _disk_full, failing=1)
    # loading
    run("load: a bad tag", lambda: e.load_checkpoint(root, tag="bad/tag" if rank == 0 else "good"))
    run(
        "load: restoring the counters",
        lambda: e.load_checkpoint(root, tag="good"),
        lambda: mock.patch.object(
            reshard, "_restore_engine", side_effect=RuntimeError("scheduler state does not fit")
        ),
    )
    out["latest"] = (root / "latest").read_text() if (root / "latest").exists() else None
    out["still loads"] = e.load_checkpoint(root) is None
    return out


@pytest.fixture(scope="module")
def one_rank_fails(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    shared = tmp_path_factory.mktemp("faults")
    return run_ranks(one_rank_fails_worker, 2, str(shared), timeout=400, pg_timeout=60)


SCENARIOS = [
    ("init: config file missing", "no_such_config_on_rank_0"),
    ("init: optimizer over another model", "belong to the model"),
    ("init: materialising a stage-3 unit", "out of memory materialising"),
    ("save: read-only mount", "Read-only file system"),
    ("save: client_state that cannot be saved", "lambda"),
    ("save: disk full", "no space left on device writing"),
    ("save: checksums unreadable", "Input/output error"),
    ("save: asynchronous, disk full", "no space left on device writing"),
    ("load: a bad tag", "bad/tag"),
    ("load: restoring the counters", "scheduler state does not fit"),
]


@pytest.mark.parametrize("name,message", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_one_rank_failing_fails_every_rank_at_once(
    one_rank_fails: list[dict[str, Any]], name: str, message: str
) -> None:
    for rank, out in enumerate(one_rank_fails):
        got = out[name]
        assert got["error"] is not None, f"rank {rank} did not fail in {name!r}"
        assert message in got["error"], f"rank {rank}: {got['error'][:400]}"
        assert got["seconds"] < SECONDS, f"rank {rank} took {got['seconds']:.1f} s to fail"
        assert got["leftovers"] == [], f"a failed save left {got['leftovers']}"
    # the rank that did not fail itself names the rank that did, unless DCP's own gathering
    # gave both ranks the failure (the writes)
    asynchronous = "asynchronous" in name
    if "disk full" not in name:
        assert "(found by rank 0)" in one_rank_fails[1][name]["error"]
    if asynchronous:
        assert "asynchronous checkpoint save" in one_rank_fails[0][name]["error"]


def test_after_the_failures_the_root_is_intact(one_rank_fails: list[dict[str, Any]]) -> None:
    for out in one_rank_fails:
        assert out["latest"] == "good" and out["still loads"]


def test_disk_full_first_line_names_the_file_and_the_bytes_needed(
    one_rank_fails: list[dict[str, Any]],
) -> None:
    first = one_rank_fails[0]["save: disk full"]["error"].splitlines()[0]
    assert first.startswith("CheckpointWriteError: no space left on device writing ")
    assert ".tmp" in first and "needed " in first and " bytes" in first


def pipeline_stage_fails_worker(rank: int, world: int, shared: str) -> dict[str, Any]:
    """Two pipeline stages, one rank each: one stage's save or load fails."""
    shared_dir = Path(shared)
    root = shared_dir / "pipe"
    model = mlp()
    engine = ds_strategy.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _pipe_config(2, "1f1b", 1), loss_fn=mse
    )

    def read_only(self: Path, *a: Any, **k: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    out = {
        "save": _attempt(
            "pipe save",
            rank,
            shared_dir,
            lambda: engine.save_checkpoint(root),
            lambda: mock.patch.object(Path, "mkdir", read_only),
            1,
            root / f"stage_{rank}",
        )
    }
    engine.save_checkpoint(root)
    if rank == 1:
        shutil.rmtree(root / "stage_1")
    torch.distributed.barrier()  # removed before either stage looks
    out["load"] = _attempt(
        "pipe load", rank, shared_dir, lambda: engine.load_checkpoint(root), None, 1, root
    )
    return out


def test_one_pipeline_stage_failing_fails_every_stage(tmp_path: Path) -> None:
    results = run_ranks(pipeline_stage_fails_worker, 2, str(tmp_path), timeout=300, pg_timeout=60)
    for phase, message in (
        ("save", "Read-only file system"),
        ("load", "stage_<k> directory is missing"),
    ):
        for rank, out in enumerate(results):
            got = out[phase]
            assert got["error"] is not None and message in got["error"], (phase, rank, got)
            assert got["seconds"] < SECONDS, (phase, rank, got["seconds"])
        assert "(found by rank 1)" in results[0][phase]["error"]


# -- a save killed at every step of putting the checkpoint in place ------------------------------

_MUTATIONS = ("mkdir", "rename", "replace", "unlink", "rmdir", "fsync")


def _kill_at(step: int, log: list[str]) -> None:
    """From now on, SIGKILL this process just before its ``step``-th filesystem change."""
    for name in _MUTATIONS:
        real = getattr(os, name)

        def patched(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            log.append(_name)
            if len(log) == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(*a, **k)

        setattr(os, name, patched)


def each_kill_point(root: Path, save: Any, limit: int) -> Any:
    """Set ``root`` aside; for each n restore it and run ``save()`` in a forked child killed
    just before its n-th filesystem change; yield ``(n, killed)`` with ``root`` as the child
    left it, until a save runs to its end (or ``limit``)."""
    pristine = root.with_name("pristine")
    shutil.copytree(root, pristine)
    for step in range(1, limit):
        shutil.rmtree(root)
        shutil.copytree(pristine, root)
        pid = os.fork()
        if pid == 0:
            _kill_at(step, [])
            save()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        yield step, killed
        if not killed:
            return


def _weights(engine: ds_strategy.ZeroEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def kill_every_step_job(root: str, scenario: str, queue: Any) -> None:
    """One process (no process group): state A saved, state B re-saved with a kill before
    each filesystem change in turn, in a forked child; after each kill the parent loads the
    root, then saves into it again and checks that it is clean."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    root_p = Path(root)
    torch.manual_seed(0)
    model = ToyLM()
    writer = ds_strategy.initialize(model, _opt(model), {"checkpoint": {"keep_last": 1}})
    reader_model = ToyLM()
    reader = ds_strategy.initialize(reader_model, _opt(reader_model), {})
    train(writer, batches(1, 1, GB), 0, 1)
    first, second = ("t", "t") if scenario == "same tag" else ("global_step1", "global_step2")
    writer.save_checkpoint(root_p, tag=first)
    a = _weights(writer)
    train(writer, batches(1, 1, GB, seed=3), 0, 1)
    b = _weights(writer)
    results = []
    kill_points = each_kill_point(root_p, lambda: writer.save_checkpoint(root_p, tag=second), 200)
    for step, killed in kill_points:
        names = sorted(p.name for p in root_p.iterdir() if not p.name.startswith("."))
        latest = (root_p / "latest").read_text()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader.load_checkpoint(root_p)
        loaded = _weights(reader)
        which = "A" if _same(loaded, a) else "B" if _same(loaded, b) else "neither"
        fell_back = any("interrupted" in str(w.message) for w in caught)
        writer.save_checkpoint(root_p, tag=second)  # the next save recovers the root
        after = sorted(p.name for p in root_p.iterdir() if not p.name.startswith("."))
        reader.load_checkpoint(root_p)
        results.append(
            {
                "step": step,
                "killed": killed,
                "names": names,
                "latest": latest,
                "loaded": which,
                "fell_back": fell_back,
                "after": after,
                "after_loads_b": _same(_weights(reader), b),
            }
        )
    queue.put(results)


@pytest.mark.parametrize("scenario", ["same tag", "new tag, pruning the old"])
@pytest.mark.launcher
def test_a_save_killed_at_every_step_never_loses_latest(tmp_path: Path, scenario: str) -> None:
    ctx = fork_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=kill_every_step_job, args=(str(tmp_path / "root"), scenario, queue))
    proc.start()
    results = queue.get(timeout=240)
    proc.join(timeout=30)
    assert len(results) > 10 and not results[-1]["killed"]  # every step was a kill point
    for r in results:
        where = f"killed before filesystem change {r['step']}: root held {r['names']}"
        assert r["loaded"] in ("A", "B"), where  # a complete checkpoint, old or new
        assert r["after_loads_b"], where
        assert not any(n.endswith((".tmp", ".old")) for n in r["after"]), where
    # the loaded state moves from A to B once, at the commit, never back
    seen = [r["loaded"] for r in results]
    assert seen[0] == "A" and seen[-1] == "B" and seen == sorted(seen), seen
    if scenario == "same tag":  # the window the renames cannot close: t.old with no t
        window = [r for r in results if "t.old" in r["names"] and "t" not in r["names"]]
        assert window, [r["names"] for r in results]
        assert all(r["loaded"] == "A" and r["fell_back"] and r["latest"] == "t" for r in window)


def test_the_previous_content_of_a_tag_loads_by_name_and_the_name_is_reserved(
    tmp_path: Path,
) -> None:
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    engine.save_checkpoint(tmp_path, tag="t")
    shutil.copytree(tmp_path / "t", tmp_path / "t.old")
    assert engine.load_checkpoint(tmp_path, tag="t.old") is None
    with pytest.raises(ValueError, match="reserved"):
        engine.save_checkpoint(tmp_path, tag="t.old")
    engine.destroy()


# -- two jobs, one directory ---------------------------------------------------------------------


def other_job(root: str, queue: Any, hold: bool) -> None:
    """Another job saving into ``root``; with ``hold``, it keeps the root and sleeps."""
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    start = time.monotonic()
    try:
        engine.save_checkpoint(root, tag="theirs")
        queue.put(("saved", time.monotonic() - start, os.getpid()))
    except Exception as e:  # noqa: BLE001 - reported to the test
        queue.put((f"{type(e).__name__}: {e}", time.monotonic() - start, os.getpid()))
    if hold:
        time.sleep(120)


@pytest.mark.launcher
def test_a_second_job_saving_into_a_root_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    engine.save_checkpoint(root, tag="mine")
    ctx = fork_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=other_job, args=(str(root), queue, False))
    proc.start()
    outcome, seconds, _ = queue.get(timeout=120)
    proc.join()
    assert outcome.startswith("CheckpointError: ") or outcome.startswith("CheckpointBusyError")
    assert f"another job is saving checkpoints here (held by pid {os.getpid()}" in outcome
    assert seconds < 2.0
    assert sorted(p.name for p in root.iterdir()) == [".ds_strategy.lock", "latest", "mine"]
    engine.destroy()  # releases the root: the other job may now save
    proc = ctx.Process(target=other_job, args=(str(root), queue, False))
    proc.start()
    outcome, _, _ = queue.get(timeout=120)
    proc.join()
    assert outcome == "saved" and (root / "latest").read_text() == "theirs"


def test_a_held_root_covers_a_bare_save_into_one_of_its_tags(tmp_path: Path) -> None:
    """Job B's ``save_checkpoint("R/A2")`` while job A holds ``R``: refused, naming A, and A's
    checkpoint ``A2`` untouched. (Job A's lock is taken on a file descriptor of its own here,
    which flock treats as another process.)"""
    import fcntl
    import json as json_mod

    root = tmp_path / "R"
    model = nn.Linear(4, 4)
    a = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    a.save_checkpoint(root, tag="A2")
    a.destroy()  # the root is free again; job A takes it back below on its own descriptor
    before = {p.name: p.stat().st_mtime_ns for p in (root / "A2").iterdir()}
    lock = root / ".ds_strategy.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {"host": "hostA", "pid": 4242, "since": "2026-12-03T00:00:00+00:00", "command": "A"}
    os.pwrite(fd, json_mod.dumps(holder).encode(), 0)
    try:
        b_model = nn.Linear(4, 4)
        b = ds_strategy.initialize(b_model, torch.optim.SGD(b_model.parameters(), lr=0.1), {})
        for target, kw in ((root / "A2", {}), (root / "A2" / "nested", {"tag": "t"})):
            with pytest.raises(
                CheckpointBusyError, match=r"inside .*R, where another job .*pid 4242"
            ):
                b.save_checkpoint(target, **kw)
        assert {p.name: p.stat().st_mtime_ns for p in (root / "A2").iterdir()} == before
    finally:
        os.close(fd)
    b.save_checkpoint(root / "A2")  # once A has let go, B may replace it
    b.destroy()


def test_a_bare_save_in_flight_inside_a_directory_keeps_it_from_becoming_a_root(
    tmp_path: Path,
) -> None:
    """Job A is saving ``R/x`` (bare: ``R/x.lock`` held, ``R/x.tmp`` being written); job B's
    ``save_checkpoint(R, tag=...)`` would recover ``R`` and remove ``x.tmp`` as a leftover.
    It is refused, naming A's save, and ``x.tmp`` is untouched; once A is done, B saves."""
    import fcntl
    import json as json_mod

    root = tmp_path / "R"
    (root / "x.tmp").mkdir(parents=True)
    (root / "x.tmp" / "__0_0.distcp").write_bytes(b"A's pieces, half written")
    lock = root / "x.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {"host": "hostA", "pid": 4243, "since": "2026-12-03T00:00:00+00:00", "command": "A"}
    os.pwrite(fd, json_mod.dumps(holder).encode(), 0)
    model = nn.Linear(4, 4)
    b = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    try:
        with pytest.raises(CheckpointBusyError, match=r"saving .*R/x inside it .*pid 4243"):
            b.save_checkpoint(root, tag="theirs")
        assert (root / "x.tmp" / "__0_0.distcp").read_bytes() == b"A's pieces, half written"
        assert not (root / ".ds_strategy.lock").exists() and not (root / "theirs").exists()
    finally:
        os.close(fd)  # A's save ends (its leftover is now fair game for recovery)
    b.save_checkpoint(root, tag="theirs")
    assert (root / "latest").read_text() == "theirs" and not (root / "x.tmp").exists()
    b.destroy()


@pytest.mark.launcher
def test_a_holder_killed_with_sigkill_releases_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ctx = fork_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=other_job, args=(str(root), queue, True))
    proc.start()
    outcome, _, pid = queue.get(timeout=120)
    assert outcome == "saved"
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    with pytest.raises(CheckpointBusyError, match=f"held by pid {pid}"):
        engine.save_checkpoint(root, tag="mine")
    os.kill(pid, signal.SIGKILL)
    proc.join()
    engine.save_checkpoint(root, tag="mine")
    assert (root / "latest").read_text() == "mine"
    engine.destroy()


def test_a_bare_directory_is_locked_for_its_save_only(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_checkpoint(tmp_path / "ckpt", async_save=True)
    engine.wait_for_checkpoint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    refused = OSError(errno.EROFS, os.strerror(errno.EROFS))
    with mock.patch.object(store, "fresh_tmp", side_effect=refused), pytest.raises(OSError):
        engine.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nor after a failed one


# -- a disk that is really full ------------------------------------------------------------------

FULL_DISK_JOB = r"""
import sys, warnings
from pathlib import Path
import torch, ds_strategy
root = Path(sys.argv[1]) / "root"
torch.manual_seed(0)
model = torch.nn.Linear(128, 128)
engine = ds_strategy.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), {})
engine.backward(model(torch.randn(4, 128)).square().mean())
engine.step()
engine.save_checkpoint(root, tag="first")  # about 200 KB: fits
try:
    engine.save_checkpoint(root, tag="second")  # does not
except Exception as e:
    print("FIRST LINE:", f"{type(e).__name__}: {e}".splitlines()[0])
print("LEFT:", sorted(p.name for p in root.iterdir()))
print("LATEST:", (root / "latest").read_text())
print("LOADS:", engine.load_checkpoint(root) is None)
"""


def _private_mount(tmp: Path, size: str, script: str) -> list[str] | None:
    """A command running ``script`` with a ``size`` tmpfs mounted at ``tmp``, in a private
    mount namespace (so nothing outlives the test); None where this machine does not allow it."""
    if shutil.which("unshare") is None:
        return None
    mount = f'mount -t tmpfs -o size={size} tmpfs {tmp} && exec {sys.executable} -c "$0" {tmp}'
    for flags in (["-rm"], ["-m"]):
        cmd = ["unshare", *flags, "sh", "-c", mount, script]
        probe = subprocess.run(
            ["unshare", *flags, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp}"],
            capture_output=True,
        )
        if probe.returncode == 0:
            return cmd
    return None


@pytest.mark.launcher
def test_a_really_full_disk(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = _private_mount(disk, "300k", FULL_DISK_JOB)
    if cmd is None:
        pytest.skip("no private tmpfs mount on this machine (unshare -m refused)")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert lines["FIRST LINE"].startswith(
        f"CheckpointWriteError: no space left on device writing {disk}/root/second.tmp"
    ), lines["FIRST LINE"]
    assert "needed " in lines["FIRST LINE"]
    assert lines["LEFT"] == "['.ds_strategy.lock', 'first', 'latest']"
    assert lines["LATEST"] == "first" and lines["LOADS"] == "True"


# -- a pipeline save torn by kill -9: one whole step or a refusal, never a mixture ---------------


def torn_pipeline_rank(rank: int, port: int, root: str, victim: int, step: int, queue: Any) -> None:
    """One rank of a 2-stage pipeline (one rank a stage): saves global_step1, trains, saves
    global_step2 with ``keep_last: 1``; rank ``victim`` is killed before its ``step``-th
    filesystem change of that second save (never, for ``step`` 0)."""
    import datetime

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20)
    )
    from tests.test_pipeline import _data

    model = mlp(4)
    config = {**_pipe_config(2, "1f1b", 1), "checkpoint": {"keep_last": 1}}
    engine = ds_strategy.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, loss_fn=mse
    )
    data = _data(1)
    engine.train_batch(*data[0])
    engine.save_checkpoint(root, tag="global_step1")
    first = engine.full_state_dict()
    engine.train_batch(*data[1])
    second = engine.full_state_dict()
    if rank == victim and step:
        _kill_at(step, [])
    engine.save_checkpoint(root, tag="global_step2")
    queue.put(
        (rank, {n: {k: v.tolist() for k, v in w.items()} for n, w in (("A", first), ("B", second))})
    )
    engine.destroy()


def _torn_save(root: Path, victim: int, step: int) -> dict | None:
    """Run the two ranks; once the victim is dead, kill -9 the other rank too (a job whose
    rank died is killed whole). The ranks' weights at both saves when nothing was killed."""
    from tests.pool import free_port

    ctx = fork_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=torn_pipeline_rank, args=(r, port, str(root), victim, step, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    procs[victim].join(timeout=240)
    if procs[victim].exitcode == -signal.SIGKILL:
        time.sleep(2.0)  # the other stage goes on with its own commit, or waits for its peer
        procs[1 - victim].kill()
    procs[1 - victim].join(timeout=240)
    if any(p.exitcode != 0 for p in procs):
        return None
    return dict(queue.get(timeout=30) for _ in procs)[0]


def _consolidated(root: Path, out: Path) -> tuple[dict | str, list[str]]:
    from safetensors.torch import load_file

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ds_strategy.consolidate(root, out)
        except ds_strategy.CheckpointError as e:
            return f"refused: {e}", [str(w.message) for w in caught]
    return load_file(str(out)), [str(w.message) for w in caught]


@pytest.mark.launcher
def test_a_pipeline_save_killed_mid_way_loads_one_whole_step_or_refuses(tmp_path: Path) -> None:
    """``kill -9`` of one stage's rank at several moments of a 2-stage save: every load (here
    ``consolidate``, which reads the stages as ``load_checkpoint`` and ``init_inference`` do)
    gives the weights of one whole step, step 1 or step 2, never layers of both; a torn save
    (one stage committed, the other not) loads step 1 with a warning naming the torn stages,
    and ``keep_last: 1`` did not prune it from the stage that went ahead."""
    clean = _torn_save(tmp_path / "clean", 0, 0)
    assert clean is not None
    assert (tmp_path / "clean" / "latest").read_text() == "global_step2"  # the root's commit
    steps = {name: {k: torch.tensor(v) for k, v in w.items()} for name, w in clean.items()}
    outcomes = []
    for victim, step in ((1, 1), (1, 4), (1, 9), (0, 6)):
        root = tmp_path / f"kill_rank{victim}_at{step}"
        assert _torn_save(root, victim, step) is None  # killed
        got, said = _consolidated(root, tmp_path / f"{root.name}.safetensors")
        latest = [(root / f"stage_{k}" / "latest").read_text().strip() for k in (0, 1)]
        where = f"rank {victim} killed before filesystem change {step}; latest {latest}"
        # the root's latest only ever names a checkpoint complete in every stage
        committed = (root / "latest").read_text()
        assert committed in [tag for _, tag in complete_in_every_stage(root)], where
        if latest[0] != latest[1]:
            assert committed == "global_step1", where
        if isinstance(got, str):
            outcomes.append("refused")
            assert "stages disagree" in got, where
            continue
        which = [n for n, w in steps.items() if all(torch.equal(got[k], w[k]) for k in w)]
        assert len(which) == 1, f"{where}: a mixture of steps"
        torn = [m for m in said if "pipeline checkpoint is torn" in m]
        if latest[0] != latest[1]:
            assert which == ["A"] and torn, (where, said)
            assert "loading global_step1" in torn[0]
        outcomes.append(which[0] + (" (torn)" if torn else ""))
    assert "A (torn)" in outcomes, outcomes  # a kill left the stages at different steps
