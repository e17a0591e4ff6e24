"""Checks a checkpoint before any rank starts loading it, so a damaged or foreign checkpoint
is a clear error on every rank instead of a hang or silent garbage.

[Note: what is checked, and by whom]
Every rank checks the cheap things: ``ds_strategy.json`` parses and has our format, DCP's
``.metadata`` unpickles, every data file it references exists and is at least as long as
the byte ranges referenced in it, and the saved parameter names and shapes are this model's.
At save time each rank records the size and CRC-32 of the files it wrote (``record_checksums``)
and rank 0 puts them all in ``ds_strategy.json``; at load time the data files are split
round-robin among the ranks, each verifying its share, so a bit flip that keeps a file's
size is caught without every rank reading the whole checkpoint.

[Note: why the ranks agree]
Files are checked on every rank, but a rank may see a different problem (or none, when the
damaged file is another rank's share of the checksums). A rank that raised alone would leave
the others waiting in DCP's first collective until the process-group timeout. So the checks
end in an agreement point (``faults.together``): every rank raises, naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata

from ..collectives import Comm
from ..faults import together
from ..names import saved_name
from .errors import CheckpointError, not_a_checkpoint
from .pinned import DCP_META, FORMAT, META_FILE, PinnedCheckpoint, crc32_of, parse_meta
from .records import CheckpointMeta
from .trust import SafeReader, UntrustedContentError

__all__ = [
    "DCP_META",
    "FORMAT",
    "META_FILE",
    "CheckpointError",
    "check_files",
    "check_optimizer_class",
    "check_shapes_within",
    "has_optimizer_state",
    "merge_checksums",
    "optimizer_class",
    "parse_meta",
    "record_checksums",
    "validate",
]

_SUMS = ".checksums-{}.json"


def crc32(path: Path) -> int:
    with open(path, "rb") as f:
        return crc32_of(f.fileno())


def record_checksums(tmp: Path, rank: int) -> None:
    """Size and CRC-32 of the files this rank wrote into ``tmp`` (rank 0 also DCP's metadata)."""
    own = sorted(tmp.glob(f"__{rank}_*"))
    if rank == 0:
        own.append(tmp / DCP_META)
    sums = {p.name: {"size": p.stat().st_size, "crc32": crc32(p)} for p in own}
    (tmp / _SUMS.format(rank)).write_text(json.dumps(sums))


def merge_checksums(tmp: Path) -> dict[str, dict[str, int]]:
    """Rank 0, once every rank has recorded: all ranks' records, removed from ``tmp``."""
    out: dict[str, dict[str, int]] = {}
    for part in sorted(tmp.glob(_SUMS.format("*"))):
        out.update(json.loads(part.read_text()))
        part.unlink()
    return dict(sorted(out.items()))


def validate(
    pinned: PinnedCheckpoint,
    comm: Comm,
    shapes: dict[str, list[int]] | None,
    require_checksums: bool = True,
) -> dict[str, STORAGE_TYPES]:
    """Check the pinned checkpoint on every rank (see the notes above); return DCP's
    ``state_dict_metadata``. ``shapes``: this model's parameter shapes, or None to skip that
    check. ``require_checksums=False`` accepts a checkpoint that records no checksums.
    Raises the same error on every rank."""
    with together(comm, CheckpointError):  # every failure must reach the other ranks
        md = _check(pinned, comm.rank, comm.world_size, shapes, require_checksums)
    return md.state_dict_metadata


def check_files(pinned: PinnedCheckpoint, require_checksums: bool = True) -> None:
    """The same checks in this process alone (every file's checksum, no model): for tools
    such as consolidation that run outside the training job."""
    _check(pinned, 0, 1, None, require_checksums)


def _check(
    pinned: PinnedCheckpoint,
    rank: int,
    world: int,
    shapes: dict[str, list[int]] | None,
    require_checksums: bool,
) -> Metadata:
    path, meta = pinned.path, pinned.meta
    sums: dict[str, dict[str, int]] = meta.get("files") or {}
    if not sums and require_checksums:
        raise CheckpointError(
            f"{path / META_FILE}: records no checksums ('files'), so damaged or altered data "
            "would load silently; every checkpoint this library saves has them. If you trust "
            "this one anyway, load it with require_checksums=False (ds-strategy consolidate: "
            "--no-require-checksums)"
        )
    dcp_meta = path / DCP_META
    if not pinned.has(DCP_META):
        raise CheckpointError(f"{dcp_meta}: missing; the checkpoint cannot be read without it")
    if DCP_META in sums:
        _check_file(pinned, DCP_META, sums[DCP_META], verify_crc=True)
    try:
        md = SafeReader(path, pinned=pinned).read_metadata()
    except UntrustedContentError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(
            f"{dcp_meta}: cannot be read ({type(e).__name__}: {e}); the file is truncated "
            "or corrupt"
        ) from e
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for i, (rel, end) in enumerate(sorted(needed.items())):
        f = path / rel
        if os.path.isabs(rel) or ".." in Path(rel).parts:
            raise CheckpointError(
                f"{dcp_meta}: references {rel!r}, which lies outside the checkpoint directory "
                f"{path}; refusing to read it"
            )
        if sums and rel not in sums:
            raise CheckpointError(f"{f}: not listed in {path / META_FILE}'s checksums")
        if not pinned.has(rel):
            raise CheckpointError(f"{f}: missing (the checkpoint's {DCP_META} references it)")
        size = pinned.size(rel)
        if size < end:
            raise CheckpointError(
                f"{f}: truncated: {size} bytes, the checkpoint references bytes up to {end}"
            )
        if sums:
            _check_file(pinned, rel, sums[rel], verify_crc=i % world == rank)
    if shapes is not None:
        _check_shapes(path / META_FILE, saved_shapes(meta), shapes)
    return md


def has_optimizer_state(path: Path) -> bool:
    """False for a weights-only checkpoint directory (``include_optimizer=False``)."""
    try:
        return bool(json.loads((path / META_FILE).read_text()).get("optimizer", True))
    except (OSError, ValueError):
        return True  # unreadable metadata: let the engine's load name the problem


def read_meta(path: Path) -> CheckpointMeta:
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: no checkpoint directory here (pass the directory given to "
            "save_checkpoint, or its root directory holding a 'latest' file)"
        )
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise not_a_checkpoint(path, META_FILE)
    return parse_meta(meta_path.read_bytes(), meta_path)


def _check_file(
    pinned: PinnedCheckpoint, name: str, want: dict[str, int], verify_crc: bool
) -> None:
    f, size = pinned.path / name, pinned.size(name)
    if size != want["size"]:
        raise CheckpointError(
            f"{f}: truncated or overwritten: {size} bytes, {want['size']} were written"
        )
    if verify_crc:
        got = pinned.crc32(name)
        if got != want["crc32"]:
            raise CheckpointError(
                f"{f}: corrupt: CRC-32 {got:08x}, but {want['crc32']:08x} was recorded when "
                "it was written"
            )


# optimizers whose state and hyper-parameters carry over to one another: Adam with or
# without decoupled weight decay, in any implementation (torch's, ours, DeepSpeed's names)
_ADAM = {"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "CPUAdam"}


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The name a checkpoint records for ``optimizer``'s class."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_optimizer_class(saved: str | None, live: torch.optim.Optimizer, path: Path) -> None:
    """Refuse to load optimizer state saved by another optimizer (an AdamW checkpoint into
    SGD would hand SGD AdamW's learning rate and weight decay, and leave its momentum empty);
    ``saved`` None: an older checkpoint that does not record it."""
    mine = optimizer_class(live)
    if saved is None or _family(saved) == _family(mine):
        return
    raise CheckpointError(
        f"{path}: saved with optimizer {saved}, but this engine's is {mine}: its state and "
        "hyper-parameters do not carry over. Build the same optimizer to resume, or load "
        f"with load_optimizer=False to take the weights alone (fresh {type(live).__name__} "
        "state)"
    )


def _family(name: str) -> str:
    short = name.rpartition(".")[2]
    return "Adam" if short in _ADAM else name


def saved_shapes(meta: CheckpointMeta) -> dict[str, list[int]]:
    """The parameter shapes a checkpoint records, by name (without the ``_orig_mod.`` an
    older save of a compiled model wrote: ``core/names.py``)."""
    return {saved_name(k): v for k, v in (meta.get("shapes") or {}).items()}


def check_shapes_within(
    pins: list[PinnedCheckpoint], live: dict[str, list[int]], aliases: dict[str, str]
) -> None:
    """Every parameter of ``live`` (this rank's part of a model, or a whole model) is in one of
    the pinned checkpoints (a pipeline's stages: together the whole model), under its name or
    its alias, with its shape; parameters of other parts may be there too."""
    saved: dict[str, list[int]] = {}
    for pinned in pins:
        for name, shape in saved_shapes(pinned.meta).items():
            saved.setdefault(name, shape)
    paths = [pinned.path for pinned in pins]
    if not saved:
        return
    problems = _shape_problems(saved, live, aliases)
    if problems:
        where, hint = str(paths[0]), "Build the model that was saved (same architecture and sizes)."
        stages = [p for p in paths if "stage_" in (p.name[:6], p.parent.name[:6])]
        if stages:
            first = stages[0] if stages[0].name.startswith("stage_") else stages[0].parent
            where = f"{first.parent} (a pipeline checkpoint, {len(stages)} stage(s) found)"
            hint += " If a stage_<k> directory is missing, restore it: its layers are only there."
        raise CheckpointError(
            f"{where}: checkpoint does not match this model: {'; '.join(problems[:4])}. {hint}"
        )


def _shape_problems(
    saved: dict[str, list[int]], live: dict[str, list[int]], aliases: dict[str, str]
) -> list[str]:
    """Parameters of ``live`` saved with another shape, then those not saved at all (under
    their name, or else their alias)."""
    missing, problems = [], []
    for name, shape in sorted(live.items()):
        got = saved.get(name, saved.get(aliases.get(name, name)))
        if got is None:
            missing.append(name)
        elif list(got) != list(shape):
            problems.append(f"'{name}' has shape {got} in the checkpoint, {shape} in this model")
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) of this model are not in it, e.g. {missing[:3]}"
        )
    return problems


def _check_shapes(meta_path: Path, saved: dict[str, list[int]], live: dict[str, list[int]]) -> None:
    if not saved:
        return
    problems = _shape_problems(saved, live, {})
    extra = sorted(saved.keys() - live.keys())
    if extra:
        problems.append(f"{len(extra)} saved parameter(s) are not in this model, e.g. {extra[:3]}")
    if problems:
        raise CheckpointError(
            f"{meta_path}: checkpoint does not match this model: {'; '.join(problems[:4])}. "
            "Build the model that was saved (same architecture and sizes)."
        )
