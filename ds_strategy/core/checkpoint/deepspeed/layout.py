"""DeepSpeed's checkpoint layout, read by content (see [Note: DeepSpeed's layout]).

[Note: DeepSpeed's layout]
``save_dir/latest`` names a tag directory; a Lightning ``DeepSpeedStrategy`` checkpoint
(``x.ckpt/``, tag ``checkpoint``) and a Trainer's ``checkpoint-N/`` (tag ``global_stepN``)
are the same layout one level down. In the tag directory:

- stages 0-2: ``mp_rank_00_model_states.pt`` (the module's weights in the training dtype,
  ``param_shapes`` per param group, ``frozen_param_shapes``/``frozen_param_fragments``,
  ``shared_params``, ``buffer_names``, ``lr_scheduler``, ``global_steps``, ``skipped_steps``
  and the client state as top-level keys), and per data-parallel rank ``r``
  ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` whose ``optimizer_state_dict`` holds
  ``single_partition_of_fp32_groups``: rank ``r``'s slice of each group's fp32 weights
  flattened one after another in ``param_shapes`` order (plus ``param_alignment_paddings``
  where saved); the base optimizer's state per group is sliced alike.
- stage 3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (the same model state;
  frozen fragments are the rank's) and its optim file, whose ``fp32_flat_groups`` hold rank
  ``r``'s partition of *each parameter*, ``ceil(numel / world)`` elements (the last rank's
  padded), one parameter after another over all groups.
- bf16 prefixes the optim files with ``bf16_``; older versions wrote ``..._00optim_states.pt``.
- DeepSpeed-MoE (stages 0-2): a param group of experts is partitioned over the expert-data
  group (its ``partition_count`` is the world over ``ep_size``; expert groups are consecutive
  ranks). ``param_shapes`` names rank 0's experts by local index: rank ``r``'s group holds
  experts ``(r % ep_size) * L + i``. Each expert's weights are also in
  ``layer_<l>_expert_<e>_mp_rank_00_model_states.pt``; the fp32 partitions are read instead.

Each parameter is thus a list of :class:`Segment`: runs of its flattened elements at an offset
of one rank's groups laid end to end. Tensors are memory-mapped, so reading one parameter
touches only its bytes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..pinned import confined
from ..validate import CheckpointError
from .pickles import LossScalerState

__all__ = ["DeepSpeedCheckpoint", "Segment", "engine_dir", "find_deepspeed"]

LATEST = "latest"
_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_OWN_KEYS = {  # a model-states file's keys that are DeepSpeed's; the rest is client state
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info",
}  # fmt: skip


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(
        _MODEL.match(p.name) or _MODEL3.match(p.name) for p in path.iterdir()
    )


def find_deepspeed(path: Path, tag: str | None = None) -> Path | None:
    """The tag directory of the DeepSpeed checkpoint at ``path`` (a save directory with
    ``latest``, a tag directory itself, or ``tag`` under ``path``); None when ``path`` holds
    none (it may be one of ours). A tag is confined to ``path`` (see [Note: a tag stays in
    its save directory])."""
    if tag is not None:
        _check_name(tag, f"tag {tag!r}")
        return confined(path, tag) if _is_tag_dir(path / tag) else None
    if _is_tag_dir(path):
        return path
    latest = path / LATEST
    if latest.is_file():
        name = _read_latest(latest)
        _check_name(name, f"{latest} names {name!r}, which")
        named = path / name
        if _is_tag_dir(named):
            return confined(path, name)
        if not named.exists() and any(_is_tag_dir(p) for p in path.iterdir() if p.is_dir()):
            raise CheckpointError(
                f"{path}: a DeepSpeed checkpoint whose latest names {named.name}, which is not "
                "there; pass tag= (one of "
                f"{sorted(p.name for p in path.iterdir() if _is_tag_dir(p))}) to load another"
            )
    return None


# [Note: a tag stays in its save directory]
# ``latest`` and ``tag=`` name a directory of the save directory, as in our own format
# (``manager.resolve_load_dir``): one plain name, never a path. A tag directory that is a
# symbolic link, or resolves elsewhere, is refused too: following it would load (or
# consolidate) another checkpoint's weights under this one's name. A tag directory given as
# ``path`` itself is the caller's choice and is read where it is.
_LATEST_BYTES = 4096  # DeepSpeed writes one tag name; a larger file is not a latest


def _read_latest(latest: Path) -> str:
    with open(latest, "rb") as f:
        raw = f.read(_LATEST_BYTES + 1)
    try:
        name = raw.decode().strip()
    except UnicodeDecodeError:
        name = None
    if name is None or len(raw) > _LATEST_BYTES:
        what = "binary" if name is None else f"over {_LATEST_BYTES} bytes"
        raise CheckpointError(
            f"{latest}: not a tag name ({what}); a 'latest' file holds one tag such as "
            "'global_step100': rewrite it, or pass tag= to load a tag directory"
        )
    return name


def _check_name(name: str, what: str) -> None:
    """``name`` is one plain directory name (``what`` says where it came from)."""
    if not name or "/" in name or os.sep in name or "\0" in name or name in (".", ".."):
        raise CheckpointError(
            f"{what[:300]} is not a tag directory inside the save directory; a tag is one "
            "directory name such as 'global_step100', never a path"
        )


def engine_dir(path: Path, ours: str) -> Path | None:
    """The engine's checkpoint in a front end's save directory ``path``: ``path/ours`` (the
    front end's own layout), else ``path`` itself where DeepSpeed's engine saved there beside
    the front end's files (Accelerate's ``save_state`` under DeepSpeed: ``latest`` naming
    ``pytorch_model/``); None where it holds neither."""
    if (path / ours).is_dir():
        return path / ours
    return path if find_deepspeed(path) is not None else None


@dataclass(frozen=True)
class Segment:
    """``length`` elements of a flattened parameter from ``start``, at ``offset`` of rank
    ``rank``'s flat groups laid end to end, or (stages 0-2) of its flat group ``group``: a
    rank's optimizer state may pad a group its fp32 partition does not."""

    rank: int
    offset: int
    start: int
    length: int
    group: int | None = None


