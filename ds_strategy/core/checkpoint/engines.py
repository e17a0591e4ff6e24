"""Several engines saved as one checkpoint (a GAN's generator and discriminator, an actor, a
critic and their frozen reference), with one commit point::

    ckpt/engines.json              {"tag": "save3", "engines": ["optimizer_0", "optimizer_1"]}
    ckpt/optimizer_0/save3/        the first engine's checkpoint (``sharded.py``'s layout)
    ckpt/optimizer_1/save3/

[Note: one commit point for several engines]
Each engine commits its own checkpoint atomically, but a crash between two engines' commits
would leave one model at the new step and the other at the old one. So every save writes each
engine's part under a fresh tag (``save<N>``, one past the committed tag's N): no save ever
writes over a part of the committed checkpoint. Only when every engine has committed its part
does rank 0 replace ``engines.json`` (written to ``engines.json.tmp``, synced, then
``os.replace``), and only then remove the parts of older tags. A crash at any moment therefore
leaves ``engines.json`` naming a tag complete in every engine, the previous save or this one.
A load reads ``engines.json``, checks that it names exactly the engines it is given and that
each holds the tag complete, and refuses otherwise, naming what is missing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

from ..faults import together
from . import swap
from .seam import CheckpointedEngine
from .validate import META_FILE, CheckpointError

__all__ = ["MANIFEST", "holds_engines", "load_engines", "read_manifest", "save_engines"]

MANIFEST = "engines.json"
_FORMAT = "ds_strategy-engines-1"


class Manifest(TypedDict):
    """``engines.json``: the committed tag, and the engines that hold it."""

    format: str
    tag: str
    engines: list[str]


def holds_engines(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of several engines (it holds ``engines.json``)."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: Path) -> Manifest:
    """``engines.json`` of ``path``: its tag and engine names, checked."""
    where = Path(path) / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError:
        single = (Path(path) / META_FILE).is_file()
        raise CheckpointError(
            f"{path}: "
            + (
                "this checkpoint holds one model and its optimizer, while this job has several "
                "(one engine per optimizer); resume it with the same models and optimizers it "
                "was saved with"
                if single
                else f"no {MANIFEST}: not a checkpoint of several models (or its first save "
                "was interrupted before anything was committed)"
            )
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{where}: unreadable ({err})") from err
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == _FORMAT
        and isinstance(manifest.get("tag"), str)
        and isinstance(manifest.get("engines"), list)
        and all(isinstance(n, str) for n in manifest["engines"])
    )
    if not ok:
        raise CheckpointError(f"{where}: not a ds_strategy engines manifest")
    tag, names = manifest["tag"], manifest["engines"]
    for name in (tag, *names):
        if not name or "/" in name or name in (".", "..") or "\\" in name:
            raise CheckpointError(f"{where}: {name!r} is not a plain directory name")
    checked: Manifest = manifest  # (every key of the record checked above)
    return checked


def _next_tag(path: Path) -> str:
    try:
        tag = read_manifest(path)["tag"]
    except CheckpointError:
        return "save1"
    n = tag[4:] if tag.startswith("save") else ""
    return f"save{int(n) + 1}" if n.isdigit() else "save1"


def save_engines(
    engines: Mapping[str, CheckpointedEngine],
    path: str | Path,
    client_state: object = None,
    *,
    include_optimizer: bool = True,
) -> Path:
    """Save ``engines`` (name -> engine, all over the same ranks) as one checkpoint directory
    ``path``; ``client_state`` travels with the first engine's part. Collective. See
    [Note: one commit point for several engines]."""
    if not engines:
        raise ValueError("save_engines needs at least one engine")
    path = Path(path)
    comm = next(iter(engines.values())).checkpoint_comm  # every rank holding a part
    with together(comm, CheckpointError):
        if comm.rank == 0:
            if (path / META_FILE).is_file():
                raise CheckpointError(
                    f"{path} holds the checkpoint of one model: save several models to another "
                    "path (or remove it first)"
                )
            path.mkdir(parents=True, exist_ok=True)
        tag = _next_tag(path) if comm.rank == 0 else ""
    tag = str(comm.all_gather_object(tag)[0])  # rank 0's, on every rank
    for i, (name, engine) in enumerate(engines.items()):
        engine.save_checkpoint(
            path / name,
            tag=tag,
            client_state=client_state if i == 0 else None,
            save_latest=False,
            include_optimizer=include_optimizer,
            async_save=False,  # committed before the manifest names it
        )
    with together(comm, CheckpointError):
        if comm.rank == 0:
            manifest: Manifest = {"format": _FORMAT, "tag": tag, "engines": list(engines)}
            tmp = path / (MANIFEST + ".tmp")
            swap.write_synced(tmp, json.dumps(manifest, indent=1))
            tmp.replace(path / MANIFEST)  # the commit point
            for name in engines:
                for old in (path / name).iterdir():
                    if old.is_dir() and old.name != tag:
                        shutil.rmtree(old, ignore_errors=True)
    return path


def load_engines(
    engines: Mapping[str, CheckpointedEngine],
    path: str | Path,
    *,
    load_optimizer: bool = True,
    trust_checkpoint: bool = False,
) -> object:
    """Restore ``engines`` from :func:`save_engines`'s directory, at any world size or stage
    (each engine's part reshards as one engine's checkpoint does); returns the client state.
    Engines built for evaluation load their weights only. Collective."""
    path = Path(path)
    with together(next(iter(engines.values())).checkpoint_comm, CheckpointError):
        manifest = read_manifest(path)
        tag, saved = manifest["tag"], manifest["engines"]
        if sorted(saved) != sorted(engines):
            raise CheckpointError(
                f"{path} holds the models {saved}, this job has {list(engines)}: resume with the "
                "models and optimizers the checkpoint was saved with (the same "
                "configure_optimizers, and the same submodules frozen)"
            )
        missing = [n for n in saved if not (path / n / tag / META_FILE).is_file()]
        if missing:
            raise CheckpointError(
                f"{path}: {MANIFEST} names {tag!r}, which is incomplete in {missing}; the "
                "directory was changed after the save committed it"
            )
    client_state: object = None
    for i, (name, engine) in enumerate(engines.items()):
        state = engine.load_checkpoint(
            path / name,
            tag=tag,
            load_optimizer=load_optimizer and engine.trainable,
            trust_checkpoint=trust_checkpoint,
        )
        if i == 0:
            client_state = state
    return client_state
