"""``ZeroAccelerator.save_state`` has one commit point: a save killed at any moment loads as one
whole step (the engine, the lr scheduler, a registered object, Accelerate's step and RNG state
all from the previous save or all from this one); ``total_limit`` removes old checkpoints only
once the new one is committed; ``load_state`` refuses, naming the file, a directory that is
not one whole save. One process (a world of one); every kill is a fork of a process that has
already imported and built everything.

``DS_STRATEGY_KILL_TRIALS`` sets the number of kills at random moments (default 5), and
``DS_STRATEGY_KILL_SEED`` their seed (default 0).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import signal
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from accelerate.utils import ProjectConfiguration
from torch import nn

from ds_strategy.core.checkpoint.trust import loads
from ds_strategy.core.checkpoint.validate import CheckpointError
from ds_strategy.core.warnings import CheckpointWarning
from tests.pool import fork_context
from tests.test_accelerate_unit import _accelerator, _batches, _model

pytestmark = pytest.mark.usefixtures("clean_accelerate")  # tests/conftest.py

MANIFEST = "ds_strategy_accelerate.json"


class Counter:
    """An object registered for checkpointing (plain data: loads without trust)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


class Run:
    """A ZeroAccelerator at stage 3 with an AdamW, a StepLR it steps and a registered
    counter; ``step()`` moves every one of them, Accelerate's step and the RNG."""

    def __init__(self, project: ProjectConfiguration | None = None) -> None:
        self.acc = _accelerator(project_config=project) if project else _accelerator()
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
        self.counter = Counter()
        self.acc.register_for_checkpointing(self.counter)
        self.batches = iter(_batches(8))
        self.target: str | None = None  # where the kill tests' saves go (None: automatic)

    def step(self) -> None:
        x, y = next(self.batches)
        with self.acc.accumulate(self.model):
            self.acc.backward(nn.functional.mse_loss(self.model(x), y))
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
        self.counter.seen += 1
        torch.rand(3)  # the global generator moves between saves too

    def state(self) -> dict[str, Any]:
        """What a load must restore together: one save's, every entry."""
        weights = self.acc.get_state_dict(self.model)
        digest = hashlib.sha256()
        for name in sorted(weights):
            digest.update(weights[name].numpy().tobytes())
        return {
            "weights": digest.hexdigest()[:16],
            "global_steps": self.acc.zero_engine.global_steps,
            "scheduler": self.sched.scheduler.last_epoch,
            "counter": self.counter.seen,
            "step": self.acc.step,
            "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16],
        }


def _manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST).read_text())


def _automatic(project_dir: Path, iteration: int = 0) -> ProjectConfiguration:
    return ProjectConfiguration(
        project_dir=str(project_dir),
        automatic_checkpoint_naming=True,
        total_limit=1,
        iteration=iteration,
    )


