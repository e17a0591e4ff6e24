"""What a rank saves (:class:`RankState`), built from its engine's records (``seam.py``): one
entry per piece of weights, optimizer state and compression residuals, each a
:class:`FlatPiece` placed in its parameter flattened whole, plus the entries that stand alone
(counters, param groups, the caller's ``client_state``, the random state). The same pieces,
as views of the live storage, are what a load reads into (``reshard.py``).
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..collectives import Comm
from ..optim.lowbit import plain_state
from ..optim.state import per_element
from ..warnings import CheckpointWarning
from .flat_piece import FlatPiece
from .keys import CLIENT_STATE, ENGINE, OPTIMIZER_GROUPS, OPTIMIZER_KINDS, EntryKey, rng_key
from .records import CheckpointMeta, Layout, RngState
from .seam import CheckpointedEngine, ExtraState, Placement, ShardedState
from .trust import pack
from .validate import FORMAT, optimizer_class

__all__ = ["RankState", "collect_state", "flat_piece", "partial_window", "warn_partial_window"]


@dataclass(frozen=True)
class RankState:
    """One rank's part of a checkpoint: the per-parameter entries by key, the entries that
    stand alone by name (packed), and the ``ds_strategy.json`` record (rank 0 writes it)."""

    entries: dict[EntryKey, torch.Tensor]  # a FlatPiece, or a whole tensor
    singles: dict[str, torch.Tensor]  # each packed (``trust.pack``)
    meta: CheckpointMeta

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What DCP writes: every entry under its name on disk."""
        return {**{key.text: v for key, v in self.entries.items()}, **self.singles}

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this rank writes."""
        total = 0
        for v in [*self.entries.values(), *self.singles.values()]:
            if isinstance(v, FlatPiece):
                total += v.piece_nbytes
            else:
                total += v.numel() * v.element_size()
        return total

    def snapshot(self) -> RankState:
        """A copy that training cannot change while it is being written (an asynchronous
        save): every tensor cloned, a piece cut to just its elements."""
        return RankState(
            {k: _copy(v) for k, v in self.entries.items()},
            {k: _copy(v) for k, v in self.singles.items()},
            self.meta,
        )


def _copy(v: torch.Tensor) -> torch.Tensor:
    if isinstance(v, FlatPiece):
        return v.snapshot()
    return v.detach().clone()


def flat_piece(where: Placement, local: torch.Tensor) -> FlatPiece:
    """``local``'s elements at ``where``, in the checkpoint's flattened full tensor. No view
    is cut from ``local``, which may be out in a swap file (NVMe offload)."""
    runs = [(r.offset, r.start, r.length) for r in where.runs]
    return FlatPiece(local, runs[0][1] if runs else 0, where.numel, runs=runs)


def weight_entries(shards: ShardedState) -> dict[EntryKey, torch.Tensor]:
    """This rank's pieces of every parameter and the persistent buffers."""
    out: dict[EntryKey, torch.Tensor] = {
        EntryKey("model", w.placement.name): flat_piece(w.placement, w.tensor)
        for w in shards.weights
    }
    out.update({EntryKey("buffer", name): t for name, t in shards.buffers.items()})
    return out


def optimizer_entries(
    shards: ShardedState, optimizer: torch.optim.Optimizer
) -> dict[EntryKey, torch.Tensor]:
    """The optimizer's state of this rank's slots: per-element state placed like its slot,
    other tensors (identical on every owner of the parameter: DCP keeps one) and objects."""
    out: dict[EntryKey, torch.Tensor] = {}
    for slot in shards.optimizer:
        name = slot.placement.name
        state = optimizer.state.get(slot.tensor, {})
        shaped = per_element(state, slot.tensor)
        for k, v in state.items():
            if k in shaped:
                # a quantized state is saved dequantized: it reshards as any other (lowbit.py)
                plain = plain_state(v)
                out[EntryKey("optim", name, k)] = flat_piece(slot.placement, plain.view(-1))
            elif torch.is_tensor(v):
                out[EntryKey("optim_scalar", name, k)] = v
            else:
                out[EntryKey("optim_obj", name, k)] = pack(v)
    return out


def extra_key(x: ExtraState) -> EntryKey:
    return EntryKey(x.kind, x.param, x.name)


