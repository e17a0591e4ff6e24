"""A directory of files saved as one (a front end's save beside the engines' checkpoint:
Accelerate's ``save_state``): written into ``<dir>.tmp``, a manifest written last, put in place
by renames, and checked whole before a load changes anything.

[Note: one commit point for a bundle]
A save writes everything into ``<dir>.tmp``: the engines' checkpoint (``Bundle.engines``) and
every file of the front end's own (an lr scheduler, samplers, RNG states, registered objects,
what save hooks write). Once every rank has finished, rank 0 puts it in place as
``swap.py`` puts an engine's checkpoint:

1. ``<dir>.tmp/<manifest>`` is written and synced last: every file with its size and CRC-32
   (the engines' data shards with their size only: the engines' own ``ds_strategy.json``
   records their CRC-32, verified by their load, shared among the ranks), the front end's
   ``step`` and each engine's ``global_steps``;
2. if ``<dir>`` exists (saved again): ``<dir>`` -> ``<dir>.old``;
3. ``<dir>.tmp`` -> ``<dir>``: the commit point;
4. ``<dir>.old`` is removed; only then are older bundles beyond a limit removed (:func:`prune`;
   Accelerate's ``total_limit`` removes them before it saves, so a crash there left nothing
   to resume from).

A kill at any moment leaves under ``<dir>`` the previous save or this one, whole. Between 2
and 3 ``<dir>`` does not exist: a load then reads ``<dir>.old`` (:meth:`Bundle.committed`),
and the next save puts it back (:meth:`Bundle.recover`): ``swap``'s own, with the manifest as
the mark of a complete directory instead of an engine checkpoint's ``ds_strategy.json``. The
caller holds a lock for the save (``lock.py``), so another job's save into the same place
fails at once instead of colliding, and recovery never removes a ``.tmp`` another job is still
writing.

[Note: a bundle directory that already exists]
A front end may write into an existing directory and leave whatever else is there. Here the
commit replaces the directory whole, so any file the save did not write would be deleted with
it, and mixing new files with stale ones is how a load goes torn. So a bundle is written into a
new or empty directory, or over an earlier bundle holding only the files its manifest lists
(stale ``*.lock`` files aside); any other is refused before anything is written, naming the
files it would lose.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from ..collectives import Comm
from ..faults import together
from ..warnings import CheckpointWarning
from . import swap
from .errors import CheckpointError
from .lock import LOCK_FILE, acquire, release
from .pinned import META_FILE, crc32_of

__all__ = ["Bundle", "BundleManifest", "named", "prune"]


class BundleManifest(TypedDict):
    """A bundle's manifest: its step, each engine's step, and every file's size (and CRC-32,
    unless the engine's own ``ds_strategy.json`` records it)."""

    format: str
    step: int
    engines: dict[str, int]
    files: dict[str, dict[str, int]]


