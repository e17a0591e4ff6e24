"""Our checkpoint written in DeepSpeed's layout for a given world size and ZeRO stage, which
DeepSpeed itself loads and resumes from (``ds-strategy convert SRC DST --to deepspeed``).

[Note: writing DeepSpeed's layout]
The files are the ones ``layout.py`` reads (see [Note: DeepSpeed's layout] there), made as
DeepSpeed 0.19 makes them, since its load copies each rank's partitions into place as they
are: at stages 0-2 each param group is flattened in order and padded to a multiple of
``2 x world`` elements (DeepSpeed's alignment), rank ``r`` holds the ``r``-th equal part, its
fp32 weights saved without the padding and its Adam moments with it; at stage 3 each
parameter is cut into ``ceil(numel / world)``-element parts, the last padded. The optimizer's
param groups take the hyper-parameter names of the optimizer DeepSpeed builds from the
config's section (``bias_correction`` for its Adam), the counters, lr-scheduler position and
loss scale are DeepSpeed's (the inverse of ``load.py``'s mapping). The few objects DeepSpeed
keeps as its own classes (its loss scaler, the ZeRO stage) are written under their DeepSpeed
names without importing DeepSpeed. Written into a temporary directory, renamed into place,
then ``latest``.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import types
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ....config import load_config
from ..manager import resolve_sources, write_latest
from ..pinned import pinned_sources
from ..validate import CheckpointError
from .ours import SavedCheckpoint

__all__ = ["convert", "export_deepspeed"]

LAYOUT_VERSION = "0.19.8"  # the DeepSpeed release whose files these are (tests load them there)
_DEEPSPEED_SCHEDULES = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}


def _foreign(module: str, name: str, base: type = object) -> type:
    """A class pickled under DeepSpeed's ``module.name`` (see :class:`_Pickler`)."""
    return type(name, (base,), {"__module__": module, "__qualname__": name, "_foreign": True})


class _Stage(int):
    def __reduce__(self) -> tuple[type, tuple[int]]:
        return (type(self), (int(self),))  # as an Enum member pickles


