"""Checkpoint roots, the ``latest`` pointer, keep-last-k, periodic and asynchronous saves.

A checkpoint *root* holds tagged checkpoints and a ``latest`` file naming the newest one,
as DeepSpeed lays them out::

    ckpt/latest              "global_step200"
    ckpt/global_step100/     one sharded checkpoint (see ``sharded.py``)
    ckpt/global_step200/

``save_checkpoint(path)`` with no tag still writes the checkpoint directory ``path`` itself,
unless ``path`` is a root already (it holds ``latest``): then the tag is
``global_step<N>``. ``load_checkpoint(root)`` follows ``latest``.

[Note: ordering that keeps a crash harmless]
The checkpoint is written under ``<tag>.tmp`` and put in place when every rank has finished
(``store.commit``, ``swap.put_in_place``); only then does rank 0 replace ``latest`` (write
``latest.tmp``, then ``os.replace``) and prune old tags. A crash at any point leaves ``latest``
naming a complete checkpoint (``swap.py`` says how, for a tag saved again); the next save into
the root rolls back or removes what the crash left.

[Note: every phase agrees]
A save is three phases with an agreement point after each (``faults.together``): rank 0 takes
the root's lock (``lock.py``), recovers it and makes ``<tag>.tmp``; every rank collects its
state; every rank writes and then commits. A failure on any rank in any phase (a read-only
mount, a full disk, an unpicklable ``client_state``) raises on every rank, and rank 0 removes
``<tag>.tmp``. A load agrees the same way on the directory it resolves to.

[Note: asynchronous saves]
The state is copied (every tensor cloned, so training may change the live ones), then a
background thread writes it and commits. The thread's collectives (DCP's plan exchange, the
commit barriers) run on a second gloo process group over the same ranks, so they never
interleave with training's collectives on the engine's group. A later save, a load,
``wait_for_checkpoint()`` and ``destroy()`` wait for it; so does interpreter exit.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from ...config import ConfigError
from ..collectives import Comm
from ..faults import together
from ..layout import RankLayout
from ..profiling.ranges import ranged
from ..warnings import CheckpointWarning
from . import reshard, store, swap
from .collect import collect_state, partial_window, warn_partial_window
from .deepspeed.layout import find_deepspeed
from .deepspeed.load import load_deepspeed
from .deepspeed.opening import open_deepspeed
from .engines import MANIFEST, holds_engines, read_manifest
from .lock import LOCK_FILE, acquire, release
from .pinned import confined
from .seam import CheckpointedEngine
from .validate import META_FILE, CheckpointError, read_meta

__all__ = ["CheckpointManager", "LATEST"]

LATEST = "latest"


class CheckpointManager:
    """Saves and loads for one engine; owns the pending asynchronous save, if any."""

    def __init__(self, engine: CheckpointedEngine) -> None:
        self.engine = engine
        self.config = engine.config.checkpoint
        if self.config.save_interval is not None and not self.config.save_dir:
            raise ConfigError(
                "checkpoint.save_interval needs checkpoint.save_dir (the root directory the "
                "periodic checkpoints go to)",
                key="checkpoint.save_dir",
            )
        self._pending: _BackgroundSave | None = None
        self._side: Comm | None = None
        # saves made (an asynchronous one: begun) and the last one's directory: a pipeline
        # counts them to see a periodic save
        self.saves = 0
        self.last_saved: Path | None = None
        # global_steps when after_step last ran: a save follows an optimizer step only, never
        # a micro-step inside an accumulation, nor the first step after a load
        self._seen_steps = engine.global_steps

    # -- saving --------------------------------------------------------------------------------

    @ranged("checkpoint_save")
    def save(
        self,
        path: str | os.PathLike[str],
        tag: str | None = None,
        client_state: object = None,
        save_latest: bool = True,
        include_optimizer: bool = True,
        async_save: bool | None = None,
    ) -> Path:
        self.wait()
        root, final = self._target(Path(path), tag)
        comm = self.engine.checkpoint_comm
        lock_path = root / LOCK_FILE if root is not None else final.with_name(final.name + ".lock")
        try:
            with together(comm, CheckpointError):  # phase 1, rank 0: lock, recover, a .tmp
                if comm.rank == 0:
                    acquire(lock_path, root or final, self)
                    if root is None:
                        swap.recover(final)
                    else:
                        swap.recover_root(root)
                    store.fresh_tmp(final)
        except BaseException:
            if comm.rank == 0 and root is None:  # a bare directory is locked for its save only
                release(self, lock_path)
            raise
        tmp = swap.tmp_dir(final)
        if comm.rank == 0:
            warn_partial_window(final, partial_window(self.engine), saving=True)

        def after_rename() -> None:
            if root is not None:
                if save_latest:
                    write_latest(root, final.name)
                _prune(root, self.config.keep_last, keep=final.name)

        def finish(ok: bool) -> None:  # rank 0, once the save has succeeded or failed
            if not ok:
                shutil.rmtree(tmp, ignore_errors=True)
            if root is None:  # a bare directory is locked for its save only
                release(self, lock_path)

        try:
            with together(comm, CheckpointError):  # phase 2: what each rank saves
                mine = collect_state(self.engine, client_state, include_optimizer)
            needed, meta = store.total_bytes(comm, mine.nbytes), mine.meta
            use_async = self.config.async_save if async_save is None else async_save
            if not use_async:
                files = self.engine.checkpoint_io
                store.write(mine.state_dict(), tmp, comm, final, needed, files)  # phase 3
                store.commit(comm, tmp, final, meta, needed, after_rename)
                if comm.rank == 0:
                    finish(ok=True)
                self.saves, self.last_saved = self.saves + 1, final
                return final
            side = self._side_comm()
            with together(comm, CheckpointError):
                staged = mine.snapshot().state_dict()
            del mine
        except BaseException:
            if comm.rank == 0:
                finish(ok=False)
            raise

        def run() -> None:
            ok = False
            try:
                store.write(staged, tmp, side, final, needed)
                store.commit(side, tmp, final, meta, needed, after_rename)
                ok = True
            finally:
                if side.rank == 0:
                    finish(ok)

        self._pending = _BackgroundSave(run, final)
        self.saves, self.last_saved = self.saves + 1, final
        return final

    def after_step(self) -> None:
        """Called by ``engine.step()``: the periodic save, every ``save_interval`` steps."""
        every = self.config.save_interval
        steps = self.engine.global_steps
        if steps == self._seen_steps:
            return
        self._seen_steps = steps
        if every is None or steps % every != 0:
            return
        assert self.config.save_dir is not None  # (__init__ refused an interval without it)
        self.engine.save_checkpoint(self.config.save_dir, tag=f"global_step{steps}")

    def writing(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._pending is not None and self._pending.thread.is_alive()

    def wait(self) -> None:
        """Block until a pending asynchronous save has been written and committed; raise its
        error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()

    def release(self) -> None:
        """Give up this engine's hold on the roots it saved into (``engine.destroy()``)."""
        release(self)

    # -- loading -------------------------------------------------------------------------------

    @ranged("checkpoint_load")
    def load(
        self,
        path: str | os.PathLike[str],
        tag: str | None = None,
        load_optimizer: bool = True,
        require_checksums: bool = True,
        trust_checkpoint: bool = False,
    ) -> object:
        self.wait()
        with together(self.engine.checkpoint_comm, CheckpointError):
            if load_optimizer and tag is None and holds_engines(Path(path)):
                raise CheckpointError(
                    f"{path} holds several engines (one per model or optimizer), each with its "
                    "own optimizer state: load their weights into this one engine with "
                    "load_optimizer=False, or resume each engine from its own part "
                    f"({path}/<name>/<tag>, named in {MANIFEST})"
                )
            deepspeed = find_deepspeed(Path(path), tag)
        if deepspeed is not None:  # DeepSpeed's own layout, read by content
            with together(self.engine.checkpoint_comm, CheckpointError):
                ckpt = open_deepspeed(deepspeed, trust_checkpoint)
            from_deepspeed = load_deepspeed(self.engine, ckpt, load_optimizer)
            self._seen_steps = self.engine.global_steps
            return from_deepspeed
        client_state = reshard.load_engine(
            self.engine,
            lambda: resolve_sources(Path(path), tag),  # asked again if a save moves them
            load_optimizer,
            require_checksums,
            trust_checkpoint,
        )
        self._seen_steps = self.engine.global_steps
        return client_state

    # -- helpers -------------------------------------------------------------------------------

    def _target(self, path: Path, tag: str | None) -> tuple[Path | None, Path]:
        """(root or None, checkpoint directory) for a save."""
        if tag is None and (path / LATEST).is_file() and not (path / META_FILE).exists():
            tag = f"global_step{self.engine.global_steps}"
        if tag is None:
            return None, path
        _check_tag(tag)
        return path, path / tag

    def _side_comm(self) -> Comm:
        if self._side is None:  # collective: every rank reaches the first async save together
            self._side = RankLayout.side(self.engine.checkpoint_comm)  # a gloo twin
        return self._side