@dataclass
class DeepSpeedCheckpoint:
    """One tag directory of a DeepSpeed checkpoint (see [Note: DeepSpeed's layout])."""

    directory: Path
    stage: int
    world_size: int
    model_state: dict[str, Any]  # rank 0's model-states file
    optim: list[dict[str, Any]]  # each rank's ``optimizer_state_dict``
    model_files: list[dict[str, Any]] = field(repr=False)  # stage 3: every rank's
    segments: dict[str, tuple[Segment, ...]] = field(default_factory=dict)
    optim_paths: list[Path] = field(default_factory=list)  # each rank's file, for errors
    model_paths: list[Path] = field(default_factory=list)  # model_files' files
    # DeepSpeed-MoE: every rank's experts under their global index (see _segments12)
    expert_shapes: dict[str, torch.Size] = field(default_factory=dict)

    @cached_property
    def shapes(self) -> dict[str, torch.Size]:
        """The trained parameters' full shapes, in DeepSpeed's order (each rank's experts
        under their global index after the others)."""
        found = {k: torch.Size(v) for g in self.model_state["param_shapes"] for k, v in g.items()}
        return {**found, **self.expert_shapes}

    @property
    def groups(self) -> list[list[str]]:
        return [list(g) for g in self.model_state["param_shapes"]]

    @property
    def shared(self) -> dict[str, str]:
        """A tied weight's other names: ``{alias: the name it is saved under}``."""
        return dict(self.model_state.get("shared_params") or {})

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        names = set(self.model_state.get("buffer_names") or ())
        return {k: v for k, v in self.model_state["module"].items() if k in names}

    @cached_property
    def frozen(self) -> dict[str, torch.Tensor]:
        """Parameters that did not train, whole."""
        return {name: self.frozen_param(name) for name in self.frozen_shapes}

    @property
    def frozen_shapes(self) -> dict[str, torch.Size]:
        shapes = self.model_state.get("frozen_param_shapes") or {}
        return {k: torch.Size(v) for k, v in shapes.items()}

    def frozen_param(self, name: str) -> torch.Tensor:
        """One frozen parameter, whole (stage 3: joined from every rank's part), in its saved
        dtype; read from the mapped files now."""
        shape = self.frozen_shapes[name]
        parts = [f["frozen_param_fragments"][name].reshape(-1) for f in self.model_files]
        if self.stage != 3:
            return parts[0].view(shape)
        return torch.cat(parts)[: shape.numel()].view(shape)

    @property
    def client_state(self) -> dict[str, object]:
        return {k: v for k, v in self.model_state.items() if k not in _OWN_KEYS}

    @property
    def global_steps(self) -> int:
        return int(self.model_state.get("global_steps", 0))

    @property
    def skipped_steps(self) -> int:
        return int(self.model_state.get("skipped_steps", 0))

    @property
    def ds_config(self) -> dict[str, Any]:
        return dict(self.model_state.get("ds_config") or {})

    @property
    def loss_scaler(self) -> LossScalerState | None:
        scaler = self.optim[0].get("loss_scaler")
        return scaler if isinstance(scaler, LossScalerState) else None

    def base_optimizer(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s base optimizer ``state_dict()`` (its params: the group indices)."""
        sd = self.optim[rank]
        found = sd.get("base_optimizer_state", sd.get("optimizer_state_dict"))
        if not isinstance(found, dict) or "state" not in found:
            raise CheckpointError(f"{self.directory}: rank {rank}'s optimizer state is not saved")
        return found

    def flat(self, rank: int, key: str = "fp32") -> list[torch.Tensor]:
        """Rank ``rank``'s flat groups: the fp32 weights, or per-element optimizer state
        ``key`` (``exp_avg``, ...)."""
        if key == "fp32":
            sd = self.optim[rank]
            return list(
                sd["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"]
            )
        state = self.base_optimizer(rank)["state"]
        return [state[g][key] for g in sorted(state)]

    def element_keys(self) -> list[str]:
        """The optimizer's per-element state (tensors the size of a group's partition)."""
        state = self.base_optimizer(0)["state"]
        first = state[min(state)] if state else {}
        flats = self.flat(0)
        if not flats:
            return []
        return [k for k, v in first.items() if torch.is_tensor(v) and v.shape == flats[0].shape]

    def scalar_state(self) -> dict[str, object]:
        """The optimizer's other state of group 0 (``step``), the same for every group."""
        state = self.base_optimizer(0)["state"]
        first = state[min(state)] if state else {}
        keys = set(self.element_keys())
        return {k: v for k, v in first.items() if k not in keys}

    def read(self, name: str, start: int, length: int, key: str = "fp32") -> torch.Tensor:
        """Elements ``[start, start + length)`` of flattened parameter ``name`` (its fp32
        weights, or optimizer state ``key``)."""
        out = torch.empty(length, dtype=torch.float32)
        flats: dict[int, list[torch.Tensor]] = {}
        for seg in self.segments[name]:
            lo, hi = max(start, seg.start), min(start + length, seg.start + seg.length)
            if lo >= hi:
                continue
            if seg.rank not in flats:
                flats[seg.rank] = self.flat(seg.rank, key)
            at = seg.offset + lo - seg.start
            if seg.group is None:
                out[lo - start : hi - start] = _Joined(flats[seg.rank])[at : at + hi - lo]
            else:
                out[lo - start : hi - start] = flats[seg.rank][seg.group].reshape(-1)[
                    at : at + hi - lo
                ]
        return out

    def full(self, name: str, key: str = "fp32") -> torch.Tensor:
        if name in self.frozen:
            return self.frozen[name].float()
        shape = self.shapes[name]
        return self.read(name, 0, shape.numel(), key).view(shape)


class _Joined:
    """Flat tensors read as one, without copying them together."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = [p.reshape(-1) for p in parts]

    def __getitem__(self, where: slice) -> torch.Tensor:
        lo, hi = where.start, where.stop
        pieces, base = [], 0
        for p in self.parts:
            a, b = max(lo, base), min(hi, base + p.numel())
            if a < b:
                pieces.append(p[a - base : b - base])
            base += p.numel()
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
