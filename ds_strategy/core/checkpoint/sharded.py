"""Sharded save and load of an engine's whole training state through
``torch.distributed.checkpoint``: every rank writes its own pieces in parallel, and a load
into another world size or ZeRO stage reads the pieces it now owns (see ``flat_piece.py``).

Keys in the checkpoint (``<p>`` is the parameter's name in ``model.named_parameters()``):

- ``model/<p>``: the flattened parameter, as 1-D chunks from whichever ranks own them;
- ``buffer/<b>``: persistent buffers (replicated);
- ``optim/<p>/<k>``: optimizer state with one value per element (Adam's moments, momentum),
  chunked like the parameter; ``optim_scalar/<p>/<k>``: other tensors (Adam's ``step``);
  ``optim_obj/<p>/<k>``: non-tensor state, as ``trust.pack`` writes it;
- ``optim_groups``, ``engine``, ``client_state``: hyper-parameters, counters and lr-scheduler
  state, the caller's ``client_state``; ``rng/<rank>``: each rank's random state.

[Note: loading across layouts]
A pipeline saves one checkpoint per stage (``<root>/stage_<k>``), each holding its layers
under their index in the whole ``nn.Sequential``. A load may read several directories: every
key is taken from the first directory holding it (one DCP load per directory, in the same
order on every rank, each rank asking only for its own pieces), so a pipeline of another
number of stages, or a plain engine, finds its parameters wherever they were saved. A
pipeline stage's engine holds part of the model (``checkpoint_partial``): the checkpoint may
hold other layers too, only its own must be there. A weight tied across stages is saved by
each stage under its own layer's name, and by a plain engine once, under the whole model's
first name; a stage reads it under that name when its own is missing
(``checkpoint_aliases``). The counters and ``client_state`` come from the first directory;
a stage's random state from its own stage's, when the layouts match.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ..collectives import Comm
from ..compression.topk_reduce import TopKReduction
from ..compression.zeroone_reduce import ZeroOneReduction
from ..faults import together
from ..memory import human_bytes
from ..offload.streaming import SwapFiles
from . import swap
from .flat_piece import FlatPiece
from .keys import OPTIMIZER_KINDS, EntryKey
from .seam import CheckpointedEngine
from .streamed import StreamingLoadPlanner, StreamingSavePlanner
from .trust import SafeReader
from .trust import pack as _pack
from .trust import unpack as _unpack
from .validate import (
    FORMAT,
    CheckpointError,
    check_shapes_within,
    merge_checksums,
    record_checksums,
    validate,
)

__all__ = ["CheckpointWriteError", "FORMAT", "commit", "load_engine", "write"]


@contextlib.contextmanager
def single_process_ok(distributed: bool) -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists; for a world
    of one that is exactly the intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to", category=UserWarning
            )
        yield


def _names(engine: CheckpointedEngine) -> dict[int, str]:
    """Each parameter's name in the checkpoint: its name in the model, or, for this rank's
    part of a tensor-parallel weight, the original weight's."""
    tp = engine.tensor_parallel
    names: dict[int, str] = {}
    for name, p in engine.module.named_parameters():
        info = tp.params.get(id(p)) if tp is not None else None
        names.setdefault(id(p), info.name if info is not None else name)
    return names


def _piece(
    engine: CheckpointedEngine,
    p: torch.Tensor,
    local: torch.Tensor,
    start: int,
    numel: int,
    at: int = 0,
    length: int | None = None,
) -> FlatPiece:
    """Elements ``[start, start + length)`` of ``p`` flattened (``numel`` elements), held in
    ``local[at : at + length]`` (default: all of ``local``), placed in the checkpoint's
    flattened full tensor (a tensor-parallel part is several runs of it). No view is cut
    from ``local``, which may be out in a swap file (NVMe offload)."""
    length = local.numel() - at if length is None else length
    tp = engine.tensor_parallel
    info = tp.params.get(id(p)) if tp is not None else None
    if info is None:
        return FlatPiece(local, start, numel, runs=[(at, start, length)])
    runs = [(at + offset, s, n) for offset, s, n in info.full_runs(start, length)]
    return FlatPiece(local, start, info.numel, runs=runs)


