"""Putting a written checkpoint in place so that a crash at any instant loses nothing committed.

[Note: the rename sequence]
A save writes ``<dir>.tmp``; once every rank has finished, rank 0 puts it in place:

1. ``<dir>.tmp/ds_strategy.json`` is written and synced: the new checkpoint is complete;
2. if ``<dir>`` exists (a tag saved again): ``<dir>`` -> ``<dir>.old``;
3. ``<dir>.tmp`` -> ``<dir>``: the commit point;
4. ``<dir>.old`` is removed; then (in a root) ``latest`` is replaced and old tags are pruned,
   each by renaming it to ``<tag>.tmp`` before removing it.

Two renames cannot be one atomic step, so between 2 and 3 ``<dir>`` does not exist. Readers
(``committed``) then take ``<dir>.old``, the last committed content, which is complete by
construction; so ``latest`` naming ``<dir>`` always leads to a complete checkpoint. The next save
(``recover``, rank 0, holding the root's lock) rolls such an interrupted replacement back:
``<dir>.old`` -> ``<dir>`` when ``<dir>`` is missing, otherwise ``<dir>.old`` is removed; any
``.tmp`` is an uncommitted or half-deleted directory and is removed. Every step is a rename or
a removal of something already unreferenced, so a crash during recovery is recovered the same
way. ``tests/test_checkpoint_faults.py`` kills a save at every one of these steps.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from ..warnings import CheckpointWarning
from .validate import META_FILE

__all__ = ["committed", "old_dir", "put_in_place", "recover", "recover_root", "remove", "tmp_dir"]


def tmp_dir(final: Path) -> Path:
    """Where a save to ``final`` writes until every rank has finished."""
    return final.with_name(final.name + ".tmp")


def old_dir(final: Path) -> Path:
    """Where ``final``'s previous content waits while a new one is put in place."""
    return final.with_name(final.name + ".old")


def complete(d: Path, mark: str = META_FILE) -> bool:
    """Whether ``d`` holds ``mark``, the file a save writes last (a checkpoint's
    ``ds_strategy.json``; Accelerate's ``save_state`` has its own manifest)."""
    return (d / mark).is_file()


def committed(final: Path, mark: str = META_FILE, what: str = "checkpoint") -> Path:
    """The directory holding ``final``'s committed content: ``final``, or ``<final>.old``
    when a save replacing ``final`` (a ``what``, complete once it holds ``mark``) was
    interrupted between steps 2 and 3."""
    old = old_dir(final)
    if not final.exists() and complete(old, mark):
        warnings.warn(
            f"{final}: a save replacing this {what} was interrupted; reading the previous "
            f"one from {old.name} (the next save into this directory puts it back)",
            CheckpointWarning,
            stacklevel=3,
        )
        return old
    return final


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def put_in_place(tmp: Path, final: Path, meta_text: str) -> None:
    """Steps 1-4 of the note above (rank 0, every rank having written into ``tmp``)."""
    write_synced(tmp / META_FILE, meta_text)
    old = old_dir(final)
    if final.exists():
        remove(old)
        final.rename(old)
    tmp.rename(final)
    remove(old)


def remove(d: Path) -> None:
    """Delete ``d`` (if present) so that an interrupted removal leaves only a ``.tmp``
    directory, which the next save removes, never a half-deleted checkpoint under its name."""
    if not d.exists():
        return
    if d.name.endswith(".tmp"):
        shutil.rmtree(d, ignore_errors=True)
        return
    doomed = d.with_name(d.name + ".tmp")
    shutil.rmtree(doomed, ignore_errors=True)
    d.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def recover(final: Path, mark: str = META_FILE, what: str = "checkpoint") -> None:
    """Rank 0, before a save to ``final``: roll back an interrupted replacement of ``final``
    and remove what an interrupted save left (see the note above; ``mark`` and ``what`` as
    in :func:`committed`)."""
    old, tmp = old_dir(final), tmp_dir(final)
    if old.exists():
        if not final.exists() and complete(old, mark):
            _say(
                f"{final}: restoring the previous {what} from {old.name} (a save "
                "replacing it was interrupted)"
            )
            old.rename(final)
        else:
            _say(f"{old}: removing the previous content of a {what} that was replaced")
            remove(old)
    for leftover in (tmp, tmp_dir(old)):
        if leftover.exists():
            _say(f"{leftover}: removing the leftover of an interrupted {what} save")
            shutil.rmtree(leftover, ignore_errors=True)


def recover_root(root: Path) -> None:
    """``recover`` for every checkpoint in ``root``."""
    if not root.is_dir():
        return
    for d in sorted(root.iterdir()):
        if d.is_dir() and d.name.endswith(".old"):
            recover(d.with_name(d.name[: -len(".old")]))
    for d in sorted(root.iterdir()):
        if d.is_dir() and d.name.endswith(".tmp"):
            _say(f"{d}: removing the leftover of an interrupted checkpoint save")
            shutil.rmtree(d, ignore_errors=True)


def _say(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=4)
