"""Resuming an engine from a DeepSpeed checkpoint, at any world size and ZeRO stage, with or
without offload: each rank reads, of each parameter, the elements its engine holds (the
seam's placements) from DeepSpeed's flat partitions (``layout.py``), and the same for every
per-element optimizer state; then step counts, param-group hyper-parameters, the lr
scheduler's position, the fp16 loss scale and the counters.

The lr scheduler's position: see [Note: DeepSpeed's scheduler position] in
``core/schedulers.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...faults import together
from ..records import ScalerState
from ..seam import CheckpointedEngine, ShardedState
from ..validate import CheckpointError
from .layout import DeepSpeedCheckpoint
from .pickles import LossScalerState

__all__ = ["load_deepspeed"]


def load_deepspeed(
    engine: CheckpointedEngine, ckpt: DeepSpeedCheckpoint, load_optimizer: bool = True
) -> dict[str, object]:
    """Restore ``engine`` from ``ckpt``; returns its client state (every top-level key of
    DeepSpeed's model-states file that is not DeepSpeed's own)."""
    shards = engine.checkpoint_shards()
    with together(engine.checkpoint_comm, CheckpointError):
        _check_model(ckpt, shards)
        _load_weights(engine, ckpt, shards)
        if load_optimizer:
            _load_optimizer(engine, ckpt, shards)
        engine.restore_checkpoint_state(_engine_state(engine, ckpt), lr_scheduler=load_optimizer)
    engine.checkpoint_loaded()
    return ckpt.client_state


def _check_model(ckpt: DeepSpeedCheckpoint, shards: ShardedState) -> None:
    saved = {**ckpt.shapes, **{k: v.shape for k, v in ckpt.frozen.items()}}
    live = {k: torch.Size(v) for k, v in shards.shapes.items()}
    missing = sorted(set(live) - set(saved) - set(ckpt.shared))
    unknown = sorted(set(saved) - set(live) - shards.elsewhere)
    wrong = sorted(k for k in set(live) & set(saved) if live[k] != saved[k])
    buffers = ckpt.buffers
    wrong_buffers = sorted(
        k for k, b in shards.buffers.items() if k in buffers and buffers[k].shape != b.shape
    )
    if missing or unknown or wrong or wrong_buffers:
        parts = [
            f"missing {missing[:3]}" if missing else "",
            f"not in this model {unknown[:3]}" if unknown else "",
        ]
        parts += [f"{k}: saved {list(saved[k])}, model {list(live[k])}" for k in wrong[:3]]
        parts += [
            f"buffer {k}: saved {list(buffers[k].shape)}, model {list(shards.buffers[k].shape)}"
            for k in wrong_buffers[:3]
        ]
        raise CheckpointError(
            f"{ckpt.directory}: this DeepSpeed checkpoint does not match the model ("
            + "; ".join(p for p in parts if p)
            + "); load it into the model it was trained with"
        )


def _values(
    ckpt: DeepSpeedCheckpoint, name: str, start: int, length: int, key: str
) -> torch.Tensor:
    name = name if name in ckpt.segments or name in ckpt.frozen else ckpt.shared.get(name, name)
    if name in ckpt.frozen:
        return ckpt.frozen[name].reshape(-1)[start : start + length].float()
    return ckpt.read(name, start, length, key)


def _put(engine: CheckpointedEngine, base: torch.Tensor, offset: int, values: torch.Tensor) -> None:
    """``values`` into elements ``[offset, ...)`` of the 1-D live tensor ``base``, in memory
    or in its swap file (NVMe offload)."""
    files = engine.checkpoint_io
    where = files.find(base, offset, values.numel()) if files is not None else None
    if files is not None and where is not None:
        files.write(where, values.to(base.dtype))
    else:
        base[offset : offset + values.numel()].copy_(values)


def _load_weights(
    engine: CheckpointedEngine, ckpt: DeepSpeedCheckpoint, shards: ShardedState
) -> None:
    for piece in shards.weights:
        name = piece.placement.name
        for run in piece.placement.runs:
            _put(
                engine, piece.tensor, run.offset, _values(ckpt, name, run.start, run.length, "fp32")
            )
    buffers = ckpt.buffers
    for name, buf in shards.buffers.items():
        if name in buffers:
            buf.copy_(buffers[name])


def _load_optimizer(
    engine: CheckpointedEngine, ckpt: DeepSpeedCheckpoint, shards: ShardedState
) -> None:
    opt, files = engine.optimizer, engine.checkpoint_io
    keys, scalars = ckpt.element_keys(), ckpt.scalar_state()
    frozen = set(ckpt.frozen)
    for i, slot in enumerate(shards.optimizer):
        name = slot.placement.name
        if name in frozen:
            continue
        st = opt.state[slot.tensor]
        for key in keys:
            if key not in st:
                st[key] = (
                    files.new_state(i, key, slot.tensor, torch.float32)
                    if files is not None
                    else torch.zeros_like(slot.tensor, dtype=torch.float32)
                )
            flat = st[key].view(-1)
            for run in slot.placement.runs:
                _put(engine, flat, run.offset, _values(ckpt, name, run.start, run.length, key))
        for key, value in scalars.items():
            st[key] = _like(st.get(key), value, ckpt, key)
    saved = ckpt.base_optimizer(0)["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise CheckpointError(
            f"{ckpt.directory}: {len(saved)} optimizer param groups saved, this optimizer has "
            f"{len(opt.param_groups)}; build the optimizer with the same param groups"
        )
    for live, hyper in zip(opt.param_groups, saved, strict=True):
        live.update({k: v for k, v in hyper.items() if k in live and k != "params"})


def _like(current: Any, value: Any, ckpt: DeepSpeedCheckpoint, key: str) -> Any:
    """``value`` (DeepSpeed's step count) as the optimizer keeps it: torch's Adam a tensor."""
    if torch.is_tensor(value):
        return value.clone()
    try:
        if current is None or torch.is_tensor(current):
            return torch.tensor(float(value), dtype=torch.float32)
        return type(current)(value)
    except (TypeError, ValueError, OverflowError):
        where = ckpt.optim_paths[0] if ckpt.optim_paths else ckpt.directory
        raise CheckpointError(
            f"{where}: the optimizer's {key!r} is a {type(value).__name__} that is not a "
            "number; the file is damaged or crafted: restore it from a good copy"
        ) from None


def _engine_state(engine: CheckpointedEngine, ckpt: DeepSpeedCheckpoint) -> dict[str, object]:
    gas = ckpt.ds_config.get("gradient_accumulation_steps")
    gas = gas if isinstance(gas, int) else engine.config.gradient_accumulation_steps
    steps = ckpt.global_steps
    return {
        "global_steps": steps,
        "micro_steps": steps * (gas if isinstance(gas, int) else 1),
        "skipped_steps": ckpt.skipped_steps,
        "lr_scheduler": ckpt.model_state.get("lr_scheduler") or None,  # see the module note
        "loss_scaler": _loss_scaler(ckpt, scaler)
        if (scaler := ckpt.loss_scaler) is not None
        else None,
    }


def _loss_scaler(ckpt: DeepSpeedCheckpoint, scaler: LossScalerState) -> ScalerState:
    """DeepSpeed's loss-scaler attributes (``scaler``, of ``ckpt``) as ``LossScaler``'s state;
    a record without them, or with values of another kind, is an error naming rank 0's file."""
    try:
        return _scaler_state(scaler)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        where = ckpt.optim_paths[0] if ckpt.optim_paths else ckpt.directory
        raise CheckpointError(
            f"{where}: its loss scaler cannot be read ({type(e).__name__}: "
            f"{str(e)[:200]}); the file is damaged or crafted: restore it from a good copy"
        ) from None


def _scaler_state(s: LossScalerState) -> ScalerState:
    state = vars(s)
    out: ScalerState = {
        "scale": float(state["cur_scale"]),
        "dynamic": bool(state.get("dynamic", False)),
    }
    if out["dynamic"]:
        out.update(
            {
                "window": int(state["scale_window"]),
                "hysteresis": int(state["delayed_shift"]),
                "consecutive_hysteresis": bool(state["consecutive_hysteresis"]),
                "min_scale": float(state["min_scale"]),
                "iteration": int(state["cur_iter"]),
                "last_overflow": int(state["last_overflow_iter"]),
                "hysteresis_left": int(state["cur_hysteresis"]),
            }
        )
    return out