def _model_entries(engine: CheckpointedEngine) -> dict[str, torch.Tensor]:
    """This rank's pieces of every parameter, as views of the live storage (so a load writes
    straight into the shards), plus the persistent buffers."""
    names = _names(engine)
    out: dict[str, torch.Tensor] = {}
    grouped: set[int] = set()
    for g in engine.plan.groups:
        grouped.update(id(p) for p in g.params)
        if not g.policy.shard_optimizer and g.master is None:  # stage 0: every rank saves all
            for i, p in enumerate(g.params):
                full = g.full_tensor(i).view(-1)
                out[EntryKey("model", names[id(p)]).text] = _piece(engine, p, full, 0, full.numel())
            continue
        flat = g.master if g.master is not None else g.shard  # fp32 masters when training mixed
        for pc in g.layout.pieces(g.rank):
            p, numel = g.params[pc.index], g.layout.slots[pc.index].numel
            out[EntryKey("model", names[id(p)]).text] = _piece(
                engine, p, flat, pc.param_start, numel, at=pc.shard_start, length=pc.length
            )
    for p in engine.module.parameters():
        if id(p) not in grouped:  # not sharded (frozen, or persistent and frozen): replicated
            key = EntryKey("model", names[id(p)]).text
            out[key] = _piece(engine, p, p.detach().view(-1), 0, p.numel())
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if not isinstance(t, nn.Parameter) and torch.is_tensor(t):
            out[EntryKey("buffer", name).text] = t.detach()
    return out


def _param_shapes(engine: CheckpointedEngine) -> dict[str, list[int]]:
    """Each parameter's real shape (saved flattened; sharded ones are empty between uses)."""
    names = _names(engine)
    shapes = {names[id(p)]: list(p.shape) for p in engine.module.parameters()}
    for g in engine.plan.groups:
        for p, shape in zip(g.params, g.shapes, strict=True):
            shapes[names[id(p)]] = list(shape)
    tp = engine.tensor_parallel
    for info in tp.params.values() if tp is not None else ():
        shapes[info.name] = list(info.shape)  # the full weight's, not this rank's part
    return shapes


def _pieces(engine: CheckpointedEngine) -> Iterator[tuple[Any, str, torch.Tensor, int]]:
    """(piece, parameter name, parameter, its numel) for every optimizer piece on this rank."""
    names = _names(engine)
    for pc in engine.optimizer_pieces:
        p = pc.group.params[pc.index]
        yield pc, names[id(p)], p, pc.group.layout.slots[pc.index].numel


def _optim_entries(engine: CheckpointedEngine) -> dict[str, Any]:
    opt = engine.optimizer
    out: dict[str, Any] = {}
    for pc, name, p, numel in _pieces(engine):
        for k, v in opt.state.get(pc.tensor, {}).items():
            if torch.is_tensor(v) and v.shape == pc.tensor.shape:
                key = EntryKey("optim", name, k).text
                out[key] = _piece(engine, p, v.view(-1), pc.start, numel)
            elif torch.is_tensor(v):  # identical on every owner of the parameter: DCP keeps one
                out[EntryKey("optim_scalar", name, k).text] = v
            else:
                out[EntryKey("optim_obj", name, k).text] = _pack(v)
    return out


