"""Checkpoint roots: the ``latest`` pointer, keep-last-k, periodic and asynchronous saves,
and damaged checkpoints that fail the same clear way on every rank."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ds_strategy
from ds_strategy.config import ConfigError
from tests.distributed import run_ranks
from tests.models import ToyLM, batches, lm_loss

GB, STEPS = 12, 8


def _opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(engine: ds_strategy.ZeroEngine, data: list[torch.Tensor], rank: int, world: int) -> None:
    """Each global batch split over ``world`` ranks and the engine's accumulation steps."""
    acc = engine.gradient_accumulation_steps
    micro = GB // (world * acc)
    for batch in data:
        for m in range(acc):
            lo = (m * world + rank) * micro
            engine.backward(lm_loss(engine, batch[lo : lo + micro]))
            engine.step()


def reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyLM()
    opt = _opt(model)
    for batch in batches(steps, 1, GB):
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def periodic_worker(rank: int, world: int, root: str) -> list[str | None]:
    torch.manual_seed(0)
    model = ToyLM()
    config = {
        "zero_optimization": {"stage": 3},
        "checkpoint": {"save_dir": root, "save_interval": 2, "keep_last": 2, "async_save": True},
    }
    engine = ds_strategy.initialize(model, _opt(model), config)
    in_background = []
    for batch in batches(6, 1, GB):
        train(engine, [batch], rank, world)
        pending = engine._checkpoints._pending  # the save handed to the background writer
        in_background.append(pending.final.name if pending is not None else None)
    engine.destroy()  # waits for the last asynchronous save
    return in_background