def extra_entries(shards: ShardedState, comm: Comm) -> dict[EntryKey, FlatPiece]:
    """[Note: compression residuals in a checkpoint]
    Each rank's residual is its own (what it has not sent yet), so a parameter's residuals are
    saved as one tensor of ``world x numel`` elements, rank ``r`` writing row ``r``. Loaded at
    the same world size, each rank reads its own row back; at another, each rank reads every
    row and takes their mean: the new ranks then owe, on average, what the old ranks owed (the
    averaged update still to come is conserved)."""
    out = {}
    for x in shards.extra:
        n = x.tensor.numel()
        out[extra_key(x)] = FlatPiece(x.tensor, comm.rank * n, comm.world_size * n)
    return out


def _param_groups(
    optimizer: torch.optim.Optimizer, shards: ShardedState
) -> list[dict[str, object]]:
    """The optimizer's param groups: their hyper-parameters, and the names of the parameters
    each holds (``param_names``; an export to another layout needs the grouping)."""
    names = {id(slot.tensor): slot.placement.name for slot in shards.optimizer}
    out: list[dict[str, object]] = []
    for g in optimizer.param_groups:
        held = dict.fromkeys(names[id(p)] for p in g["params"] if id(p) in names)
        out.append({**{k: v for k, v in g.items() if k != "params"}, "param_names": list(held)})
    return out


def partial_window(engine: CheckpointedEngine) -> int:
    """The micro-batches of an unfinished accumulation window a save leaves out (0: none)."""
    return int(engine.checkpoint_partial_window())


def warn_partial_window(where: Path, dropped: int, saving: bool) -> None:
    """[Note: a save inside an accumulation window] A checkpoint holds no gradients (as in
    DeepSpeed), so the micro-batches accumulated since the last optimizer step are not in
    it: a job resumed from it finishes that window without them, and its weights differ from
    an uninterrupted run's. Said when saving and again when loading."""
    if not dropped:
        return
    what = "saving" if saving else "loaded"
    warnings.warn(
        f"{where}: {what} a checkpoint {dropped} micro-batch(es) into a gradient accumulation "
        "window: their accumulated gradients are not in it, so a resumed job finishes the "
        "window without them and differs from an uninterrupted run. Save right after the "
        "optimizer step (checkpoint.save_interval does) to resume exactly",
        CheckpointWarning,
        stacklevel=4,
    )


def _layout(shards: ShardedState) -> Layout:
    return {
        "format": FORMAT,
        "stage": shards.stage,
        "world_size": shards.world_size,
        "tensor_parallel": shards.tp_degree,
    }


def _rng_state() -> RngState:
    state: RngState = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def collect_state(
    engine: CheckpointedEngine, client_state: object = None, include_optimizer: bool = True
) -> RankState:
    """What this rank saves (views of the live storage) and the ``ds_strategy.json`` record."""
    shards = engine.checkpoint_shards()
    comm = engine.checkpoint_comm
    entries = weight_entries(shards)
    if include_optimizer:
        entries.update(optimizer_entries(shards, engine.optimizer))
        entries.update(extra_entries(shards, comm))
    if comm.rank != 0 and shards.replicas_from_rank0:
        # the replicas drift apart between synchronisations: rank 0 writes its whole copy
        # (weights with their accumulators), never a mix of the ranks' copies
        dropped = ("model", *OPTIMIZER_KINDS)
        entries = {k: v for k, v in entries.items() if k.kind not in dropped}
    singles: dict[str, torch.Tensor] = {}
    if comm.rank == 0:  # the same on every rank (client_state: rank 0's, as in DeepSpeed)
        if include_optimizer:
            singles[OPTIMIZER_GROUPS] = pack(_param_groups(engine.optimizer, shards))
        # counters, lr scheduler and loss scaler: engine.restore_checkpoint_state takes them back,
        # and the resolved config, which an export to DeepSpeed's layout writes as its ds_config
        config = engine.config
        if config.comet.api_key is not None:  # a credential stays out of checkpoint files
            config = config.replace(**{"comet.api_key": None})
        # records.EngineRecord: the layout, the engine's checkpoint_state() and the config
        state = {**_layout(shards), **engine.checkpoint_state(), "config": config.to_dict()}
        singles[ENGINE] = pack(state)
        singles[CLIENT_STATE] = pack(client_state)
    singles[rng_key(comm.rank)] = pack(_rng_state())
    meta: CheckpointMeta = {
        **_layout(shards),
        "global_steps": engine.global_steps,
        "shapes": {name: list(shape) for name, shape in shards.shapes.items()},
        "optimizer": include_optimizer,
    }
    if include_optimizer:
        meta["optimizer_class"] = optimizer_class(engine.optimizer)
    window = partial_window(engine)
    if window:
        meta["partial_window"] = window
    return RankState(entries, singles, meta)
