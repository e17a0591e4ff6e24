"""NVMe swap files are checked and cleaned up: bytes changed behind the run's back are an
error naming the file, a killed run's swap directory is reclaimed by the next run (a live
run's never), and a full drive or a file-size limit, while swapping or writing consolidated
weights, is an error naming the path and the bytes, with no ``.tmp`` left behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.core.offload import swap as swap_mod
from ds_strategy.core.offload.integrity import BLOCK, SwapCorruptionError, SwapWriteError
from ds_strategy.core.offload.streaming import SwapFiles
from tests.models import ToyLM, batches, lm_loss, make_optimizer
from tests.test_offload import GB, _config, _nvme

HAS_DEV_FULL = Path("/dev/full").exists()


def _engine(config: dict) -> ds_strategy.ZeroEngine:
    torch.manual_seed(0)
    model = ToyLM()
    config = dict(config)
    config.pop("gradient_accumulation_steps", None)  # every backward steps
    return ds_strategy.initialize(model, make_optimizer("adamw", model), config)


def _step(engine: ds_strategy.ZeroEngine, seed: int = 0) -> None:
    engine.backward(lm_loss(engine, batches(1, 1, GB, seed=seed)[0]))
    engine.step()


def _state_file(engine: ds_strategy.ZeroEngine) -> Path:
    """The largest file of Adam's moments: read back at every step."""
    files = list(engine._offload.swap_dir.path.glob("state_*.bin"))
    return max(files, key=lambda p: (p.stat().st_size, p.name))