PERIODIC: dict[str, list] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six steps at world 2 / stage 3, saving every 2 steps asynchronously, keeping 2."""
    path = tmp_path_factory.mktemp("periodic") / "ckpt"
    PERIODIC["in_background"] = run_ranks(periodic_worker, 2, str(path))
    return path


def test_periodic_async_saves_keep_the_last_two_and_point_latest_at_the_newest(root: Path) -> None:
    # the periodic saves went to the background writer (each waited for by the next one)
    steps = [None, "global_step2", "global_step2", "global_step4", "global_step4", "global_step6"]
    assert PERIODIC["in_background"] == [steps, steps]
    assert (root / "latest").read_text() == "global_step6"
    assert sorted(p.name for p in root.iterdir()) == ["global_step4", "global_step6", "latest"]
    meta = json.loads((root / "global_step4" / "ds_strategy.json").read_text())
    assert meta["global_steps"] == 4 and meta["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(meta["files"])


def test_resume_from_latest_and_from_a_tag_with_fewer_ranks(root: Path) -> None:
    model = ToyLM()
    config = {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}
    engine = ds_strategy.initialize(model, _opt(model), config)
    engine.load_checkpoint(root)  # the root: follows latest
    assert engine.global_steps == 6
    # global_step4 was written in the background while steps 5 and 6 changed the weights:
    # finishing from it must still give the uninterrupted run
    engine.load_checkpoint(root, tag="global_step4")
    assert engine.global_steps == 4
    train(engine, batches(STEPS, 1, GB)[4:], 0, 1)
    diff = max_diff(engine.full_state_dict(), reference())
    assert diff <= 2e-5, f"max |w - uninterrupted| = {diff:.3g}"


def test_root_without_a_tag_tags_by_step_and_bad_tags_are_errors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {"checkpoint": {"keep_last": 1}})
    root = tmp_path / "run"
    assert engine.save_checkpoint(root, tag="first") == root / "first"
    train(engine, batches(1, 1, GB), 0, 1)
    out = engine.save_checkpoint(root, client_state={"k": 1})  # a root (has latest): tag by step
    assert out == root / "global_step1" and (root / "latest").read_text() == "global_step1"
    assert (root / "first").is_dir()  # keep_last prunes only the engine's global_step<N> tags
    engine.save_checkpoint(root, tag="side", save_latest=False)
    assert (root / "latest").read_text() == "global_step1" and (root / "global_step1").is_dir()
    train(engine, batches(1, 1, GB, seed=9), 0, 1)
    engine.save_checkpoint(root, client_state={"k": 2})
    names = sorted(p.name for p in root.iterdir())
    # keep_last=1 of global_step*; the lock this run holds on the root until destroy()
    assert names == [".ds_strategy.lock", "first", "global_step2", "latest", "side"]
    assert engine.load_checkpoint(root) == {"k": 2}
    for bad in ("a/b", "x.tmp", "x.old", "latest", ".."):
        with pytest.raises(ValueError, match="tag"):
            engine.save_checkpoint(root, tag=bad)
    (root / "latest").write_text("gone")
    with pytest.raises(FileNotFoundError, match="latest names 'gone'"):
        engine.load_checkpoint(root)
    engine.destroy()
    assert not (root / ".ds_strategy.lock").exists()
    with pytest.raises(ConfigError, match="save_dir"):
        ds_strategy.initialize(model, _opt(model), {"checkpoint": {"save_interval": 5}})


# -- damaged checkpoints ------------------------------------------------------------------------


def _damage(src: Path, dst: Path, case: str) -> str:
    """A copy of ``src`` with one kind of damage; returns the file the error must name."""
    shutil.copytree(src, dst)
    data = dst / "__1_0.distcp"
    if case == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        return str(data)
    if case == "bitflip":  # same size: only the recorded CRC-32 can tell
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
        return str(data)
    if case == "missing":
        data.unlink()
        return str(data)
    if case == "metadata":
        (dst / ".metadata").write_bytes((dst / ".metadata").read_bytes()[:100])
        return str(dst / ".metadata")
    if case == "json":
        (dst / "ds_strategy.json").write_text('{"format": "ds_strategy-sharded-1", "sha')
        return str(dst / "ds_strategy.json")
    raise ValueError(case)


CASES = ["truncated", "bitflip", "missing", "metadata", "json"]
PATTERNS = {
    "truncated": "truncated",
    "bitflip": "corrupt: CRC-32",
    "missing": "missing",
    "metadata": "truncated",
    "json": "not valid JSON",
}


def damaged_load_worker(rank: int, world: int, paths: list[str], good: str) -> list[str]:
    errors = []
    for p in paths:
        model = ToyLM()
        engine = ds_strategy.initialize(model, _opt(model), {"zero_optimization": {"stage": 2}})
        try:
            engine.load_checkpoint(p)
            errors.append("")
        except Exception as e:  # noqa: BLE001 - the test compares the messages
            errors.append(f"{type(e).__name__}: {e}")
    model = ToyLM(d=16)  # another model: shapes differ
    engine = ds_strategy.initialize(model, _opt(model), {"zero_optimization": {"stage": 2}})
    try:
        engine.load_checkpoint(good)
        errors.append("")
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_damaged_checkpoints_fail_on_every_rank_naming_the_file(root: Path, tmp_path: Path) -> None:
    good = root / "global_step6"
    paths, names = [], []
    for case in CASES:
        dst = tmp_path / case
        names.append(_damage(good, dst, case))
        paths.append(str(dst))
    results = run_ranks(damaged_load_worker, 2, paths, str(good), timeout=180)
    for rank, errors in enumerate(results):
        for case, name, err in zip(CASES, names, errors, strict=False):
            assert name in err and PATTERNS[case] in err, (rank, case, err)
        shape_err = errors[-1]
        assert "ds_strategy.json: checkpoint does not match this model" in shape_err
        assert re.search(
            r"'[\w.]+' has shape \[\d+, 24\] in the checkpoint, \[\d+, 16\]", shape_err
        )
    # the bit flip is in the share of files one rank verifies; the other learns it from that rank
    flip = [errors[CASES.index("bitflip")] for errors in results]
    assert sum("found by rank" in e for e in flip) == 1
    # a world of one (no process group) checks every file itself
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {})
    for case, path, name in zip(CASES, paths, names, strict=True):
        with pytest.raises(ValueError, match=PATTERNS[case]) as info:
            engine.load_checkpoint(path)
        assert name in str(info.value)


def test_stale_tmp_directories_are_ignored_by_load_and_removed_by_the_next_save(
    root: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(root, run)
    (run / "global_step8.tmp").mkdir()
    (run / "global_step8.tmp" / "__0_0.distcp").write_bytes(b"half")
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {})
    engine.load_checkpoint(run)
    assert engine.global_steps == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(run, tag="after")
    assert any("global_step8.tmp" in str(w.message) for w in caught)
    assert not (run / "global_step8.tmp").exists()
    assert (run / "latest").read_text() == "after"


def test_consolidate_follows_latest_and_refuses_a_damaged_checkpoint(
    root: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    out = ds_strategy.consolidate(root, tmp_path / "model.safetensors")  # a root: its latest
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), {})
    engine.load_checkpoint(root / "global_step6")
    want = engine.full_state_dict()
    got = load_file(out)
    assert got.keys() and all(torch.equal(got[k], want[k]) for k in got)
    name = _damage(root / "global_step6", tmp_path / "flipped", "bitflip")
    with pytest.raises(ValueError, match="corrupt: CRC-32") as info:
        ds_strategy.consolidate(tmp_path / "flipped", tmp_path / "bad.safetensors")
    assert name in str(info.value) and not (tmp_path / "bad.safetensors").exists()


def test_periodic_saves_follow_optimizer_steps_not_micro_steps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    config = {
        "gradient_accumulation_steps": 2,
        "checkpoint": {"save_dir": str(root), "save_interval": 2},
    }
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), config)
    train(engine, batches(3, 1, GB), 0, 1)  # 6 micro-steps, 3 optimizer steps
    assert sorted(p.name for p in root.iterdir()) == [".ds_strategy.lock", "global_step2", "latest"]
    written = (root / "global_step2" / "ds_strategy.json").stat().st_mtime_ns
    model = ToyLM()
    engine = ds_strategy.initialize(model, _opt(model), config)
    engine.load_checkpoint(root)
    batch = batches(1, 1, GB)[0]
    engine.backward(lm_loss(engine, batch[: GB // 2]))
    engine.step()  # a micro-step right after the load: no save
    assert (root / "global_step2" / "ds_strategy.json").stat().st_mtime_ns == written
    engine.backward(lm_loss(engine, batch[GB // 2 :]))
    engine.step()  # optimizer step 3: not a multiple of 2
    train(engine, batches(1, 1, GB), 0, 1)  # step 4
    assert (root / "latest").read_text() == "global_step4"