class _BackgroundSave:
    """One asynchronous save's writer thread and its outcome."""

    def __init__(self, run: Callable[[], None], final: Path) -> None:
        self.final = final
        self.error: BaseException | None = None

        def target() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - re-raised by join() on the caller
                # said at once too: a script that never waits would otherwise end silently
                warnings.warn(
                    f"asynchronous checkpoint save to {final} failed: {e!r}; the previous "
                    "checkpoint (and latest) are unchanged",
                    CheckpointWarning,
                    stacklevel=1,
                )
                self.error = e.with_traceback(None)  # no frames holding the cloned state

        # Not a daemon: the interpreter waits for the write to finish before it exits.
        self.thread = threading.Thread(target=target, name=f"checkpoint {final.name}")
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(
                f"asynchronous checkpoint save to {self.final} failed: {self.error}"
            ) from self.error


def resolve_load_dir(path: Path, tag: str | None) -> Path:
    """The checkpoint directory to load: ``path/tag``, the one ``path/latest`` names, or
    ``path`` itself; each, when a save replacing it was interrupted, read from the previous
    content it left (``swap.committed``)."""
    if tag is not None:
        _check_tag(tag, saving=False)
        return swap.committed(confined(path, tag))
    latest = path / LATEST
    if (path / META_FILE).exists() or not latest.is_file():
        return swap.committed(path)
    name = latest.read_text().strip()
    if name and ("/" in name or os.sep in name or name in (".", "..")):
        raise ValueError(
            f"{latest} names {name!r}, which is not a checkpoint directory inside {path}; "
            "a 'latest' file holds one tag (such as 'global_step100'), never a path"
        )
    target = swap.committed(confined(path, name)) if name else path
    if not name or not (target / META_FILE).is_file():
        tags = sorted(d.name for d in path.iterdir() if (d / META_FILE).is_file())
        raise FileNotFoundError(
            f"{latest} names {name!r}, which is not a complete checkpoint in {path}; pass "
            f"tag= to load another one (complete checkpoints there: {', '.join(tags) or 'none'})"
        )
    return target