@dataclass(frozen=True)
class Bundle:
    """One kind of bundle: its manifest's file name and format, what messages call a save
    (``"save_state"``), the directory of the engines' checkpoint inside it, and how to take
    the engines' state alone from a bundle this version cannot read."""

    manifest: str
    format: str
    what: str
    engines: str
    engines_alone: str

    # -- saving (rank 0) ---------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(self, comm: Comm, final: Path, root: Path | None, owner: object) -> Iterator[Path]:
        """Collective: the ``.tmp`` every rank writes the bundle ``final`` into, and then
        commits (:meth:`commit`, rank 0, inside the block). Rank 0 holds the lock of ``root``
        (a directory of numbered bundles) or of ``final`` meanwhile, and recovers what an
        interrupted save left first; a failure on any rank removes the ``.tmp``."""
        lock = root / LOCK_FILE if root is not None else final.with_name(final.name + ".lock")
        tmp, locked, ok = swap.tmp_dir(final), False, False
        try:
            with together(comm, CheckpointError):  # rank 0: lock, recover, an empty .tmp
                if comm.rank == 0:
                    acquire(lock, root or final, owner)
                    locked = True  # from here the .tmp is this save's, to remove on failure
                    if root is not None:
                        self._recover_root(root)
                    self.begin(final, recovered=root is not None)
            yield tmp
            ok = True
        finally:
            if locked:
                if not ok:
                    shutil.rmtree(tmp, ignore_errors=True)
                release(owner, lock)

    def _recover_root(self, root: Path) -> None:
        """:meth:`recover` for every numbered bundle (``<name>_<i>``) in ``root``; a folder of
        another name is the user's, whatever its suffix."""
        if not root.is_dir():
            return
        for d in sorted(root.iterdir()):
            if d.is_dir() and re.fullmatch(r"\w+_\d+\.old", d.name):
                self.recover(d.with_name(d.name[: -len(".old")]))
        for d in sorted(root.iterdir()):
            if d.is_dir() and re.fullmatch(r"\w+_\d+(\.old)?\.tmp", d.name):
                warnings.warn(
                    f"{d}: removing the leftover of an interrupted {self.what}",
                    CheckpointWarning,
                    stacklevel=5,
                )
                shutil.rmtree(d, ignore_errors=True)

    def begin(self, final: Path, recovered: bool = False) -> Path:
        """Rank 0, holding the lock: recover what an interrupted save left (unless the caller
        ``recovered`` already, over a whole root), refuse a directory whose files the commit
        would delete (see the notes), and return an empty ``<final>.tmp``."""
        if not recovered:
            self.recover(final)
        self._check_target(final)
        tmp = swap.tmp_dir(final)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, final: Path, step: int, engine_steps: Mapping[str, int]) -> None:
        """Rank 0, once every rank has written into ``tmp``: steps 1-4 of the note (pruning
        aside)."""
        manifest: BundleManifest = {
            "format": self.format,
            "step": step,
            "engines": dict(engine_steps),
            "files": self._describe(tmp),
        }
        swap.write_synced(tmp / self.manifest, json.dumps(manifest, indent=1))
        old = swap.old_dir(final)
        if final.exists():
            swap.remove(old)
            final.rename(old)
        tmp.rename(final)  # the commit point
        swap.remove(old)

    def recover(self, final: Path) -> None:
        """``swap.recover`` with the manifest as the mark of a complete directory: roll back an
        interrupted replacement of ``final``, remove what an interrupted save left."""
        swap.recover(final, self.manifest, self.what)

    def _check_target(self, final: Path) -> None:
        """Refuse an existing ``final`` holding files the commit would delete (see the note)."""
        if not final.exists():
            return
        if not final.is_dir():
            raise CheckpointError(
                f"{final}: a file, where {self.what} would write a directory: pass another "
                "directory"
            )
        found = {p.relative_to(final).as_posix() for p in final.rglob("*") if _counts(p)}
        try:
            listed = set(json.loads((final / self.manifest).read_text())["files"])
            listed.add(self.manifest)
            what = f"is an earlier {self.what}'s, but also holds"
        except (OSError, ValueError, KeyError, TypeError):
            listed = set()
            what = f"is not an earlier {self.what}'s (no {self.manifest}) and holds"
        foreign = sorted(found - listed)
        if foreign:
            shown = ", ".join(foreign[:3]) + (
                f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            )
            raise CheckpointError(
                f"{final}: already exists and {what} files {self.what} did not write "
                f"({shown}). {self.what} replaces its directory whole at its commit point, "
                "which would delete them: pass a new or empty directory, or move those files "
                "away"
            )

    def _describe(self, tmp: Path) -> dict[str, dict[str, int]]:
        """Every file under ``tmp``: its size, and its CRC-32 unless an engine's
        ``ds_strategy.json`` records that; each is synced, so the manifest written after them
        never names lost data."""
        summed = self._summed_by_engines(tmp)
        out = {}
        for p in sorted(tmp.rglob("*")):
            if _counts(p):
                rel = p.relative_to(tmp).as_posix()
                out[rel] = {"size": p.stat().st_size} if rel in summed else _sum(p, sync=True)
        return out

    def _summed_by_engines(self, tmp: Path) -> set[str]:
        out: set[str] = set()
        for meta in (tmp / self.engines).rglob(META_FILE):
            files = json.loads(meta.read_text()).get("files") or {}
            base = meta.parent.relative_to(tmp)
            out.update((base / name).as_posix() for name, rec in files.items() if "crc32" in rec)
        return out

    # -- loading (every rank, before anything changes) ---------------------------------------

    def committed(self, final: Path) -> Path:
        """``final``, or ``<final>.old`` when a save replacing ``final`` was interrupted
        between steps 2 and 3 (``swap.committed``, with the manifest as the mark)."""
        return swap.committed(final, self.manifest, self.what)

    def check(self, path: Path) -> BundleManifest:
        """The manifest of the bundle ``path``, once every file it lists is there with its
        size and CRC-32 and every engine checkpoint records the step the manifest does.
        Raises :class:`CheckpointError` naming the file and what is wrong."""
        manifest = self._read(path)
        for rel, want in manifest["files"].items():
            self._check_file(path, rel, want)
        self._check_engine_steps(path, manifest["engines"])
        return manifest

    def _read(self, path: Path) -> BundleManifest:
        where = path / self.manifest
        try:
            manifest = json.loads(where.read_bytes().decode())
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: no {self.manifest}, so not a complete {self.what} of this version: a "
                "save writes it last, after every other file (an interrupted save leaves only "
                f"'{path.name}.tmp'), and versions before it wrote none. Load another "
                f"checkpoint; to take only the model and optimizer from this one, load "
                f"{path / self.engines} with {self.engines_alone}"
            ) from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{where}: unreadable or cut short ({e})") from e
        ok = (
            isinstance(manifest, dict)
            and manifest.get("format") == self.format
            and isinstance(manifest.get("step"), int)
            and isinstance(manifest.get("engines"), dict)
            and isinstance(manifest.get("files"), dict)
            and all(
                isinstance(w, dict) and isinstance(w.get("size"), int)
                for w in manifest["files"].values()
            )
        )
        if not ok:
            fmt = manifest.get("format") if isinstance(manifest, dict) else None
            raise CheckpointError(
                f"{where}: not a {self.what} manifest this ds_strategy reads (format {fmt!r}, "
                f"expected {self.format!r})"
            )
        checked: BundleManifest = manifest  # (every key of the record checked above)
        return checked

    def _check_file(self, path: Path, rel: str, want: dict[str, int]) -> None:
        listing = path / self.manifest
        if os.path.isabs(rel) or ".." in Path(rel).parts:
            raise CheckpointError(f"{listing}: lists {rel!r}, outside {path}; refusing it")
        f = path / rel
        if not f.is_file():
            raise CheckpointError(
                f"{f}: missing; {self.manifest} lists it ({want['size']} bytes): the directory "
                "lost it after its save committed it. Restore the file, or load another "
                "checkpoint"
            )
        size = f.stat().st_size
        if size != want["size"]:
            what = "empty" if size == 0 else "truncated" if size < want["size"] else "overwritten"
            raise CheckpointError(
                f"{f}: {what}: {size} bytes, {want['size']} were written (see "
                f"{self.manifest}); load another checkpoint"
            )
        if "crc32" in want and _sum(f)["crc32"] != want["crc32"]:
            raise CheckpointError(
                f"{f}: corrupt: its CRC-32 differs from the one recorded when it was written "
                f"(see {self.manifest}); load another checkpoint"
            )

    def _check_engine_steps(self, path: Path, steps: Mapping[str, int]) -> None:
        """Each engine checkpoint's ``global_steps`` is the one the manifest recorded for it
        (its part under ``<engines>/<name>/`` with several engines), so the front end's files
        and the engines' are one save."""
        names = list(steps)
        for meta in sorted((path / self.engines).rglob(META_FILE)):
            rel = meta.relative_to(path / self.engines)
            name = names[0] if len(names) == 1 else rel.parts[0]
            got = json.loads(meta.read_text()).get("global_steps")
            if name in steps and got != steps[name]:
                raise CheckpointError(
                    f"{meta}: the engine checkpoint is at step {got}, but "
                    f"{path / self.manifest} recorded {name} at step {steps[name]} with the "
                    f"{self.what}'s other files: parts of two saves. Load another checkpoint"
                )


