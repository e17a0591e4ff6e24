"""A checkpoint read while another job saves it again: every load is one committed save,
whole, or a clear refusal; never a mixture of two saves, never a false "corrupt"."""

from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import ds_strategy
from ds_strategy.core.checkpoint import pinned
from tests.models import ToyLM, batches, lm_loss
from tests.pool import fork_context

# how long the writer re-saves while the reader loads (the closing note's figure: 60 s)
SECONDS = float(os.environ.get("DS_STRATEGY_TEST_RESAVE_SECONDS", "6"))
CONFIG = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "checkpoint": {"keep_last": 2},
}


def _sums(engine: ds_strategy.ZeroEngine) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in engine.full_state_dict().items()}


def resaving_rank(rank: int, port: int, root: str, stop: str, log: str) -> None:
    """One of two ranks that train a step and save it as tag ``last`` (and as
    ``global_step<N>`` under ``latest``), again and again until ``stop`` exists; rank 0
    appends each step's weights (their sums) to ``log`` once the save has returned."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), 1e-2), CONFIG)
    data = batches(400, 1, 4)
    flag = torch.zeros(1)
    for batch in data:
        engine.backward(lm_loss(engine, batch[rank * 2 : rank * 2 + 2]))
        engine.step()
        engine.save_checkpoint(root, tag="last", save_latest=False)
        # global_step<N> under latest, the oldest pruned (keep_last)
        engine.save_checkpoint(root, tag=f"global_step{engine.global_steps}")
        sums = _sums(engine)
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"step": engine.global_steps, "sums": sums}) + "\n")
        flag.fill_(float(Path(stop).exists()))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            break
    engine.destroy()
    torch.distributed.destroy_process_group()


def _load_loop(root: Path, seconds: float, tag: str | None) -> tuple[list[Any], list[str]]:
    """This process (a world of one) loads ``root`` again and again: (step, weight sums) of
    each load, and the message of each refusal."""
    model = ToyLM()
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), 1e-2), CONFIG)
    loads: list[Any] = []
    refusals: list[str] = []
    deadline = time.monotonic() + seconds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "a save replacing this checkpoint was interrupted"
        while time.monotonic() < deadline:
            try:
                engine.load_checkpoint(root, tag=tag)
            except (ds_strategy.CheckpointError, FileNotFoundError) as e:
                refusals.append(str(e))
                continue
            loads.append((engine.global_steps, _sums(engine)))
    engine.destroy()
    return loads, refusals


@pytest.mark.launcher
def test_loads_while_another_job_saves_the_same_tag_each_read_one_whole_save(
    tmp_path: Path,
) -> None:
    """Two ranks save tag ``last`` (and a new ``global_step<N>`` under ``latest``, pruning
    the oldest) every step; meanwhile this process loads ``last``, then ``latest``, in a loop.
    Each load's weights are exactly those the writer had at the step the load reports."""
    from tests.pool import free_port

    root, stop, log = tmp_path / "root", tmp_path / "stop", tmp_path / "steps.jsonl"
    ctx = fork_context()
    port = free_port()
    writers = [
        ctx.Process(target=resaving_rank, args=(r, port, str(root), str(stop), str(log)))
        for r in range(2)
    ]
    for p in writers:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while not (root / "latest").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        by_tag = {tag: _load_loop(root, SECONDS / 2, tag) for tag in ("last", None)}
    finally:
        stop.touch()
        for p in writers:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in writers] == [0, 0]
    written = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        written[record["step"]] = record["sums"]
    for tag, (loads, refusals) in by_tag.items():
        assert not refusals, f"tag {tag}: {len(refusals)} refused, e.g. {refusals[:2]}"
        assert len(loads) >= 5, f"tag {tag}: only {len(loads)} loads in {SECONDS / 2} s"
        steps = {step for step, _ in loads}
        assert len(steps) >= 2, f"tag {tag}: every load read step {steps}: no save overlapped"
        for step, sums in loads:
            want = written[step]
            wrong = {k: (sums[k], want[k]) for k in want if abs(sums[k] - want[k]) > 1e-9}
            assert not wrong, f"tag {tag}: a load at step {step} mixed two saves: {wrong}"
        # the figure behind the closing note's "N loads, none mixed" (pytest -s shows it)
        print(f"tag {tag}: {len(loads)} loads of steps {min(steps)}-{max(steps)}, none mixed")


def test_a_directory_replaced_while_being_pinned_is_pinned_again(tmp_path: Path) -> None:
    """The moment the race needs, made to happen: the first pin of ``ckpt`` sees its
    directory replaced by another save after opening it, before opening its data; the load
    pins the new one and reads it whole, with no error."""
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), 1e-2), CONFIG)
    data = batches(2, 1, 4)
    engine.backward(lm_loss(engine, data[0]))
    engine.step()
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    engine.backward(lm_loss(engine, data[1]))
    engine.step()
    want = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.save_checkpoint(tmp_path / "next")
    real_open, swapped = pinned.PinnedCheckpoint._open, []

    def open_after_a_resave(self: pinned.PinnedCheckpoint, name: str) -> bool:
        if name != pinned.META_FILE and not swapped:  # the directory is replaced now
            swapped.append(name)
            (tmp_path / "ckpt").rename(tmp_path / "gone")
            (tmp_path / "next").rename(tmp_path / "ckpt")
            for f in (tmp_path / "gone").iterdir():
                f.unlink()
            (tmp_path / "gone").rmdir()
        return real_open(self, name)

    fresh = ToyLM()
    reader = ds_strategy.initialize(fresh, torch.optim.AdamW(fresh.parameters(), 1e-2), CONFIG)
    with mock.patch.object(pinned.PinnedCheckpoint, "_open", open_after_a_resave):
        reader.load_checkpoint(ckpt)
    assert swapped
    assert reader.global_steps == 2
    got = reader.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_resaved_faster_than_it_is_read_is_refused_clearly(tmp_path: Path) -> None:
    """When every attempt finds its directory replaced, the load gives up with one message
    that says so (never a CRC "corruption"), after ``TRIES`` attempts."""
    model = ToyLM()
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), 1e-2), CONFIG)
    engine.save_checkpoint(tmp_path / "ckpt")

    def always_moved(self: pinned.PinnedCheckpoint, name: str) -> bool:
        raise pinned._Moved

    with (
        mock.patch.object(pinned.PinnedCheckpoint, "_open", always_moved),
        mock.patch.object(pinned.time, "sleep"),
        pytest.raises(ds_strategy.CheckpointError, match="being saved again by another job"),
    ):
        engine.load_checkpoint(tmp_path / "ckpt")