def stage_dirs(root: Path) -> list[Path]:
    """A pipeline checkpoint root's ``stage_<k>`` directories in stage order (``[]``: ``root``
    is not one; a gap in the numbering is not one either)."""
    if (root / META_FILE).exists() or not root.is_dir():
        return []
    stages = sorted(
        (d for d in root.glob("stage_*") if _is_stage(d)), key=lambda d: int(d.name[6:])
    )
    if [int(d.name[6:]) for d in stages] != list(range(len(stages))):
        return []
    return stages


def _is_stage(d: Path) -> bool:
    """Whether ``d`` is a pipeline checkpoint's ``stage_<k>`` directory."""
    return d.name.startswith("stage_") and d.name[6:].isdigit() and d.is_dir()


def resolve_sources(path: Path, tag: str | None) -> list[Path]:
    """The checkpoint directories a load reads: one (see :func:`resolve_load_dir`), or, for a
    pipeline checkpoint's root, each stage's (``stage_<k>/tag``, or the one its ``latest``
    names), which together hold the whole model whatever layout loads them; see the note on
    a pipeline checkpoint's commit point. A checkpoint of several engines (``engines.py``):
    each engine's part of the committed tag, together the model (a GAN's generator and
    discriminator), for one engine's weights, ``consolidate`` and inference."""
    if tag is None and holds_engines(path):  # several engines' parts: together the model
        manifest = read_manifest(path)
        return [path / name / manifest["tag"] for name in manifest["engines"]]
    stages = stage_dirs(path)
    if not stages:
        return [resolve_load_dir(path, tag)]
    return _agreeing_stages(path, stages, tag)


# [Note: a pipeline checkpoint's commit point]
# Each stage commits its own checkpoint (``stage_<k>/<tag>`` and its ``latest``), so a crash
# during a pipeline save can leave one stage at the new step and another at the old one. A
# pipeline save is therefore two-phase: every stage writes and commits its part, the ranks
# agree that all did, and only then does rank 0 name the tag in the root's own ``latest``
# (``PipelineEngine``: at once for a synchronous save, at the first step or wait after an
# asynchronous one has been written). The root's ``latest`` thus always names a checkpoint
# complete in every stage. A load checks that the stages it is about to read agree (the same
# ``global_steps``); when they do not (a torn save), it reads the newest tag complete in
# every stage, warning with the torn tag and the stages at each step, or refuses with both
# when there is none. Pruning (``checkpoint.keep_last``) in a stage never deletes that
# newest common tag nor the one the root names, so the previous complete checkpoint survives
# until every stage has committed the next one.