def prune(committed_dirs: list[Path], keep: Path, limit: int) -> None:
    """Rank 0, after the commit: remove the oldest of ``committed_dirs`` (oldest first,
    ``keep`` among them) beyond ``limit``, never ``keep``; each is renamed to ``.tmp`` before
    it is removed, so a crash never leaves a half-deleted bundle under its name."""
    doomed = [d for d in committed_dirs if d != keep][: max(0, len(committed_dirs) - limit)]
    for d in doomed:
        swap.remove(d)


def named(directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a path with a name of its own: its ``.tmp`` and ``.old`` go beside it,
    named after it ("." and ".." have none)."""
    path = Path(os.fspath(directory)).expanduser()
    return path if path.name not in ("", "..") else Path(os.path.abspath(path))


def _counts(p: Path) -> bool:
    """Whether ``p`` is part of a save: a file, but a lock (an engine's root lock lives as
    long as the engine, and a killed job leaves its file, never its lock)."""
    return p.is_file() and not p.name.endswith(".lock")


def _sum(p: Path, sync: bool = False) -> dict[str, int]:
    with open(p, "rb") as f:
        value, size = crc32_of(f.fileno()), os.fstat(f.fileno()).st_size
        if sync:
            os.fsync(f.fileno())
    return {"size": size, "crc32": value}