LossScaler = _foreign("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
DynamicLossScaler = _foreign("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
ZeroStageEnum = _foreign("deepspeed.runtime.zero.config", "ZeroStageEnum", _Stage)
FragmentAddress = _foreign("deepspeed.utils.tensor_fragment", "fragment_address")


class _Pickler(pickle._Pickler):
    """Writes a :func:`_foreign` class as a reference to DeepSpeed's, which it need not import."""

    # typeshed leaves out the pure-Python pickler's write, memoize and save_global
    def save_global(self, obj: object, name: str | None = None) -> None:
        if getattr(obj, "_foreign", False) and isinstance(obj, type):
            message = f"{obj.__module__}\n{obj.__qualname__}\n".encode()
            self.write(pickle.GLOBAL + message)  # type: ignore[attr-defined]
            self.memoize(obj)  # type: ignore[attr-defined]
            return
        super().save_global(obj, name)  # type: ignore[misc]


_PICKLE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def _record(cls: type, **attrs: object) -> object:
    obj: object = object.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def _save(obj: object, path: Path) -> None:
    torch.save(obj, path, pickle_module=_PICKLE, _use_new_zipfile_serialization=True)


@dataclass(frozen=True)
class _Part:
    """``length`` elements of parameter ``name`` from ``start``, at ``offset`` of a partition."""

    name: str
    start: int
    length: int
    offset: int


def _parts12(
    groups: list[list[str]], shapes: dict[str, torch.Size], world: int
) -> list[tuple[int, list[list[_Part]]]]:
    """Stages 0-2: for each group, (partition size, each rank's parts)."""
    out = []
    for names in groups:
        total = sum(shapes[n].numel() for n in names)
        align = 2 * world
        size = math.ceil(total / align) * align // world
        ranks: list[list[_Part]] = [[] for _ in range(world)]
        at = 0
        for name in names:
            n, done = shapes[name].numel(), 0
            while done < n:
                rank, local = divmod(at, size)
                length = min(size - local, n - done)
                ranks[rank].append(_Part(name, done, length, local))
                done, at = done + length, at + length
        out.append((size, ranks))
    return out


def _parts3(
    groups: list[list[str]], shapes: dict[str, torch.Size], world: int
) -> list[tuple[int, list[list[_Part]]]]:
    """Stage 3: for each group, (a rank's flat size, each rank's parts)."""
    out = []
    for names in groups:
        ranks: list[list[_Part]] = [[] for _ in range(world)]
        offset = 0
        for name in names:
            n = shapes[name].numel()
            part = math.ceil(n / world)
            for r in range(world):
                if r * part < n:
                    ranks[r].append(_Part(name, r * part, min(part, n - r * part), offset))
            offset += part
        out.append((offset, ranks))
    return out


@dataclass
class _Export:
    """What one export writes, read once from our checkpoint."""

    saved: SavedCheckpoint
    config: dict[str, Any]
    world: int
    stage: int
    groups: list[list[str]]

    @property
    def dtype(self) -> torch.dtype:
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if (self.config.get(key) or {}).get("enabled") is True:
                return dtype
        return torch.float32

    @property
    def frozen(self) -> list[str]:
        trained = {n for g in self.groups for n in g}
        return [n for n in self.saved.shapes if n not in trained]

    def shapes(self, names: list[str]) -> OrderedDict[str, torch.Size]:
        return OrderedDict((n, self.saved.shapes[n]) for n in names)


def export_deepspeed(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    world_size: int,
    stage: int,
    tag: str | None = None,
    trust_checkpoint: bool = False,
    require_checksums: bool = True,
) -> Path:
    """Write the checkpoint at ``src`` (ours: a directory, or a root and its ``latest`` or
    ``tag``) under ``dst`` as DeepSpeed's ``global_step<N>/`` and ``latest`` for
    ``world_size`` data-parallel ranks at ZeRO ``stage``; returns the tag directory."""
    if stage not in (0, 1, 2, 3) or world_size < 1:
        raise ValueError(f"stage={stage}, world_size={world_size}: a ZeRO stage 0-3 and >= 1 rank")
    with pinned_sources(None, lambda: resolve_sources(Path(src), tag), require_checksums) as pins:
        if len(pins) != 1:
            raise CheckpointError(
                f"{src}: a checkpoint of {len(pins)} parts (pipeline stages or several "
                "engines); DeepSpeed's layout holds one data-parallel model: export one "
                "engine's part"
            )
        return _export(SavedCheckpoint(pins[0], trust_checkpoint, require_checksums), dst,
                       world_size, stage)  # fmt: skip


def _export(saved: SavedCheckpoint, dst: str | os.PathLike, world_size: int, stage: int) -> Path:
    # each group's parameters in the model's order, as DeepSpeed flattens them
    groups = [[n for n in saved.shapes if n in set(g["param_names"])] for g in saved.param_groups]
    job = _Export(saved, _ds_config(saved, world_size, stage), world_size, stage, groups)
    root = Path(dst)
    out_tag = f"global_step{saved.engine_state['global_steps']}"
    final, tmp = root / out_tag, root / f"{out_tag}.tmp"
    if final.exists():
        raise FileExistsError(f"{final} exists: export into another directory")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_ranks(job, tmp)
    os.replace(tmp, final)
    write_latest(root, out_tag)
    return final


def _ds_config(saved: SavedCheckpoint, world: int, stage: int) -> dict[str, Any]:
    """The saved config (a checkpoint without one: the defaults) at ``stage`` and ``world``."""
    cfg = dict(saved.engine_state.get("config") or load_config(None).to_dict())
    cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": stage}
    micro, accumulation = (
        cfg.get("train_micro_batch_size_per_gpu"),
        cfg.get("gradient_accumulation_steps"),
    )
    if isinstance(micro, int) and isinstance(accumulation, int):
        cfg["train_batch_size"] = micro * accumulation * world
    return cfg


def _write_ranks(job: _Export, tmp: Path) -> None:
    plan = (_parts3 if job.stage == 3 else _parts12)(job.groups, job.saved.shapes, job.world)
    buffers = job.saved.buffers()
    module = {n: job.saved.weight(n).to(job.dtype) for n in job.saved.shapes} | buffers
    model_state = _model_state(job, module, list(buffers))
    prefix = "bf16_" if job.dtype == torch.bfloat16 else ""
    for rank in range(job.world):
        optim = _optimizer_state(job, plan, rank)
        body = {
            "optimizer_state_dict": optim,
            "ds_config": job.config,
            "ds_version": LAYOUT_VERSION,
        }
        _save(body, tmp / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        if job.stage == 3:
            _save(
                _stage3_model_state(job, model_state, module, set(buffers), rank),
                tmp / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
            )
    if job.stage < 3:
        _save(model_state, tmp / "mp_rank_00_model_states.pt")


def _model_state(
    job: _Export, module: dict[str, torch.Tensor], buffers: list[str]
) -> dict[str, object]:
    """``mp_rank_00_model_states.pt`` (stage 3: each rank's, with empty parameters)."""
    saved, steps = job.saved, int(job.saved.engine_state["global_steps"])
    frozen = job.frozen
    micro = job.config.get("train_micro_batch_size_per_gpu")
    accumulation = job.config.get("gradient_accumulation_steps")
    state: dict[str, object] = {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [job.shapes(g) for g in job.groups],
        "frozen_param_shapes": job.shapes(frozen),
        "shared_params": {},
        "frozen_param_fragments": OrderedDict((n, module[n]) for n in frozen),
        "lr_scheduler": _scheduler_state(job),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(saved.engine_state.get("skipped_steps", 0)),
        "global_steps": steps,
        "global_samples": steps * micro * accumulation * job.world
        if isinstance(micro, int) and isinstance(accumulation, int)
        else 0,
        "dp_world_size": job.world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": job.config,
        "ds_version": LAYOUT_VERSION,
    }
    client = saved.client_state
    if isinstance(client, dict):
        clash = sorted(set(client) & set(state))
        if clash:
            raise CheckpointError(
                f"client_state keys {clash} are DeepSpeed's own: rename them to export"
            )
        state.update(client)
    return state


def _stage3_model_state(
    job: _Export,
    state: dict[str, object],
    full: dict[str, torch.Tensor],
    buffers: set[str],
    rank: int,
) -> dict[str, object]:
    module = {n: t if n in buffers else torch.empty(0, dtype=t.dtype) for n, t in full.items()}
    fragments: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name in job.frozen:
        flat = full[name].reshape(-1)
        part = math.ceil(flat.numel() / job.world)
        piece = flat[rank * part : (rank + 1) * part]
        fragments[name] = torch.cat([piece, piece.new_zeros(part - piece.numel())])
    return {**state, "module": module, "frozen_param_fragments": fragments}


def _scheduler_state(job: _Export) -> dict[str, object] | None:
    """Ours as DeepSpeed keeps it (the inverse of ``core/schedulers.load_scheduler_state``)."""
    state = job.saved.engine_state.get("lr_scheduler")
    kind = (job.config.get("scheduler") or {}).get("type")
    if state is None or kind not in _DEEPSPEED_SCHEDULES:
        return state  # a torch scheduler's own state_dict, which it loads as it is
    last_epoch = state["last_epoch"]
    if not isinstance(last_epoch, (int, float)):
        raise CheckpointError(f"{job.saved.path}: the lr scheduler's last_epoch is not a number")
    step = int(last_epoch)
    return {"last_batch_iteration": step - 1 if kind in ("OneCycle", "LRRangeTest") else step}


def _optimizer_state(
    job: _Export, plan: list[tuple[int, list[list[_Part]]]], rank: int
) -> dict[str, object]:
    """Rank ``rank``'s ``optimizer_state_dict``: its fp32 partitions and optimizer state."""
    flats: list[torch.Tensor] = []
    states: dict[int, dict[str, object]] = {}
    mappings: list[OrderedDict[str, object]] = []
    steps = 0
    for g, (size, ranks) in enumerate(plan):
        fp32 = torch.zeros(size)
        moments: dict[str, torch.Tensor] = {}
        mapping: OrderedDict[str, object] = OrderedDict()
        for part in ranks[rank]:
            end = part.offset + part.length
            fp32[part.offset : end] = job.saved.weight(part.name).reshape(-1)[
                part.start : part.start + part.length
            ]
            for key, value in job.saved.optimizer_state(part.name).items():
                if value.numel() == job.saved.shapes[part.name].numel():
                    flat = moments.setdefault(key, torch.zeros(size))
                    flat[part.offset : end] = value.reshape(-1)[
                        part.start : part.start + part.length
                    ].float()
                elif key == "step":
                    steps = int(value.item())
            mapping[part.name] = _record(FragmentAddress, numel=part.length, start=part.offset)
        flats.append(fp32)
        states[g] = {"step": steps, **moments}
        mappings.append(mapping)
    base = {"state": states, "param_groups": _param_groups(job)}
    common = {
        "loss_scaler": _loss_scaler(job),
        "dynamic_loss_scale": _dynamic_scale(job),
        "overflow": False,
        "zero_stage": ZeroStageEnum(job.stage),
    }
    if job.stage == 3:
        return {
            **common,
            "partition_count": job.world,
            "optimizer_state_dict": base,
            "fp32_flat_groups": flats,
        }
    last = rank == job.world - 1
    paddings = [
        size * job.world - sum(job.saved.shapes[n].numel() for n in names)
        for (size, _), names in zip(plan, job.groups, strict=True)
    ]
    return {
        **common,
        "clip_grad": float(job.config.get("gradient_clipping") or 0.0),
        "base_optimizer_state": base,
        "single_partition_of_fp32_groups": [
            f[: f.numel() - p] if last else f for f, p in zip(flats, paddings, strict=True)
        ],
        "group_paddings": [p if last else 0 for p in paddings],
        "param_alignment_paddings": [[0] * len(names) for names in job.groups],
        "partition_count": [job.world] * len(job.groups),
        "ds_version": LAYOUT_VERSION,
        "param_slice_mappings": mappings,
    }


def _param_groups(job: _Export) -> list[dict[str, object]]:
    """The saved groups' hyper-parameters, named as the optimizer DeepSpeed builds has them:
    its Adam's from an Adam/AdamW section; otherwise as saved (a torch optimizer's)."""
    kind = str((job.config.get("optimizer") or {}).get("type", "")).lower()
    out: list[dict[str, object]] = []
    for i, g in enumerate(job.saved.param_groups):
        hyper: dict[str, object] = {k: v for k, v in g.items() if k != "param_names"}
        if kind in ("adam", "adamw"):
            hyper = {
                "lr": g["lr"],
                "bias_correction": True,
                "betas": tuple(g["betas"]),
                "eps": g["eps"],
            }
            hyper |= {"weight_decay": g["weight_decay"], "step": 0}
        out.append({**hyper, "params": [i]})
    return out


def _dynamic_scale(job: _Export) -> bool:
    state = job.saved.engine_state.get("loss_scaler")
    return bool(state and state.get("dynamic"))  # as _loss_scaler's record says


def _loss_scaler(job: _Export) -> object:
    """DeepSpeed's loss scaler with our scaler's state (the inverse of ``load.py``'s)."""
    state = job.saved.engine_state.get("loss_scaler")
    if not state or not state.get("dynamic"):
        return _record(LossScaler, cur_scale=float(state["scale"]) if state else 1.0, dynamic=False)
    return _record(
        DynamicLossScaler,
        cur_scale=float(state["scale"]),
        cur_iter=int(state["iteration"]),
        last_overflow_iter=int(state["last_overflow"]),
        scale_factor=2.0,
        scale_window=int(state["window"]),
        min_scale=float(state["min_scale"]),
        delayed_shift=int(state["hysteresis"]),
        cur_hysteresis=int(state["hysteresis_left"]),
        consecutive_hysteresis=bool(state["consecutive_hysteresis"]),
        raise_error_at_min_scale=True,
        dtype=torch.float16,
        dynamic=True,
    )


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str = "deepspeed",
    *,
    world_size: int,
    stage: int,
    tag: str | None = None,
    trust_checkpoint: bool = False,
    require_checksums: bool = True,
) -> Path:
    """Write our checkpoint ``src`` in another library's layout under ``dst``.

    ``to="deepspeed"`` writes DeepSpeed's ``global_step<N>/`` and ``latest``, for
    ``world_size`` data-parallel ranks at ZeRO ``stage``. DeepSpeed's
    ``engine.load_checkpoint(dst)`` resumes from it. It holds the weights, Adam moments and
    steps, param groups, lr-scheduler position, loss scale, counters and client state.

    Args:
        src: our checkpoint: a directory, or a root and its ``latest`` (or ``tag``).
        dst: the directory to write under.
        to: the layout to write; ``"deepspeed"`` is the one there is.
        world_size: the data-parallel ranks the written checkpoint is for.
        stage: the ZeRO stage (0-3) the written checkpoint is for.
        tag: a tag under the root, other than the one its ``latest`` names.
        trust_checkpoint: load pickled objects in ``src`` other than plain data.
        require_checksums: refuse a checkpoint that records no checksums.

    Returns:
        The directory written, ``dst/global_step<N>``.

    >>> ds_strategy.convert("ckpt", "ds_ckpt", to="deepspeed", world_size=8, stage=3)  # doctest: +SKIP
    """
    if to != "deepspeed":
        raise ValueError(
            f"convert(to={to!r}): the layout to write is 'deepspeed' (a DeepSpeed checkpoint "
            "loads here as it is: engine.load_checkpoint(path))"
        )
    return export_deepspeed(src, dst, world_size, stage, tag, trust_checkpoint, require_checksums)