def _steps(directory: Path) -> int | None:
    try:
        return int(read_meta(directory)["global_steps"])
    except (OSError, ValueError, TypeError, KeyError, CheckpointError):
        return None


def complete_in_every_stage(root: Path) -> list[tuple[int, str]]:
    """``(global_steps, tag)`` of each tag complete in every stage of the pipeline root
    ``root`` at the same step, oldest first."""
    stages = stage_dirs(root)
    if not stages:
        return []
    found: list[tuple[int, str]] = []
    for d in sorted(stages[0].iterdir()):
        if not d.is_dir() or d.name.endswith((".tmp", ".old")):
            continue
        steps = {_steps(s / d.name) for s in stages}  # None: not a complete checkpoint there
        step = steps.pop()
        if not steps and step is not None:
            found.append((step, d.name))
    return sorted(found)


def _agreeing_stages(root: Path, stages: list[Path], tag: str | None) -> list[Path]:
    dirs = [resolve_load_dir(d, tag) for d in stages]
    steps = [_steps(d) for d in dirs]
    if len(set(steps)) == 1 and steps[0] is not None:
        return dirs
    where = ", ".join(
        f"stage {k} at {d.name} (step {s})"
        for k, (d, s) in enumerate(zip(dirs, steps, strict=True))
    )
    common = complete_in_every_stage(root)
    if tag is None and common:
        step, name = common[-1]
        warnings.warn(
            f"{root}: the pipeline checkpoint is torn ({where}): a save was interrupted before "
            f"every stage committed it; loading {name} (step {step}), the newest checkpoint "
            "complete in every stage",
            CheckpointWarning,
            stacklevel=4,
        )
        return [resolve_load_dir(d, name) for d in stages]
    raise CheckpointError(
        f"{root}: the pipeline checkpoint's stages disagree ({where}): a save was "
        "interrupted before every stage committed it, and "
        + (
            f"tag {tag!r} is not at one step in every stage"
            if tag is not None
            else "no checkpoint is complete in every stage (save with tags, e.g. "
            "checkpoint.save_interval, to keep the previous one)"
        )
    )


def _check_tag(tag: str, saving: bool = True) -> None:
    if not tag or "/" in tag or os.sep in tag or tag in (".", "..", LATEST):
        raise ValueError(f"checkpoint tag {tag!r}: use a plain directory name such as 'step100'")
    if saving and tag.endswith((".tmp", ".old", ".lock")):
        raise ValueError(
            f"checkpoint tag {tag!r}: names ending in .tmp, .old or .lock are reserved for "
            "saves in progress and the previous content of a tag saved again"
        )


def write_latest(root: Path, tag: str) -> None:
    """Name ``tag`` in ``root/latest``, atomically (a crash leaves the old name or the new)."""
    tmp = root / (LATEST + ".tmp")
    swap.write_synced(tmp, tag)
    os.replace(tmp, root / LATEST)


_STEP_TAG = re.compile(r"global_step(\d+)")


def _prune(root: Path, keep_last: int | None, keep: str) -> None:
    """Delete the engine's own ``global_step<N>`` checkpoints in ``root`` beyond the newest
    ``keep_last`` (by N); never the one ``latest`` names, nor ``keep`` (just written), and
    never a checkpoint under any other name (a user's ``best``, another run's tags)."""
    if keep_last is None:
        return
    latest = root / LATEST
    protected = {keep, latest.read_text().strip() if latest.is_file() else keep}
    if _is_stage(root):  # a pipeline's stage
        common = complete_in_every_stage(root.parent)
        if common:  # the newest checkpoint every stage holds (see the note above)
            protected.add(common[-1][1])
        committed = root.parent / LATEST
        if committed.is_file():  # the one the pipeline's root names
            protected.add(committed.read_text().strip())
    steps = []
    for d in root.iterdir():
        m = _STEP_TAG.fullmatch(d.name)
        if m and d.is_dir() and (d / META_FILE).is_file():
            steps.append((int(m.group(1)), d))
    steps.sort(reverse=True)
    for _, d in steps[keep_last:]:
        if d.name not in protected:
            swap.remove(d)
