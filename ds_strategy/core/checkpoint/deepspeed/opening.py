"""Opening a DeepSpeed checkpoint's tag directory: each tensor-parallel part's files (its
data-parallel ranks' optimizer and model states) read into a :class:`DeepSpeedCheckpoint` with
each parameter's segments (see [Note: DeepSpeed's layout] in ``layout.py``), and several parts
joined (``tensor_parallel.py``).

[Note: checked against the bytes stored]
A DeepSpeed checkpoint comes from elsewhere, so everything it declares is checked before
anything is sized by it, each error a :class:`CheckpointError` naming the file. Its tensors
hold no more than their file stores (``pickles.py``). Its counts are small integers: the ZeRO
stage 0-3, ``partition_count`` the number of optimizer-state files, the step counters under
2**62 (an integer of 100,000 digits cannot even be printed in a message). Its shapes are
lists of sizes whose elements fit in the flat partitions stored: at stages 0-2 a group's
shapes and paddings within ``world`` partitions of its flat group, at stage 3 every
parameter's ``ceil(numel / world)`` elements exactly rank 0's flat groups; a frozen
parameter's shape within its fragments. Only then are segments listed: a loop bounded by the
parameters and ranks, never by a declared size. Last, every segment lies within the flat
groups of its rank, fp32 weights and per-element optimizer state alike, so a read never runs
past what a file holds.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Sequence, Sized
from pathlib import Path
from typing import Any

import torch

from ...moe.names import expert_place, renumber
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
            state = load_pickle(tag_dir / name, trust_checkpoint)
            if not isinstance(state, dict):
                raise _damaged(tag_dir / name, "it holds no model state (not a model-states file)")
            return state
    raise CheckpointError(f"{tag_dir}: no mp_rank_00 model-states file")


def _open_part(
    tag_dir: Path, files: dict[str, Path], mp: int, trust_checkpoint: bool
) -> DeepSpeedCheckpoint:
    """Tensor-parallel rank ``mp``'s part: its data-parallel ranks' files."""
    mine = {n: f for n, f in files.items() if _mp_rank(n) in (mp, None)}
    optim = _rank_files(tag_dir, mine, _OPTIM, f"mp_rank_{mp:02d} optim_states")
    opt_states = [_optimizer_file(p, trust_checkpoint) for p in optim]
    stage = _stage(tag_dir, opt_states, optim)
    if stage == 3:
        models = _rank_files(tag_dir, mine, _MODEL3, f"mp_rank_{mp:02d} model_states")
    elif f"mp_rank_{mp:02d}_model_states.pt" in files:
        models = [files[f"mp_rank_{mp:02d}_model_states.pt"]]
    else:
        raise CheckpointError(f"{tag_dir}: mp_rank_{mp:02d}_model_states.pt is missing")
    model_files = [_model_file(p, trust_checkpoint) for p in models]
    count = opt_states[0].get("partition_count")
    counts = count if isinstance(count, (list, tuple)) and count else [count]
    world = max(_int(c, "partition_count", optim[0], low=1) for c in counts)
    if world != len(optim) or (stage == 3 and world != len(model_files)):
        raise CheckpointError(
            f"{tag_dir}: written by {world} ranks but {len(optim)} optimizer-state files are "
            "there: the checkpoint is incomplete (a rank's save did not finish)"
        )
    ckpt = DeepSpeedCheckpoint(tag_dir, stage, world, model_files[0], opt_states, model_files)
    ckpt.optim_paths, ckpt.model_paths = optim, models
    _check_declared(ckpt)
    ckpt.segments = _segments3(ckpt) if stage == 3 else _segments12(ckpt)
    _check_reach(ckpt)
    return ckpt


def _mp_rank(name: str) -> int | None:
    """The tensor-parallel rank a file of the tag directory belongs to (None: not a rank's)."""
    for pattern, group in ((_OPTIM, 2), (_MODEL3, 2), (_MODEL, 1)):
        m = pattern.match(name)
        if m:
            return int(m.group(group))
    return None


def _rank_files(
    tag_dir: Path, files: dict[str, Path], pattern: re.Pattern[str], what: str
) -> list[Path]:
    by_rank: dict[int, Path] = {}
    for name, path in sorted(files.items()):
        m = pattern.match(name)
        if not m:
            continue
        rank = int(m.group(1))
        if rank in by_rank:  # e.g. bf16_ beside the plain name: which one is this rank's?
            raise CheckpointError(
                f"{tag_dir}: two {what} files for rank {rank}, {by_rank[rank].name} and "
                f"{name}; a tag directory holds one per rank: remove the one that belongs to "
                "another run"
            )
        if not path.is_file():
            raise CheckpointError(f"{path}: not a file; the {what} file of rank {rank} is")
        by_rank[rank] = path
    if not by_rank:
        raise CheckpointError(f"{tag_dir}: no {what} files: not a ZeRO checkpoint")
    # ranks are distinct, so one is missing below len(by_rank) if any is (a file may name rank
    # 10**200: never count up to it)
    missing = [r for r in range(len(by_rank)) if r not in by_rank]
    if missing:
        raise CheckpointError(
            f"{tag_dir}: the {what} files of rank(s) {missing[:8]} are missing: the checkpoint "
            "is incomplete"
        )
    return [by_rank[r] for r in range(len(by_rank))]


# -- what the files declare, checked (see [Note: checked against the bytes stored]) ---------

_MAX_INT = 2**62  # any count or size in a checkpoint is far smaller
_MAX_DIMS = 64


class _Short(reprlib.Repr):
    """A value in an error message, cut short; a huge integer as its size, since printing one
    of over 4,300 digits raises."""

    def repr1(self, x: object, level: int) -> str:
        if isinstance(x, int) and not isinstance(x, bool):  # ZeroStage too
            return f"<an integer of {x.bit_length()} bits>" if x.bit_length() > 64 else str(int(x))
        return super().repr1(x, level)


_SHORT = _Short()


def _damaged(where: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {what}; the file is damaged, crafted or not DeepSpeed's: restore it from a "
        "good copy"
    )


def _int(value: object, what: str, where: Path, low: int = 0, high: int = _MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _damaged(where, f"{what} is {_SHORT.repr(value)}, not an integer {low}-{high}")
    return int(value)


def _numel(shape: object, what: str, where: Path) -> int:
    """The element count of a declared ``shape``: a few sizes, each an integer >= 0."""
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > _MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        or not all(0 <= d <= _MAX_INT for d in shape)
    ):
        raise _damaged(where, f"{what} is {_SHORT.repr(shape)}, not a shape")
    return math.prod(shape)


def _optimizer_file(path: Path, trust_checkpoint: bool) -> dict[str, Any]:
    found = load_pickle(path, trust_checkpoint)
    sd = found.get("optimizer_state_dict") if isinstance(found, dict) else None
    if not isinstance(sd, dict):
        raise _damaged(path, "it holds no optimizer_state_dict")
    return sd


def _model_file(path: Path, trust_checkpoint: bool) -> dict[str, Any]:
    state = load_pickle(path, trust_checkpoint)
    if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        raise _damaged(path, "it holds no module state (not a model-states file)")
    for key in ("global_steps", "skipped_steps"):
        if key in state:
            _int(state[key], key, path)
    for key in ("ds_config", "shared_params", "frozen_param_shapes", "frozen_param_fragments"):
        if not isinstance(state.get(key) or {}, dict):
            raise _damaged(path, f"{key} is {_SHORT.repr(state[key])}, not a dict")
    if not all(isinstance(v, str) for v in (state.get("shared_params") or {}).values()):
        raise _damaged(path, "shared_params maps a name to something else than a name")
    names, module = state.get("buffer_names") or (), state["module"]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise _damaged(path, "buffer_names is not a list of names")
    if not all(torch.is_tensor(module[n]) for n in names if n in module):
        raise _damaged(path, "a buffer of buffer_names is not a tensor in the module state")
    return state


def _stage(tag_dir: Path, opt_states: list[dict[str, Any]], paths: list[Path]) -> int:
    stages = [
        _int(sd.get("zero_stage"), "the ZeRO stage (zero_stage)", p, high=3)
        for sd, p in zip(opt_states, paths, strict=True)
    ]
    if len(set(stages)) > 1:
        raise CheckpointError(
            f"{tag_dir}: its optimizer-state files were written at different ZeRO stages "
            f"({stages}); a tag directory holds one save: restore it from a good copy"
        )
    return stages[0]


def _flats(ckpt: DeepSpeedCheckpoint, rank: int, key: str = "fp32") -> list[torch.Tensor]:
    """``ckpt.flat(rank, key)``, refused naming the file unless a list of tensors."""
    where = ckpt.optim_paths[rank]
    if key == "fp32":  # a list of tensors: never a tensor, which list() would take apart
        raw = ckpt.optim[rank].get(
            "fp32_flat_groups" if ckpt.stage == 3 else "single_partition_of_fp32_groups"
        )
        if not isinstance(raw, (list, tuple)):
            raise _damaged(where, f"its fp32 flat groups are a {type(raw).__name__}, not a list")
    try:
        flats = ckpt.flat(rank, key)
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise _damaged(where, f"its {key} flat groups are not there ({type(e).__name__})") from None
    if not all(torch.is_tensor(t) for t in flats):
        raise _damaged(where, f"its {key} flat groups are not all tensors")
    return flats


def _param_shapes(ckpt: DeepSpeedCheckpoint) -> list[dict[str, int]]:
    """Each param group's parameters and their element counts, every shape checked."""
    where, declared = ckpt.model_paths[0], ckpt.model_state.get("param_shapes")
    if not isinstance(declared, (list, tuple)) or not all(isinstance(d, dict) for d in declared):
        raise _damaged(where, f"param_shapes is {_SHORT.repr(declared)}, not a list of dicts")
    seen: set[str] = set()
    out = []
    for shapes in declared:
        counts = {}
        for name, shape in shapes.items():
            if not isinstance(name, str) or name in seen:
                raise _damaged(where, f"param_shapes names {_SHORT.repr(name)} twice or oddly")
            seen.add(name)
            counts[name] = _numel(shape, f"the shape of {name!r}", where)
        out.append(counts)
    return out


def _check_declared(ckpt: DeepSpeedCheckpoint) -> None:
    """The declared shapes against the flat partitions stored, before any loop they size."""
    counted = _param_shapes(ckpt)
    sizes = [t.numel() for t in _flats(ckpt, 0)]
    where, data = ckpt.model_paths[0], ckpt.optim_paths[0]
    if ckpt.stage == 3:
        need = sum(-(-n // ckpt.world_size) for c in counted for n in c.values())
        if need != sum(sizes):
            raise _damaged(
                where,
                f"its parameters' partitions take {need} elements per rank but {data.name} "
                f"stores {sum(sizes)}; the shapes and the saved groups disagree",
            )
    else:
        if len(sizes) != len(counted):
            raise _damaged(data, f"{len(sizes)} flat groups for {len(counted)} param groups")
        paddings = _paddings(ckpt, counted)
        ranks = _partition_counts(ckpt)
        for g, counts in enumerate(counted):
            need = sum(counts.values()) + sum(paddings[g])
            if need > sizes[g] * ranks[g]:
                raise _damaged(
                    where,
                    f"param group {g} declares {need} elements but {ranks[g]} rank(s) "
                    f"store {sizes[g]} each ({data.name}); the shapes and the saved groups "
                    "disagree",
                )
    _check_frozen(ckpt)


def _paddings(ckpt: DeepSpeedCheckpoint, counted: Sequence[Sized]) -> list[list[int]]:
    where, found = ckpt.optim_paths[0], ckpt.optim[0].get("param_alignment_paddings")
    if not found:
        return [[0] * len(c) for c in counted]
    if not isinstance(found, (list, tuple)) or [len(p) for p in found] != [len(c) for c in counted]:
        raise _damaged(where, "param_alignment_paddings does not match the param groups")
    return [[_int(p, "a param alignment padding", where) for p in pads] for pads in found]


def _check_frozen(ckpt: DeepSpeedCheckpoint) -> None:
    """Each frozen parameter's shape within its fragments: whole in rank 0's file at stages
    0-2, joined from every rank's at stage 3."""
    shapes = ckpt.model_state.get("frozen_param_shapes") or {}
    files = ckpt.model_files if ckpt.stage == 3 else ckpt.model_files[:1]
    for name, shape in shapes.items():
        where = ckpt.model_paths[0]
        n = _numel(shape, f"the shape of frozen {_SHORT.repr(name)}", where)
        held = 0
        for f, path in zip(files, ckpt.model_paths[: len(files)], strict=True):
            fragment = (f.get("frozen_param_fragments") or {}).get(name)
            if not torch.is_tensor(fragment):
                raise _damaged(path, f"frozen parameter {name!r} has no fragment")
            held += fragment.numel()
        if held < n or (ckpt.stage != 3 and held != n):
            raise _damaged(
                where, f"frozen parameter {name!r} declares {n} elements, {held} are stored"
            )


def _check_reach(ckpt: DeepSpeedCheckpoint) -> None:
    """Every segment within its rank's flat groups, fp32 weights and per-element optimizer
    state alike, so a read never runs past what a file stores."""
    need: dict[tuple[int, int | None], int] = {}  # (rank, group or None: all of them)
    for segs in ckpt.segments.values():
        for s in segs:
            need[s.rank, s.group] = max(need.get((s.rank, s.group), 0), s.offset + s.length)
    keys = ["fp32", *_element_keys(ckpt)]
    for (rank, group), n in sorted(need.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        for key in keys:
            flats = _flats(ckpt, rank, key)
            if group is not None and group >= len(flats):
                raise _damaged(ckpt.optim_paths[rank], f"its {key} state has no group {group}")
            held = sum(t.numel() for t in (flats if group is None else flats[group : group + 1]))
            if held < n:
                where = f"rank {rank}'s {key} partition" + (
                    "" if group is None else f" of group {group}"
                )
                raise _damaged(
                    ckpt.optim_paths[rank],
                    f"{where} holds {held} elements, its parameters' shapes need {n}",
                )


def _element_keys(ckpt: DeepSpeedCheckpoint) -> list[str]:
    """The optimizer's per-element state, where saved (a load without the optimizer state
    needs none; one that needs it says so there)."""
    for rank, sd in enumerate(ckpt.optim):
        found = sd.get("base_optimizer_state", sd.get("optimizer_state_dict"))
        state = found.get("state") if isinstance(found, dict) else None
        if state is None:
            return []
        if not isinstance(state, dict) or not all(
            isinstance(g, int) and isinstance(v, dict) for g, v in state.items()
        ):
            raise _damaged(ckpt.optim_paths[rank], "its optimizer state is not one per group")
    return ckpt.element_keys()


def _segments12(ckpt: DeepSpeedCheckpoint) -> dict[str, tuple[Segment, ...]]:
    """Stages 0-2: each group is flattened whole, then cut into equal partitions, one per rank
    of the group's partition (every rank; a DeepSpeed-MoE expert group's: the ranks holding
    the same experts, see [Note: DeepSpeed's layout]); a parameter's segments are bounded by
    the ranks (``_check_declared`` came first)."""
    paddings = _paddings(ckpt, ckpt.groups)
    counts = _partition_counts(ckpt)
    # (not ckpt.shapes, which holds the experts' global names once they are listed here)
    shapes = {k: torch.Size(v) for g in ckpt.model_state["param_shapes"] for k, v in g.items()}
    out: dict[str, tuple[Segment, ...]] = {}
    sizes = [t.numel() for t in ckpt.flat(0)]
    for g, names in enumerate(ckpt.groups):
        ep = ckpt.world_size // counts[g]
        for place in range(ep):  # the experts of each place in an expert group
            ranks = list(range(place, ckpt.world_size, ep))
            named = _expert_names(names, place, shapes, ckpt) if ep > 1 else names
            part, offset = sizes[g], 0
            for i, (name, whole) in enumerate(zip(names, named, strict=True)):
                n = shapes[name].numel()
                segs = []
                at = offset
                while at < offset + n:
                    j, local = divmod(at, part)
                    length = min(part - local, offset + n - at)
                    rank = ranks[j]
                    segs.append(Segment(rank, local, at - offset, length, group=g))
                    at += length
                out[whole] = tuple(segs)
                offset += n + paddings[g][i]
    return out


def _partition_counts(ckpt: DeepSpeedCheckpoint) -> list[int]:
    """Each param group's partition count: the world, or a DeepSpeed-MoE expert group's
    ranks holding the same experts (a divisor of the world; its names are experts')."""
    where = ckpt.optim_paths[0]
    found = ckpt.optim[0].get("partition_count")
    groups = ckpt.groups
    if not isinstance(found, (list, tuple)) or len(found) != len(groups):
        return [ckpt.world_size] * len(groups)
    counts = [_int(c, "partition_count", where, low=1) for c in found]
    for c, names in zip(counts, groups, strict=True):
        if ckpt.world_size % c or (c < ckpt.world_size and not all(expert_place(n) for n in names)):
            raise _damaged(
                where,
                f"a param group is partitioned over {c} of {ckpt.world_size} ranks, and only a "
                "DeepSpeed-MoE group of experts is, over a divisor of the world",
            )
    return counts


def _expert_names(
    names: list[str], place: int, shapes: dict[str, torch.Size], ckpt: DeepSpeedCheckpoint
) -> list[str]:
    """``names`` (rank 0's experts, by local index) as the experts of the ranks at ``place``
    in their expert group: local index ``i`` of a layer with ``L`` experts a rank is global
    ``place * L + i``; their shapes join ``ckpt.expert_shapes``."""
    places = [expert_place(n) for n in names]  # _partition_counts checked every name
    per_layer: dict[str, set[int]] = {}
    for found in places:
        assert found is not None
        per_layer.setdefault(found[0], set()).add(found[1])
    out = []
    for n, found in zip(names, places, strict=True):
        assert found is not None
        whole = renumber(n, place * len(per_layer[found[0]]))
        ckpt.expert_shapes[whole] = shapes[n]
        out.append(whole)
    return out


def _segments3(ckpt: DeepSpeedCheckpoint) -> dict[str, tuple[Segment, ...]]:
    """Stage 3: each parameter is cut into equal partitions, one per rank, one after another
    (their total checked against the saved groups by ``_check_declared``)."""
    world, out, offset = ckpt.world_size, {}, 0
    for name, shape in ckpt.shapes.items():
        n = shape.numel()
        part = -(-n // world)
        out[name] = tuple(
            Segment(r, offset, r * part, min(part, n - r * part))
            for r in range(world)
            if r * part < n
        )
        offset += part
    return out
