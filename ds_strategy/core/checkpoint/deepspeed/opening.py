"""Opening a DeepSpeed checkpoint's tag directory: each tensor-parallel part's files (its
data-parallel ranks' optimizer and model states) read into a :class:`DeepSpeedCheckpoint` with
each parameter's segments (see [Note: DeepSpeed's layout] in ``layout.py``), and several parts
joined (``tensor_parallel.py``)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from ..validate import CheckpointError
from .layout import _MODEL, _MODEL3, _OPTIM, DeepSpeedCheckpoint, Segment
from .pickles import load_pickle
from .tensor_parallel import join_parts

__all__ = ["model_state", "open_deepspeed"]


def open_deepspeed(tag_dir: Path, trust_checkpoint: bool = False) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed checkpoint's tag directory (no tensor data yet: memory-mapped); a
    tensor-parallel one (``mp_rank_01`` and up) as its parts joined (``tensor_parallel.py``)."""
    files = {p.name: p for p in tag_dir.iterdir()}
    mp = sorted({int(m.group(2)) for n in files if (m := _OPTIM.match(n))})
    if not mp:
        raise CheckpointError(f"{tag_dir}: no *_optim_states.pt files: not a ZeRO checkpoint")
    parts = [_open_part(tag_dir, files, k, trust_checkpoint) for k in range(max(mp) + 1)]
    return parts[0] if len(parts) == 1 else join_parts(parts)


def model_state(tag_dir: Path, trust_checkpoint: bool = False) -> dict[str, Any]:
    """The first rank's model-states file alone (counters, lr scheduler, client state), for
    what needs no partition: no optimizer file is read."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (tag_dir / name).is_file():
            return load_pickle(tag_dir / name, trust_checkpoint)
    raise CheckpointError(f"{tag_dir}: no mp_rank_00 model-states file")


def _open_part(
    tag_dir: Path, files: dict[str, Path], mp: int, trust_checkpoint: bool
) -> DeepSpeedCheckpoint:
    """Tensor-parallel rank ``mp``'s part: its data-parallel ranks' files."""
    mine = {n: f for n, f in files.items() if _mp_rank(n) in (mp, None)}
    optim = _rank_files(tag_dir, mine, _OPTIM, f"mp_rank_{mp:02d} optim_states")
    opt_states = [load_pickle(p, trust_checkpoint)["optimizer_state_dict"] for p in optim]
    stage = int(opt_states[0]["zero_stage"])
    if stage == 3:
        models = _rank_files(tag_dir, mine, _MODEL3, f"mp_rank_{mp:02d} model_states")
        model_files = [load_pickle(p, trust_checkpoint) for p in models]
    elif f"mp_rank_{mp:02d}_model_states.pt" in files:
        model_files = [load_pickle(files[f"mp_rank_{mp:02d}_model_states.pt"], trust_checkpoint)]
    else:
        raise CheckpointError(f"{tag_dir}: mp_rank_{mp:02d}_model_states.pt is missing")
    count = opt_states[0]["partition_count"]
    world = max(count) if isinstance(count, list) else int(count)
    if world != len(optim) or (stage == 3 and world != len(model_files)):
        raise CheckpointError(
            f"{tag_dir}: written by {world} ranks but {len(optim)} optimizer-state files are "
            "there: the checkpoint is incomplete (a rank's save did not finish)"
        )
    ckpt = DeepSpeedCheckpoint(tag_dir, stage, world, model_files[0], opt_states, model_files)
    ckpt.segments = _segments3(ckpt) if stage == 3 else _segments12(ckpt)
    return ckpt


def _mp_rank(name: str) -> int | None:
    """The tensor-parallel rank a file of the tag directory belongs to (None: not a rank's)."""
    for pattern, group in ((_OPTIM, 2), (_MODEL3, 2), (_MODEL, 1)):
        m = pattern.match(name)
        if m:
            return int(m.group(group))
    return None


def _rank_files(
    tag_dir: Path, files: dict[str, Path], pattern: re.Pattern, what: str
) -> list[Path]:
    by_rank = {int(m.group(1)): p for n, p in files.items() if (m := pattern.match(n))}
    if not by_rank:
        raise CheckpointError(f"{tag_dir}: no {what} files: not a ZeRO checkpoint")
    missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank))
    if missing:
        raise CheckpointError(
            f"{tag_dir}: the {what} files of rank(s) {missing} are missing: the checkpoint is "
            "incomplete"
        )
    return [by_rank[r] for r in range(len(by_rank))]


def _segments12(ckpt: DeepSpeedCheckpoint) -> dict[str, tuple[Segment, ...]]:
    """Stages 0-2: each group is flattened whole, then cut into equal partitions, one per rank."""
    paddings = ckpt.optim[0].get("param_alignment_paddings")
    out: dict[str, tuple[Segment, ...]] = {}
    base = 0  # where group g starts in a rank's groups laid end to end
    sizes = [t.numel() for t in ckpt.flat(0)]
    for g, names in enumerate(ckpt.groups):
        part, offset = sizes[g], 0
        for i, name in enumerate(names):
            n = ckpt.shapes[name].numel()
            segs = []
            at = offset
            while at < offset + n:
                rank, local = divmod(at, part)
                length = min(part - local, offset + n - at)
                segs.append(Segment(rank, base + local, at - offset, length))
                at += length
            out[name] = tuple(segs)
            offset += n + (paddings[g][i] if paddings else 0)
        if offset > part * ckpt.world_size:
            raise CheckpointError(
                f"{ckpt.directory}: group {g} holds fewer elements than its shapes"
            )
        base += part
    return out


def _segments3(ckpt: DeepSpeedCheckpoint) -> dict[str, tuple[Segment, ...]]:
    """Stage 3: each parameter is cut into equal partitions, one per rank, one after another."""
    world, out, offset = ckpt.world_size, {}, 0
    for name, shape in ckpt.shapes.items():
        n = shape.numel()
        part = math.ceil(n / world)
        out[name] = tuple(
            Segment(r, offset, r * part, min(part, n - r * part))
            for r in range(world)
            if r * part < n
        )
        offset += part
    held = sum(t.numel() for t in ckpt.flat(0))
    if offset != held:
        raise CheckpointError(
            f"{ckpt.directory}: the parameters' partitions take {offset} elements per rank but "
            f"{held} are saved; the shapes and the saved groups disagree"
        )
    return out