def _compression_slots(engine: CheckpointedEngine) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(checkpoint key, this rank's view, numel) of every compression buffer (top-k residual,
    momentum-correction velocity) of every parameter."""
    comp = engine.compression
    if not isinstance(comp, TopKReduction):  # the 1-bit errors restart at a load (DeepSpeed's)
        return
    names = _names(engine)
    for g, st in zip(comp.groups, comp.states, strict=True):
        for kind, buf in st.state_dict().items():
            for p, slot in zip(g.params, g.layout.slots, strict=True):
                view = buf[slot.offset : slot.offset + slot.numel]
                yield EntryKey("compression", names[id(p)], kind).text, view, slot.numel


def _compression_entries(engine: CheckpointedEngine) -> dict[str, FlatPiece]:
    """[Note: compression residuals in a checkpoint]
    Each rank's residual is its own (what it has not sent yet), so a parameter's residuals are
    saved as one tensor of ``world x numel`` elements, rank ``r`` writing row ``r``. Loaded at
    the same world size, each rank reads its own row back; at another, each rank reads every
    row and takes their mean: the new ranks then owe, on average, what the old ranks owed (the
    averaged update still to come is conserved)."""
    comm = engine.checkpoint_comm
    return {
        key: FlatPiece(view, comm.rank * n, comm.world_size * n)
        for key, view, n in _compression_slots(engine)
    }


def _loaded_as_is(state: dict[str, Any]) -> None:
    """Nothing to do after loading: the entries went straight into place."""


def _compression_destinations(
    engine: CheckpointedEngine, saved: dict[str, Any]
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """What to load the residuals into, and what to do once loaded: nothing when the
    checkpoint has none (a dense run's: the residuals start at zero) or the same world size;
    the mean over the saved ranks' rows otherwise."""
    comm = engine.checkpoint_comm
    slots = [(k, v, n) for k, v, n in _compression_slots(engine) if k in saved]
    if not slots:
        return {}, _loaded_as_is
    saved_world = saved[slots[0][0]].size.numel() // slots[0][2]
    if saved_world == comm.world_size:
        return dict(_compression_entries(engine)), _loaded_as_is
    rows = {k: torch.empty(saved_world * n) for k, _, n in slots}

    def average(state: dict[str, Any]) -> None:
        for key, view, n in slots:
            view.copy_(rows[key].view(saved_world, n).mean(0))

    return {k: FlatPiece(t, 0, t.numel()) for k, t in rows.items()}, average


def _engine_entry(engine: CheckpointedEngine) -> dict[str, Any]:
    # counters, lr scheduler and loss scaler: engine.restore_checkpoint_state takes them back
    return {
        "format": FORMAT,
        "stage": engine.stage,
        "world_size": engine.world_size,
        "tensor_parallel": engine.mesh.tp,
        **engine.checkpoint_state(),
    }


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def collect_state(
    engine: CheckpointedEngine, client_state: Any = None, include_optimizer: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What this rank saves (views of the live storage) and the ``ds_strategy.json`` record."""
    engine.plan.wait_params()
    rank = engine.checkpoint_comm.rank
    state: dict[str, Any] = dict(_model_entries(engine))
    if include_optimizer:
        state.update(_optim_entries(engine))
        state.update(_compression_entries(engine))
    if rank != 0 and isinstance(engine.compression, ZeroOneReduction):
        # 0/1 Adam's local steps move the stage-0 replicas apart between syncs: rank 0 writes
        # its whole copy (weights with their accumulators), never a mix of the ranks' copies
        replicas = ("model", *OPTIMIZER_KINDS)
        state = {k: v for k, v in state.items() if _kind(k) not in replicas}
    if rank == 0:  # the same on every rank (client_state: rank 0's, as in DeepSpeed)
        if include_optimizer:
            groups = [
                {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
            ]
            state["optim_groups"] = _pack(groups)
        state["engine"] = _pack(_engine_entry(engine))
        state["client_state"] = _pack(client_state)
    state[f"rng/{rank}"] = _pack(_rng_state())
    meta = {
        "format": FORMAT,
        "stage": engine.stage,
        "world_size": engine.world_size,
        "tensor_parallel": engine.mesh.tp,
        "global_steps": engine.global_steps,
        "shapes": _param_shapes(engine),
        "optimizer": include_optimizer,
    }
    return state, meta


def fresh_tmp(final: Path) -> Path:
    """Rank 0, before a save: an empty ``<final>.tmp`` for every rank to write into."""
    tmp = swap.tmp_dir(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def total_bytes(comm: Comm, state: dict[str, Any]) -> int:
    """What every rank's ``state`` takes together: the size of the checkpoint to write."""
    mine = 0
    for v in state.values():
        if isinstance(v, FlatPiece):
            mine += v.piece_nbytes
        elif torch.is_tensor(v):
            mine += v.numel() * v.element_size()
    total = torch.tensor([mine], dtype=torch.int64)
    comm.all_reduce(total, kind="control")
    return int(total.item())


def write(
    state: dict[str, Any],
    tmp: Path,
    comm: Comm,
    final: Path,
    needed: int,
    swap_files: SwapFiles | None = None,
) -> None:
    """Every rank writes its pieces into ``tmp`` (DCP names them ``__<rank>_<n>.distcp``).
    DCP gathers every rank's outcome, so a failure raises on all of them, here translated to
    one line saying what happened and where (:class:`CheckpointWriteError`). With
    ``swap_files`` the pieces out in swap files are read from them one at a time."""
    failures = (Exception, CheckpointException)  # DCP's is a BaseException
    planner = StreamingSavePlanner(swap_files, comm.rank) if swap_files is not None else None
    # the serial writer: it asks for a piece only once the one before is written
    writer = FileSystemWriter(tmp, per_thread_copy_ahead=0 if planner else 10_000_000)
    with _as_write_error(tmp, final, needed, comm.rank, failures), single_process_ok(comm.active):
        try:
            dcp.save(
                state,
                storage_writer=writer,
                planner=planner,
                process_group=comm.group,
                no_dist=not comm.active,
            )
        finally:
            if planner is not None:
                planner.done()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the previous checkpoint and ``latest`` are
    unchanged); ``errno`` is the underlying error's, when there was one."""


CheckpointWriteError.__module__ = "ds_strategy"


def write_error(
    e: BaseException, tmp: Path, final: Path, needed: int, rank: int
) -> CheckpointWriteError:
    """One line saying what happened and where; DCP's gathered failures are unwrapped to the
    first failing rank's."""
    rank, cause = _first_failure(e, rank)
    os_error = _os_error(cause)
    errno_ = os_error.errno if os_error is not None else None
    if errno_ is None and _does_not_fit(tmp, needed):
        # torch.save reports a failed write of its zip writer as "unexpected pos": a full
        # disk, when what is left to write no longer fits
        errno_ = errno.ENOSPC
    where = getattr(os_error, "filename", None) or tmp
    unchanged = f"the previous checkpoint at {final} (if any) and latest are unchanged"
    if errno_ == errno.ENOSPC:
        try:
            free = f"{human_bytes(shutil.disk_usage(tmp.parent).free)} free there"
        except OSError:
            free = "free space unknown"
        message = (
            f"no space left on device writing {where}: needed {needed} bytes "
            f"({human_bytes(needed)}) for this checkpoint, {free}; free some space or save "
            f"elsewhere ({unchanged})"
        )
    elif errno_:
        message = (
            f"{os.strerror(errno_).lower()} writing {where} (rank {rank}): {cause}; {unchanged}"
        )
    else:
        message = (
            f"checkpoint save to {final} failed on rank {rank}: {type(cause).__name__}: "
            f"{cause}; {unchanged}"
        )
    out = CheckpointWriteError(message)
    out.errno = errno_
    return out


def _os_error(e: BaseException | None) -> OSError | None:
    """``e`` or the first error it was raised from that carries an ``errno``."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _does_not_fit(tmp: Path, needed: int) -> bool:
    try:
        written = sum(f.stat().st_size for f in tmp.iterdir()) if tmp.is_dir() else 0
        return shutil.disk_usage(tmp.parent).free < needed - written
    except OSError:
        return False


def _first_failure(e: BaseException, rank: int) -> tuple[int, BaseException]:
    """(rank, exception) of the first failing rank in DCP's gathered failures."""
    if isinstance(e, CheckpointException) and e.failures:
        first = min(e.failures)
        cause = e.failures[first]
        return first, cause[0] if isinstance(cause, tuple) else cause
    return rank, e


def commit(
    comm: Comm,
    tmp: Path,
    final: Path,
    meta: dict[str, Any],
    needed: int,
    after_rename: Callable[[], None] | None = None,
) -> None:
    """Every rank records its files' sizes and checksums; once all have, rank 0 writes
    ``ds_strategy.json``, puts ``tmp`` in place of ``final`` (``swap.put_in_place``) and runs
    ``after_rename`` (the ``latest`` pointer, pruning), and the ranks leave together."""
    # the agreement doubles as the barrier: a rank that failed (a full disk) makes every rank
    # raise instead of leaving the others waiting for it
    with together(comm, CheckpointError), _as_write_error(tmp, final, needed, comm.rank):
        record_checksums(tmp, comm.rank)
    with together(comm, CheckpointError), _as_write_error(tmp, final, needed, comm.rank):
        if comm.rank == 0:
            meta = dict(meta, files=merge_checksums(tmp))
            swap.put_in_place(tmp, final, json.dumps(meta, indent=2))
            if after_rename is not None:
                after_rename()


@contextlib.contextmanager
def _as_write_error(
    tmp: Path,
    final: Path,
    needed: int,
    rank: int,
    failures: tuple[type[BaseException], ...] = (OSError,),
) -> Iterator[None]:
    """``failures`` raised in the block become one :class:`CheckpointWriteError`."""
    try:
        yield
    except failures as e:
        raise write_error(e, tmp, final, needed, rank) from e


def load_engine(
    engine: CheckpointedEngine,
    paths: str | os.PathLike | list[Path],
    load_optimizer: bool = True,
    require_checksums: bool = True,
    trust_checkpoint: bool = False,
) -> Any:
    """Restore ``engine`` from ``paths`` (any world size or stage); returns ``client_state``.

    ``paths``: one checkpoint directory, or several that together hold the model (a pipeline
    checkpoint's stages, see [Note: loading across layouts]). ``load_optimizer=False``
    restores weights, buffers, counters and RNG only, into an engine whose optimizer may
    differ (e.g. one built just for evaluation)."""
    dirs = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    comm, aliases = engine.checkpoint_comm, engine.checkpoint_aliases
    saved, source = _saved_entries(engine, dirs, require_checksums)
    path = dirs[0] if len(dirs) == 1 else dirs[0].parent
    rng_key = f"rng/{comm.rank}"
    packed = ["engine", "client_state"] + (["optim_groups"] if load_optimizer else [])
    packed += [rng_key] if rng_key in saved else []
    with together(comm, CheckpointError):  # whatever one rank refuses, every rank does
        if load_optimizer and "optim_groups" not in saved:
            raise ValueError(
                f"{path}: this checkpoint was saved without optimizer state "
                "(include_optimizer=False); load it with load_optimizer=False"
            )
        engine.plan.wait_params()
        state: dict[str, Any] = _aliased(dict(_model_entries(engine)), saved, aliases)
        after_compression = _loaded_as_is
        if load_optimizer:
            state.update(_optim_destinations(engine, saved))
            compression, after_compression = _compression_destinations(engine, saved)
            state.update(compression)
        for key in packed:
            md = saved.get(key)
            state[key] = torch.empty(md.size, dtype=torch.uint8) if md is not None else None
        missing = [k for k in state if k not in saved]
        if missing:
            raise ValueError(
                f"{path}: checkpoint does not match this model: {len(missing)} entr"
                f"{'y is' if len(missing) == 1 else 'ies are'} missing, e.g. {missing[:3]}"
            )
    _read_dirs(engine, dirs, state, source)
    # an untrusted object on one rank (its own RNG entry, say) fails every rank
    with together(comm, CheckpointError):
        for key in packed:
            state[key] = _unpack(state[key], f"{path}: '{key}'", trust_checkpoint)
        if load_optimizer:
            _install_optimizer_state(engine, state, path, trust_checkpoint)
            after_compression(state)
        _restore_engine(engine, state, rng_key, load_optimizer)
    engine.plan.after_load()
    return state["client_state"]


def _saved_entries(
    engine: CheckpointedEngine, dirs: list[Path], require_checksums: bool
) -> tuple[dict[str, Any], dict[str, int]]:
    """Every entry the checkpoint directories hold (checked against this model first), and
    the index of the first directory holding each; a pipeline stage's random state comes
    from its own stage's directory."""
    comm, aliases = engine.checkpoint_comm, engine.checkpoint_aliases
    strict = len(dirs) == 1 and not engine.checkpoint_partial  # this model, no more, no less
    live_shapes = _param_shapes(engine)
    metas = [validate(d, comm, live_shapes if strict else None, require_checksums) for d in dirs]
    if not strict:
        with together(comm, CheckpointError):
            check_shapes_within(dirs, live_shapes, aliases)
    saved: dict[str, Any] = {}
    source: dict[str, int] = {}  # key -> the first directory holding it
    for i, md in enumerate(metas):
        for key, value in md.items():
            if key not in saved:
                saved[key], source[key] = value, i
    rng_key = f"rng/{comm.rank}"
    home = engine.checkpoint_stage
    if home is not None and home < len(metas) and rng_key in metas[home]:
        saved[rng_key], source[rng_key] = metas[home][rng_key], home
    return saved, source


def _read_dirs(
    engine: CheckpointedEngine, dirs: list[Path], state: dict[str, Any], source: dict[str, int]
) -> None:
    """Fill ``state`` in place from the directories; every rank reads every directory, in
    the same order (DCP's reads are collective)."""
    comm = engine.checkpoint_comm
    for i, d in enumerate(dirs):
        part = {k: v for k, v in state.items() if source[k] == i}
        files = engine.checkpoint_io  # state in swap files is written there in place
        planner = StreamingLoadPlanner(files, comm.rank) if files is not None else None
        with single_process_ok(comm.active):
            dcp.load(
                part,
                storage_reader=SafeReader(d),
                planner=planner,
                process_group=comm.group,
                no_dist=not comm.active,
            )
        if planner is not None:
            planner.done()
        state.update(part)


def _aliased(
    entries: dict[str, torch.Tensor], saved: dict[str, Any], aliases: dict[str, str]
) -> dict[str, torch.Tensor]:
    """``entries`` with each parameter missing from ``saved`` under its name read from its
    alias instead (a weight a pipeline stage holds under its own layer's name, saved once
    under the whole model's first name)."""
    out = {}
    for key, t in entries.items():
        entry = EntryKey.parse(key)
        other = entry.under(aliases.get(entry.param, entry.param)).text if entry else key
        out[other if key not in saved and other in saved else key] = t
    return out


def _kind(key: str) -> str | None:
    entry = EntryKey.parse(key)
    return entry.kind if entry is not None else None


def _saved_optim_keys(saved: dict[str, Any]) -> dict[str, list[tuple[EntryKey, Any]]]:
    """Saved optimizer entries by parameter name: (its key, metadata or value)."""
    out: dict[str, list[tuple[EntryKey, Any]]] = {}
    for key, md in saved.items():
        entry = EntryKey.parse(key)
        if entry is not None and entry.kind in OPTIMIZER_KINDS:
            out.setdefault(entry.param, []).append((entry, md))
    return out


def _saved_for(
    by_name: dict[str, list[tuple[EntryKey, Any]]], name: str, aliases: dict[str, str]
) -> list[tuple[EntryKey, Any]]:
    """A parameter's saved optimizer entries, under its name or else under its alias."""
    return by_name.get(name) or by_name.get(aliases.get(name, name), [])


def _optim_destinations(engine: CheckpointedEngine, saved: dict[str, Any]) -> dict[str, Any]:
    """Tensors to load the optimizer state into: this rank's pieces of per-element state
    (created if the optimizer has not stepped yet) and placeholders for the rest."""
    opt = engine.optimizer
    by_name = _saved_optim_keys(saved)
    out: dict[str, Any] = {}
    files = engine.checkpoint_io
    for i, (pc, name, p, numel) in enumerate(_pieces(engine)):
        for entry, md in _saved_for(by_name, name, engine.checkpoint_aliases):
            key, k = entry.text, entry.state
            if entry.kind == "optim":
                st = opt.state[pc.tensor]
                if k not in st:  # with NVMe offload: made out in a swap file, not in memory
                    dtype = md.properties.dtype
                    st[k] = (
                        files.new_state(i, k, pc.tensor, dtype)
                        if files is not None
                        else torch.zeros_like(pc.tensor, dtype=dtype)
                    )
                out[key] = _piece(engine, p, st[k].view(-1), pc.start, numel)
            else:
                out[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return out


def _install_optimizer_state(
    engine: CheckpointedEngine, state: dict[str, Any], path: Path, trust: bool
) -> None:
    opt = engine.optimizer
    by_name = _saved_optim_keys(state)
    for pc, name, _, _ in _pieces(engine):
        for entry, value in _saved_for(by_name, name, engine.checkpoint_aliases):
            if entry.kind == "optim_scalar":
                opt.state[pc.tensor][entry.state] = value
            elif entry.kind == "optim_obj":
                opt.state[pc.tensor][entry.state] = _unpack(
                    value, f"{path}: optimizer state", trust
                )
    groups = state["optim_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"checkpoint has {len(groups)} optimizer param groups, this optimizer has "
            f"{len(opt.param_groups)}; build the optimizer with the same param groups"
        )
    for live, saved in zip(opt.param_groups, groups, strict=True):
        live.update(saved)


def _restore_engine(
    engine: CheckpointedEngine, state: dict[str, Any], rng_key: str, with_optimizer: bool
) -> None:
    # the lr schedule belongs to the optimizer it drives
    engine.restore_checkpoint_state(state["engine"], lr_scheduler=with_optimizer)
    rng = state.get(rng_key)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