# -- trust.loads: an interrupted write is named as such ------------------------------------------


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "case,message",
    [
        ("empty", "f.pkl: empty (a save was interrupted while writing it)"),
        ("two bytes", "f.pkl: truncated (2 bytes"),
        ("half", "f.pkl: truncated ("),
        ("half a bare pickle, trusted", "f.pkl: truncated ("),
    ],
)
def test_loads_names_an_empty_or_a_truncated_file(case: str, message: str) -> None:
    whole = _saved({"seen": 3, "t": torch.arange(100)})
    data, trusted = {
        "empty": (b"", False),
        "two bytes": (whole[:2], False),
        "half": (whole[: len(whole) // 2], False),
        "half a bare pickle, trusted": (pickle.dumps({"seen": list(range(50))})[:40], True),
    }[case]
    with pytest.raises(CheckpointError) as caught:
        loads(data, "f.pkl", trusted)
    assert str(caught.value).startswith(message)
    assert loads(whole, "f.pkl", False)["seen"] == 3  # a whole file still loads


# -- what one save writes, and what a load checks ------------------------------------------------


def test_save_state_commits_every_file_under_one_manifest(tmp_path: Path) -> None:
    """The manifest lists the engine's files, Accelerate's and a save hook's, with the step of
    each; nothing is left beside the directory; the hook wrote into the ``.tmp``."""
    run = Run()
    seen_by_hook = []

    def hook(models: list, weights: list, output_dir: str) -> None:
        seen_by_hook.append(output_dir)
        Path(output_dir, "extra.txt").write_text("written by a save hook")

    run.acc.register_save_state_pre_hook(hook)
    run.step()
    run.step()
    ckpt = tmp_path / "ckpt"
    assert run.acc.save_state(ckpt) == str(ckpt)
    manifest = _manifest(ckpt)
    files = manifest["files"]
    for name in ("scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl", "extra.txt"):
        assert "crc32" in files[name], name
    engine_files = [f for f in files if f.startswith("zero_checkpoint/")]
    assert "zero_checkpoint/ds_strategy.json" in engine_files and len(engine_files) >= 3
    shards = [f for f in engine_files if f.endswith(".distcp")]
    assert shards and all("crc32" not in files[f] for f in shards)  # the engine records theirs
    assert (manifest["step"], manifest["engines"]) == (2, {"model_0": 2})
    assert seen_by_hook == [str(tmp_path / "ckpt.tmp")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    want = run.state()
    run.step()
    run.acc.load_state(ckpt)
    assert run.state() == want


def _damage(ckpt: Path, how: str, other: Path) -> None:
    if how == "no manifest":
        (ckpt / MANIFEST).unlink()
    elif how == "scheduler.bin truncated":
        data = (ckpt / "scheduler.bin").read_bytes()
        (ckpt / "scheduler.bin").write_bytes(data[: len(data) // 2])
    elif how == "custom_checkpoint_0.pkl corrupt":
        data = bytearray((ckpt / "custom_checkpoint_0.pkl").read_bytes())
        data[-30] ^= 0xFF
        (ckpt / "custom_checkpoint_0.pkl").write_bytes(bytes(data))
    elif how == "random_states_0.pkl missing":
        (ckpt / "random_states_0.pkl").unlink()
    elif how == "zero_checkpoint of another save":  # sizes and checksums agree: steps do not
        shutil.rmtree(ckpt / "zero_checkpoint")
        shutil.copytree(other / "zero_checkpoint", ckpt / "zero_checkpoint")
        manifest, theirs = _manifest(ckpt), _manifest(other)["files"]
        mine = {k: v for k, v in manifest["files"].items() if not k.startswith("zero_checkpoint/")}
        engine = {k: v for k, v in theirs.items() if k.startswith("zero_checkpoint/")}
        manifest["files"] = {**mine, **engine}
        (ckpt / MANIFEST).write_text(json.dumps(manifest))


DAMAGES = {
    "no manifest": f"ckpt: no {MANIFEST}, so not a complete save_state of this version",
    "scheduler.bin truncated": "scheduler.bin: truncated: ",
    "custom_checkpoint_0.pkl corrupt": "custom_checkpoint_0.pkl: corrupt: ",
    "random_states_0.pkl missing": "random_states_0.pkl: missing; ",
    "zero_checkpoint of another save": "the engine checkpoint is at step 1, but ",
}


@pytest.mark.parametrize("how", list(DAMAGES))
def test_load_state_refuses_a_directory_that_is_not_one_whole_save(
    tmp_path: Path, how: str
) -> None:
    """Refused before anything is loaded: the live state is untouched."""
    run = Run()
    run.step()
    run.acc.save_state(tmp_path / "other")  # step 1
    run.step()
    run.acc.save_state(tmp_path / "ckpt")  # step 2
    run.step()
    live = run.state()
    _damage(tmp_path / "ckpt", how, tmp_path / "other")
    with pytest.raises(CheckpointError) as caught:
        run.acc.load_state(tmp_path / "ckpt")
    assert DAMAGES[how] in str(caught.value)
    assert run.state() == live


def test_save_state_refuses_an_output_dir_holding_other_files(tmp_path: Path) -> None:
    """Accelerate writes into an existing directory; the commit replaces it whole, so one
    holding files save_state did not write is refused, untouched. An empty one, or an
    earlier save_state's, is replaced."""
    run = Run()
    run.step()
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"out: already exists and is not an earlier .*notes"):
        run.acc.save_state(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    run.acc.save_state(empty)
    run.step()
    run.acc.save_state(empty)  # over its own earlier save
    assert _manifest(empty)["step"] == 2
    (empty / "notes.txt").write_text("added later")
    with pytest.raises(
        CheckpointError, match=r"is an earlier save_state's, but also holds .*notes"
    ):
        run.acc.save_state(empty)
    assert (empty / "notes.txt").exists() and _manifest(empty)["step"] == 2


def test_a_failed_save_with_total_limit_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """Accelerate removes the old checkpoint before it saves; here a save failing after the
    engines wrote theirs leaves checkpoint_0 whole and loadable, and nothing else."""
    run = Run(_automatic(tmp_path))
    run.step()
    run.acc.save_state()
    want = run.state()
    run.step()
    with (
        mock.patch("ds_strategy.accelerate._front.save_custom_state", side_effect=OSError("full")),
        pytest.raises(OSError, match="full"),
    ):
        run.acc.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0"]
    run.acc.load_state()
    assert run.state() == want
    run.acc.project_configuration.iteration = 1
    run.step()
    run.acc.save_state()  # a whole save: only now is checkpoint_0 removed
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1"]


def test_an_interrupted_replacement_loads_the_previous_save_and_the_next_save_restores_it(
    tmp_path: Path,
) -> None:
    """Killed between ``ckpt -> ckpt.old`` and ``ckpt.tmp -> ckpt``: a load reads ``ckpt.old``
    with a warning; the next save puts it back first, then replaces it."""
    run = Run()
    run.step()
    ckpt = tmp_path / "ckpt"
    run.acc.save_state(ckpt)
    want = run.state()
    ckpt.rename(tmp_path / "ckpt.old")
    (tmp_path / "ckpt.tmp").mkdir()  # the new save, complete or not: never committed
    run.step()
    with pytest.warns(CheckpointWarning, match="replacing this save_state was interrupted"):
        run.acc.load_state(ckpt)
    assert run.state() == want
    run.step()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run.acc.save_state(ckpt)
    assert [str(w.message).split(": ", 1)[1][:40] for w in said] == [
        "restoring the previous save_state from c",
        "removing the leftover of an interrupted ",
    ]
    assert all(w.category is CheckpointWarning for w in said)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert _manifest(ckpt)["step"] == 2


# -- kill -9 at every filesystem step, and at random moments -------------------------------------


def _in_child(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child (which may change anything: the parent keeps its state);
    its result, or its error as a string."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out: Any = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = f"error: {type(e).__name__}: {e}"
        with os.fdopen(write, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def _aim(run: Run, root: Path, iteration: int = 1) -> None:
    """Point ``run``'s saves at ``root``: ``root/ckpt``, or, for a root named ``automatic``,
    Accelerate's automatic naming there with ``total_limit=1``."""
    if root.parent.name == "automatic":
        run.acc.project_configuration = _automatic(root, iteration)
        run.target = None
    else:
        run.acc.project_configuration = ProjectConfiguration()
        run.target = str(root / "ckpt")


def _save_then_exit(run: Run) -> Callable[[], None]:
    def save() -> None:  # in a forked child, which must never return into the parent's loop
        try:
            run.acc.save_state(run.target)
        finally:
            os._exit(0)

    return save


def _listing(root: Path) -> list[str]:
    names = sorted(p.name for p in root.iterdir())
    inner = root / "checkpoints"
    return names + (
        sorted(f"checkpoints/{p.name}" for p in inner.iterdir()) if inner.is_dir() else []
    )


def _verify(run: Run, root: Path, states: dict[str, dict]) -> Callable[[], dict[str, Any]]:
    """For a child: load, name the state it gave (A, B, or what is wrong), then save it again
    (which recovers whatever the kill left) and load that."""

    def verify() -> dict[str, Any]:
        names = _listing(root)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                run.acc.load_state(run.target)
            except Exception as e:  # noqa: BLE001 - the outcome is the result
                return {"names": names, "loaded": f"refused: {type(e).__name__}: {e}"}
        got = run.state()
        which = [name for name, state in states.items() if state == got]
        loaded = which[0] if which else f"torn: {got} (A {states['A']}, B {states['B']})"
        if run.target is None:  # the next automatic name, as a resumed job sets it
            saved = [p.name for p in (root / "checkpoints").glob("checkpoint_*[0-9]")]
            run.acc.project_configuration.iteration = max(int(n[11:]) for n in saved) + 1
        run.acc.save_state(run.target)
        after = _listing(root)
        run.acc.load_state(run.target)
        return {
            "names": names,
            "loaded": loaded,
            "fell_back": any("interrupted" in str(w.message) for w in said),
            "after": after,
            "after_loads_the_same": run.state() == got,
        }

    return verify


def _checked(run: Run, root: Path, states: dict[str, dict]) -> dict[str, Any]:
    """``_verify`` in a child; an error it raised after the load is the outcome too."""
    outcome = _in_child(_verify(run, root, states))
    return outcome if isinstance(outcome, dict) else {"names": _listing(root), "loaded": outcome}


def _kill_every_step(run: Run, root: Path, states: dict[str, dict]) -> list[dict[str, Any]]:
    """A save killed before each of its filesystem changes in turn (``root`` set aside as
    ``pristine`` beside it, and put back before each), then checked in another child."""
    from tests.test_checkpoint_faults import each_kill_point

    results = []
    for step, killed in each_kill_point(root, _save_then_exit(run), 400):
        results.append({"step": step, "killed": killed, **_checked(run, root, states)})
    return results


def _seconds_to_save(run: Run) -> float:
    """How long a whole save takes, timed inside a child (the fork and exit not counted)."""

    def timed() -> float:
        start = time.monotonic()
        run.acc.save_state(run.target)
        return time.monotonic() - start

    return _in_child(timed)


def _kill_at(run: Run, root: Path, states: dict[str, dict], delay: float) -> dict[str, Any]:
    """A save from ``pristine`` killed ``delay`` seconds after its fork, then checked."""
    shutil.rmtree(root)
    shutil.copytree(root.with_name("pristine"), root)
    pid = os.fork()
    if pid == 0:
        _save_then_exit(run)()
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return {"delay": delay, "killed": os.WIFSIGNALED(status), **_checked(run, root, states)}


def kill_job(tmp: str, trials: int, seed: int, queue: Any) -> None:
    """One process, no process group: state A saved into ``explicit/root/ckpt`` and, with
    ``total_limit=1``, as ``automatic/root/checkpoints/checkpoint_0``; then state B saved into
    each, killed before every filesystem change in turn, then at random moments (up to a
    little longer than a whole save takes), the two roots in turn."""
    try:
        queue.put(_kill_job(tmp, trials, seed))
    except BaseException as e:  # noqa: BLE001 - the test fails with it, not after a timeout
        queue.put(f"{type(e).__name__}: {e}")


def _kill_job(tmp: str, trials: int, seed: int) -> dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    roots = [Path(tmp) / where / "root" for where in ("explicit", "automatic")]
    run = Run()
    run.step()
    for root in roots:
        _aim(run, root, iteration=0)
        run.acc.save_state(run.target)
    states = {"A": run.state()}
    run.step()
    states["B"] = run.state()
    out: dict[str, Any] = {}
    start = time.monotonic()
    for root in roots:
        _aim(run, root)
        out[root.parent.name] = _kill_every_step(run, root, states)
    out["every step seconds"] = time.monotonic() - start
    start, rng = time.monotonic(), random.Random(seed)
    whole = {}
    for root in roots:
        _aim(run, root)
        whole[root] = _seconds_to_save(run)
    out["random"] = []
    for trial in range(trials):
        root = roots[trial % 2]
        _aim(run, root)
        outcome = _kill_at(run, root, states, rng.uniform(0.0, 1.1 * whole[root]))
        out["random"].append({"trial": trial, "where": root.parent.name, **outcome})
    out["random seconds"] = time.monotonic() - start
    out["whole save seconds"] = {str(r.parent.name): s for r, s in whole.items()}
    return out


@pytest.fixture(scope="module")
def kills(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trials = int(os.environ.get("DS_STRATEGY_KILL_TRIALS", "5"))
    seed = int(os.environ.get("DS_STRATEGY_KILL_SEED", "0"))
    ctx = fork_context()
    queue = ctx.Queue()
    tmp = tmp_path_factory.mktemp("kills")
    proc = ctx.Process(target=kill_job, args=(str(tmp), trials, seed, queue))
    proc.start()
    out = queue.get(timeout=400)
    proc.join(timeout=30)
    assert isinstance(out, dict), out
    return out


def _never_lost(results: list[dict[str, Any]]) -> None:
    for r in results:
        where = f"killed at {r.get('step', r.get('delay'))}, leaving {r['names']}"
        assert r["loaded"] in ("A", "B"), f"{where}: {r['loaded']}"
        assert r["after_loads_the_same"], where
        leftovers = [n for n in r["after"] if n.endswith((".tmp", ".old", ".lock"))]
        assert not leftovers, f"{where}: the next save left {leftovers}"


@pytest.mark.launcher
def test_a_save_state_killed_at_every_step_loads_one_whole_step(kills: dict[str, Any]) -> None:
    """``save_state`` into a directory holding the previous save: every kill loads state A
    or state B whole (engine, scheduler, registered object, step, RNG), moving from A to B
    once, at the commit; in the window between the two renames, A from ``ckpt.old``."""
    results = kills["explicit"]
    _never_lost(results)
    assert len(results) > 20 and not results[-1]["killed"]  # every step was a kill point
    seen = [r["loaded"] for r in results]
    assert seen[0] == "A" and seen[-1] == "B" and seen == sorted(seen), seen
    window = [r for r in results if "ckpt.old" in r["names"] and "ckpt" not in r["names"]]
    assert window and all(r["loaded"] == "A" and r["fell_back"] for r in window)


@pytest.mark.launcher
def test_total_limit_one_killed_at_every_step_keeps_a_loadable_checkpoint(
    kills: dict[str, Any],
) -> None:
    """Automatic naming, ``total_limit=1``: checkpoint_0 is removed only after checkpoint_1
    is committed, so every kill leaves one to load (A, then B); the next save leaves one."""
    results = kills["automatic"]
    _never_lost(results)
    assert len(results) > 20 and not results[-1]["killed"]
    seen = [r["loaded"] for r in results]
    assert seen[0] == "A" and seen[-1] == "B" and seen == sorted(seen), seen
    for r in results:
        kept = [n for n in r["after"] if n.startswith("checkpoints/checkpoint_")]
        assert len(kept) == 1, r["after"]
    assert results[-1]["names"] == ["checkpoints", "checkpoints/checkpoint_1"]


@pytest.mark.launcher
def test_a_save_state_killed_at_random_moments_loads_one_whole_step(
    kills: dict[str, Any],
) -> None:
    """``kill -9`` after a random delay (``DS_STRATEGY_KILL_TRIALS`` of them), the directory
    and the automatic-naming root in turn: each load is A or B whole, never a refusal, and
    the next save leaves no leftover."""
    results = kills["random"]
    killed = [r for r in results if r["killed"]]
    assert killed, "every save finished before its kill: no moment mid-save was tried"
    print(
        f"kill -9 at random moments: {len(results)} trials, {len(killed)} killed mid-save, "
        f"loaded {[r['loaded'] for r in results]}"
    )
    _never_lost(results)