def _flip(path: Path, at: int) -> None:
    """Change the byte at ``at`` of ``path`` (every bit of it), in place."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0xFF]))


# -- 1. bytes changed behind the run's back ---------------------------------------------------


def test_a_swap_file_overwritten_with_nan_between_steps_is_an_error_naming_it(
    tmp_path: Path,
) -> None:
    """The adversarial run: a moment's file filled with NaN (same size) between two steps was
    read back as is; training went on with NaN weights."""
    engine = _engine(_config(2, "nvme", path=str(tmp_path)))
    _step(engine)
    victim = _state_file(engine)
    nan = torch.full((victim.stat().st_size // 4,), float("nan"))
    victim.write_bytes(nan.numpy().tobytes())
    with pytest.raises(SwapCorruptionError, match="resume from the last checkpoint") as e:
        _step(engine, seed=1)
    assert str(victim) in str(e.value) and "was changed after this run wrote it" in str(e.value)
    assert e.value.path == victim
    engine.destroy()


def test_a_checkpoint_never_saves_a_changed_swap_file(tmp_path: Path) -> None:
    """A save streams pieces from the swap files, each checked against its blocks; a load
    writes pieces into them and updates their checksums, so the steps after it read clean."""
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = _engine(_config(2, "nvme", path=str(swap)))
    _step(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.load_checkpoint(tmp_path / "ckpt")  # every piece written into the files
    _step(engine, seed=1)  # reads every moment back: their checksums followed the load
    victim = _state_file(engine)
    _flip(victim, victim.stat().st_size // 2)  # one byte, in the middle
    with pytest.raises(OSError, match="was changed after this run wrote it") as e:
        engine.save_checkpoint(tmp_path / "ckpt2")
    assert str(victim) in str(e.value)
    engine.destroy()


def test_pieces_are_checked_and_rechecksummed_block_by_block(tmp_path: Path) -> None:
    """Pieces that start and end inside blocks, straddle a block boundary, or end the file
    (a last block shorter than the others): written in place, read back whole and in
    pieces; a changed byte fails the pieces whose blocks hold it, and only those."""
    d = swap_mod.SwapDir(tmp_path, rank=0, needed_bytes=0, checkpoint_marker="x.json")
    n = 3 * BLOCK // 4 + 5  # floats: 4 blocks, the last one 20 bytes
    want = torch.randn(n)
    t = swap_mod.SwappedTensor(want.clone(), d.file("t"), d.pool)
    t.release(dirty=True)
    t.wait()
    files = SwapFiles([t], lambda *a: torch.empty(0))
    q = BLOCK // 4  # floats per block
    for start, numel in [(3, 7), (q - 3, 10), (n - 3, 3), (q + 1, 2 * q)]:
        values = torch.randn(numel)
        files.write((t, start * 4, numel), values)
        want[start : start + numel] = values
        assert torch.equal(files.read((t, start * 4, numel)), values)
    assert torch.equal(t.acquire(), want)  # the whole file, checked block by block
    t.release(dirty=False)
    _flip(t.path, 2 * BLOCK + 8)
    assert torch.equal(files.read((t, 10 * 4, 4)), want[10:14])  # block 0: untouched
    with pytest.raises(SwapCorruptionError, match=f"bytes {2 * BLOCK:,}-{3 * BLOCK:,}"):
        files.read((t, (2 * q - 1) * 4, 3))  # straddles blocks 1 and 2
    with pytest.raises(SwapCorruptionError):  # a write checks the blocks it shares first
        files.write((t, (2 * q + 5) * 4, 1), torch.zeros(1))
    with pytest.raises(SwapCorruptionError, match=re.escape(str(t.path))):
        t.acquire()
    d.close()


# -- 2. swap directories of runs that are gone ------------------------------------------------

_HOLDER = """
import sys, torch
from ds_strategy.core.offload.swap import SwapDir, SwappedTensor
d = SwapDir(sys.argv[1], rank=0, needed_bytes=0, checkpoint_marker="x.json")
t = SwappedTensor(torch.ones(1 << 18), d.file("t"), d.pool)  # 1 MiB in its file
t.release(dirty=True)
t.wait()
print(d.path, flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
raise RuntimeError("the run fails")  # an uncaught exception: its directory goes at exit
"""


def _holder(base: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(base)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _held_dir(proc: subprocess.Popen) -> Path:
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if not line:
        raise AssertionError(f"the holder failed: {proc.stderr.read()}")  # type: ignore[union-attr]
    return Path(line)


def _swap_bytes(base: Path) -> int:
    return sum(
        f.stat().st_blocks * 512
        for d in base.glob(f"{swap_mod.DIR_PREFIX}*")
        for f in d.iterdir()
        if f.is_file()
    )


@pytest.mark.launcher
def test_a_killed_runs_swap_directory_is_reclaimed_and_a_live_ones_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two runs swap to one small drive; one is killed with kill -9 and leaves its files.
    The next run, on a drive with room for it only once those files are gone, reclaims them
    and starts; the live run's directory is untouched, and goes when that run ends with an
    exception."""
    procs = [_holder(tmp_path) for _ in range(2)]
    try:
        dead, live = [_held_dir(p) for p in procs]
        real = shutil.disk_usage
        room = [1000]  # bytes of the drive; what the swap directories hold is used
        monkeypatch.setattr(
            swap_mod.shutil,
            "disk_usage",
            lambda p: real(p)._replace(free=max(0, room[0] - _swap_bytes(tmp_path))),
        )
        with pytest.raises(OSError, match=r"needs ([\d,]+) bytes") as e:
            _engine(_nvme(tmp_path))
        message = str(e.value)
        assert "2 other swap directories there hold" in message, message
        assert dead.name in message and live.name in message
        assert dead.exists() and live.exists()  # both runs alive: nothing reclaimed
        need = int(message.split("needs ")[1].split(" bytes")[0].replace(",", ""))
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        assert dead.exists()  # kill -9: the run could not clean up
        room[0] = need + _swap_bytes(tmp_path) - 4096  # fits only without the dead run's MiB
        with caplog.at_level("WARNING", logger="ds_strategy"):
            engine = _engine(_nvme(tmp_path))
        assert not dead.exists() and f"removed {dead}" in caplog.text
        assert (live / "t.bin").stat().st_size == 1 << 20  # the live run's files untouched
        engine.destroy()
        procs[1].stdin.close()  # type: ignore[union-attr]
        assert procs[1].wait(timeout=30) != 0  # it ended with its exception
        assert "the run fails" in procs[1].stderr.read()  # type: ignore[union-attr]
        assert not live.exists()
        assert os.listdir(tmp_path) == []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def test_a_swap_directory_without_an_owner_lock_is_left_alone(tmp_path: Path) -> None:
    """A directory with no ``owner.lock`` (a run of an older ds_strategy, or one starting this
    instant) is never removed: nothing says its run is gone."""
    old = tmp_path / f"{swap_mod.DIR_PREFIX}rank0_older"
    old.mkdir()
    (old / "state_0_exp_avg.bin").write_bytes(b"\0" * 4096)
    d = swap_mod.SwapDir(tmp_path, rank=0, needed_bytes=0, checkpoint_marker="x.json")
    assert (old / "state_0_exp_avg.bin").exists()
    d.close()
    assert not d.path.exists() and old.exists()


def test_a_swap_directory_goes_with_destroy_even_after_a_failed_write(tmp_path: Path) -> None:
    """A write behind that failed (a full drive) is raised by ``destroy()``, as a user's
    ``finally`` calls it, after the swap directory is removed; it used to stay until exit."""
    if not HAS_DEV_FULL:
        pytest.skip("needs /dev/full")
    net = torch.nn.Linear(64, 64)
    engine = ds_strategy.initialize(net, torch.optim.AdamW(net.parameters()), _nvme(tmp_path))
    (grads,) = engine._offload.grad_swaps
    grads.path.symlink_to("/dev/full")  # the kernel answers every write there with ENOSPC
    engine.backward(engine(torch.randn(2, 64)).sum())  # the gradient shard is written behind
    d = engine._offload.swap_dir.path
    with pytest.raises(SwapWriteError):
        engine.destroy()
    assert not d.exists()


# -- 3. a full drive or a file-size limit while swapping --------------------------------------


def test_a_full_drive_mid_backward_names_the_swap_file_and_the_bytes(tmp_path: Path) -> None:
    """The adversarial run's resume ended mid-backward with a bare ``[Errno 28]``."""
    if not HAS_DEV_FULL:
        pytest.skip("needs /dev/full")
    engine = _engine(_config(2, "nvme", path=str(tmp_path)))
    swaps = engine._offload.grad_swaps
    for s in swaps:
        s.path.symlink_to("/dev/full")
    with pytest.raises(SwapWriteError, match="no space left on the drive of nvme_path") as e:
        _step(engine)
    failed = next(s for s in swaps if str(s.path) in str(e.value))
    assert e.value.errno == errno.ENOSPC and e.value.path == failed.path
    assert f"needs {failed.nbytes:,} bytes" in str(e.value)
    assert "are free there" in str(e.value)
    with contextlib.suppress(SwapWriteError):  # another write that failed, if still pending
        engine.destroy()


_SIZE_LIMITED = """
import json, os, resource, signal, sys
from pathlib import Path
import torch
import ds_strategy
from ds_strategy.core.offload.swap import SwapDir, SwappedTensor
limit, swap, ckpt, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not death
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
got = {}
def caught(key, fn):
    try:
        fn()
    except OSError as e:
        got[key] = {"type": type(e).__name__, "errno": e.errno, "message": str(e)}
d = SwapDir(swap, rank=0, needed_bytes=0, checkpoint_marker="x.json")
t = SwappedTensor(torch.ones(limit // 2), d.file("big"), d.pool)  # twice the limit
t.release(dirty=True)
caught("swap", t.wait)
got["swap_file"] = str(t.path)
d.close()
caught("consolidate", lambda: ds_strategy.consolidate(ckpt, out))
got["out_dir"] = sorted(os.listdir(out.parent))
print(json.dumps(got))
"""

LIMIT = 1 << 16  # bytes a file may have in the size-limited process


@pytest.fixture(scope="module")
def size_limited(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process under ``RLIMIT_FSIZE`` (SIGXFSZ ignored) swaps a tensor larger than the
    limit and consolidates a checkpoint whose weights are larger too."""
    tmp = tmp_path_factory.mktemp("fsize")
    net = torch.nn.Linear(256, 256)
    engine = ds_strategy.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), {})
    engine.save_checkpoint(tmp / "ckpt")
    engine.destroy()
    (tmp / "swap").mkdir()
    (tmp / "out").mkdir()
    args = [str(LIMIT), str(tmp / "swap"), str(tmp / "ckpt"), str(tmp / "out" / "m.safetensors")]
    run = subprocess.run(
        [sys.executable, "-c", _SIZE_LIMITED, *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    got["weights_bytes"] = sum(p.numel() * 4 for p in net.parameters())
    got["swap_dir"] = os.listdir(tmp / "swap")
    return got


@pytest.mark.launcher
def test_a_swap_file_over_the_file_size_limit_names_the_file_and_the_limit(
    size_limited: dict[str, Any],
) -> None:
    e = size_limited["swap"]
    assert e["type"] == "SwapWriteError" and e["errno"] == errno.EFBIG, e
    assert size_limited["swap_file"] in e["message"]
    assert (
        f"needs {2 * LIMIT:,} bytes" in e["message"] and f"at most {LIMIT:,} bytes" in e["message"]
    )
    assert "ulimit -f" in e["message"]
    assert size_limited["swap_dir"] == []  # its directory removed all the same


# -- 4. consolidated weights onto a full drive, or over the file-size limit -------------------


@pytest.mark.launcher
def test_consolidate_over_the_file_size_limit_names_the_output_and_leaves_nothing(
    size_limited: dict[str, Any],
) -> None:
    """The adversarial run: ``OSError: [Errno 27] File too large`` with no path, and a
    ``.tmp`` left behind."""
    e = size_limited["consolidate"]
    assert e["type"] == "WeightsWriteError" and e["errno"] == errno.EFBIG, e
    assert "m.safetensors" in e["message"] and "file too large writing" in e["message"]
    assert f"needs {size_limited['weights_bytes']:,} bytes" in e["message"]
    assert f"at most {LIMIT:,} bytes" in e["message"] and "max_shard_size" in e["message"]
    assert size_limited["out_dir"] == []


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A small checkpoint, and the bytes of its weights in fp32."""
    tmp = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    engine = ds_strategy.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), {})
    engine.save_checkpoint(tmp / "ckpt")
    engine.destroy()
    return tmp / "ckpt", sum(p.numel() * 4 for p in net.parameters())


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_consolidate_onto_a_full_drive_fails_before_writing(
    name: str,
    checkpoint: tuple[Path, int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt, nbytes = checkpoint
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=999))
    out = tmp_path / "out" / name
    with pytest.raises(ds_strategy.CheckpointWriteError, match="no space left on device") as e:
        ds_strategy.consolidate(ckpt, out)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert str(out) in str(e.value) and f"need {nbytes:,} bytes" in str(e.value)
    assert "999 bytes (999 bytes) are free there" in str(e.value)
    assert os.listdir(out.parent) == []


@pytest.mark.parametrize("shard", [None, "3KB"])
def test_consolidate_that_runs_out_of_room_mid_write_leaves_no_tmp(
    shard: str | None, checkpoint: tuple[Path, int], tmp_path: Path
) -> None:
    """The drive fills up while the file is written (its ``.tmp`` is on /dev/full, which
    answers every write with ENOSPC); with shards, the ones already written go too."""
    if not HAS_DEV_FULL:
        pytest.skip("needs /dev/full")
    ckpt, nbytes = checkpoint
    out = tmp_path / "model.safetensors"
    doomed = out if shard is None else out.with_name("model-00002-of-00002.safetensors")
    doomed.with_name(doomed.name + ".tmp").symlink_to("/dev/full")
    with pytest.raises(ds_strategy.CheckpointWriteError, match="no space left on device") as e:
        ds_strategy.consolidate(ckpt, out, max_shard_size=shard)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert str(doomed) in str(e.value)
    need = int(str(e.value).split("need ")[1].split(" bytes")[0].replace(",", ""))
    assert nbytes <= need < nbytes + 1024  # the weights (and the one file's header)
    assert os.listdir(tmp_path) == []
