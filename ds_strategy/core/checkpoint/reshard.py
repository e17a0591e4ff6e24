"""Loading a checkpoint into an engine of any world size, ZeRO stage, tensor-parallel split or
pipeline layout: each rank asks DCP for the pieces it now holds (its engine's records, views
of the live storage), and DCP reads whichever saved chunks overlap them. See [Note: loading
across layouts] in ``sharded.py``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, TensorStorageMetadata

from ..faults import together
from ..names import saved_name
from ..optim.lowbit import is_quantized
from . import swap
from .collect import extra_entries, extra_key, flat_piece, warn_partial_window, weight_entries
from .flat_piece import FlatPiece
from .keys import CLIENT_STATE, ENGINE, OPTIMIZER_GROUPS, OPTIMIZER_KINDS, EntryKey, rng_key
from .pinned import PinnedCheckpoint, pinned_sources
from .seam import CheckpointedEngine, OptimizerSlot, ShardedState
from .store import single_process_ok
from .streamed import StreamingLoadPlanner
from .trust import SafeReader, read_errors, unpack
from .validate import CheckpointError, check_optimizer_class, check_shapes_within, validate

__all__ = ["load_engine"]


@dataclass(frozen=True)
class Saved:
    """What the checkpoint directories hold: DCP's metadata of every entry by its name (an
    older save of a compiled model wrote ``_orig_mod.`` into names: dropped, ``core/names.py``),
    the directory each is read from (the first holding it), the name on disk of each entry
    renamed so, and the optimizer entries by parameter name, read once into records."""

    metadata: dict[str, STORAGE_TYPES]
    source: dict[str, int]
    optimizer: dict[str, list[EntryKey]]
    disk: dict[str, str]

    @staticmethod
    def of(metas: list[dict[str, STORAGE_TYPES]]) -> Saved:
        metadata: dict[str, STORAGE_TYPES] = {}
        source: dict[str, int] = {}
        disk: dict[str, str] = {}
        for i, md in enumerate(metas):
            for on_disk, value in md.items():
                entry = EntryKey.parse(on_disk)
                key = entry.under(saved_name(entry.param)).text if entry else on_disk
                if key not in metadata:
                    metadata[key], source[key] = value, i
                    if key != on_disk:
                        disk[key] = on_disk
        optimizer: dict[str, list[EntryKey]] = {}
        for key in metadata:
            entry = EntryKey.parse(key)
            if entry is not None and entry.kind in OPTIMIZER_KINDS:
                optimizer.setdefault(entry.param, []).append(entry)
        return Saved(metadata, source, optimizer, disk)

    def __contains__(self, key: EntryKey | str) -> bool:
        return (key.text if isinstance(key, EntryKey) else key) in self.metadata

    def tensor(self, key: str) -> TensorStorageMetadata:
        """DCP's metadata of the saved tensor ``key`` (every entry we save is one)."""
        md = self.metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"'{key}' is saved as bytes, not as a tensor")
        return md

    def resolve(self, key: EntryKey, aliases: dict[str, str]) -> EntryKey:
        """``key``, or the same entry under its parameter's alias when only that is saved (a
        weight a pipeline stage holds under its own layer's name, saved once under the whole
        model's first name)."""
        other = key.under(aliases.get(key.param, key.param))
        return other if key not in self and other in self else key

    def optimizer_of(self, name: str, aliases: dict[str, str]) -> list[EntryKey]:
        """A parameter's saved optimizer entries, under its name or else under its alias."""
        return self.optimizer.get(name) or self.optimizer.get(aliases.get(name, name), [])


@dataclass(frozen=True)
class OptimizerEntry:
    """A saved optimizer entry and the slot it belongs to on this rank."""

    slot: OptimizerSlot
    key: EntryKey


def load_engine(
    engine: CheckpointedEngine,
    paths: str | os.PathLike[str] | list[Path] | Callable[[], list[Path]],
    load_optimizer: bool = True,
    require_checksums: bool = True,
    trust_checkpoint: bool = False,
) -> object:
    """Restore ``engine`` from ``paths`` (any world size or stage); returns ``client_state``.

    ``paths``: one checkpoint directory, or several that together hold the model (a pipeline
    checkpoint's stages, see [Note: loading across layouts]), or a function naming them
    (asked again when a concurrent save replaces them while they are pinned, see
    ``pinned.py``). ``load_optimizer=False`` restores weights, buffers, counters and RNG only,
    into an engine whose optimizer may differ (e.g. one built just for evaluation)."""
    if callable(paths):
        resolve = paths
    else:
        given = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else list(paths)
        resolve = lambda: [swap.committed(Path(p)) for p in given]  # noqa: E731
    comm = engine.checkpoint_comm
    with pinned_sources(comm, resolve, require_checksums) as pins:
        return _load_pinned(engine, pins, load_optimizer, require_checksums, trust_checkpoint)


def _load_pinned(
    engine: CheckpointedEngine,
    pins: list[PinnedCheckpoint],
    load_optimizer: bool,
    require_checksums: bool,
    trust_checkpoint: bool,
) -> object:
    dirs = [p.path for p in pins]
    comm, aliases = engine.checkpoint_comm, engine.checkpoint_aliases
    shards = engine.checkpoint_shards()
    saved = _saved_entries(engine, shards, pins, require_checksums)
    path = dirs[0] if len(dirs) == 1 else dirs[0].parent
    rng = rng_key(comm.rank)
    packed = [ENGINE, CLIENT_STATE] + ([OPTIMIZER_GROUPS] if load_optimizer else [])
    packed += [rng] if rng in saved else []
    installs: list[OptimizerEntry] = []
    with together(comm, CheckpointError):  # whatever one rank refuses, every rank does
        if load_optimizer and OPTIMIZER_GROUPS not in saved:
            raise ValueError(
                f"{path}: this checkpoint was saved without optimizer state "
                "(include_optimizer=False); load it with load_optimizer=False"
            )
        state: dict[str, torch.Tensor | None] = {
            saved.resolve(k, aliases).text: v for k, v in weight_entries(shards).items()
        }
        after_extra: Callable[[], None] = _loaded_as_is
        if load_optimizer:
            optimizer, installs = _optimizer_destinations(engine, shards, saved)
            state.update(optimizer)
            extra, after_extra = _extra_destinations(engine, shards, saved)
            state.update(extra)
        for key in packed:
            state[key] = (
                torch.empty(saved.tensor(key).size, dtype=torch.uint8) if key in saved else None
            )
        missing = [k for k in state if k not in saved]
        if missing:
            raise ValueError(
                f"{path}: checkpoint does not match this model: {len(missing)} entr"
                f"{'y is' if len(missing) == 1 else 'ies are'} missing, e.g. {missing[:3]}"
            )
        _check_buffers(shards, saved, path)
        if load_optimizer:
            check_optimizer_class(pins[0].meta.get("optimizer_class"), engine.optimizer, path)
    _read_dirs(engine, pins, state, saved)
    # an untrusted object on one rank (its own RNG entry, say) fails every rank
    with together(comm, CheckpointError):
        objects: dict[str, object] = {}
        for key in packed:
            packed_tensor = state[key]
            assert packed_tensor is not None  # (a missing entry was refused above)
            objects[key] = unpack(packed_tensor, f"{path}: '{key}'", trust_checkpoint)
        if load_optimizer:
            _install_optimizer_state(
                engine, installs, state, objects[OPTIMIZER_GROUPS], path, trust_checkpoint
            )
            after_extra()
        _restore_engine(engine, objects, rng, load_optimizer, path)
    engine.checkpoint_loaded()
    if comm.rank == 0:
        warn_partial_window(path, int(pins[0].meta.get("partial_window", 0)), saving=False)
    return objects[CLIENT_STATE]


def _saved_entries(
    engine: CheckpointedEngine,
    shards: ShardedState,
    pins: list[PinnedCheckpoint],
    require_checksums: bool,
) -> Saved:
    """Every entry the checkpoint directories hold (checked against this model first); a
    pipeline stage's random state comes from its own stage's directory."""
    comm, aliases = engine.checkpoint_comm, engine.checkpoint_aliases
    strict = len(pins) == 1 and not engine.checkpoint_partial  # this model, no more, no less
    live_shapes = {name: list(shape) for name, shape in shards.shapes.items()}
    metas = [validate(p, comm, live_shapes if strict else None, require_checksums) for p in pins]
    if not strict:
        with together(comm, CheckpointError):
            check_shapes_within(pins, live_shapes, aliases)
    saved = Saved.of(metas)
    rng = rng_key(comm.rank)
    home = engine.checkpoint_stage
    if home is not None and home < len(metas) and rng in metas[home]:
        saved.metadata[rng], saved.source[rng] = metas[home][rng], home
    return saved


def _check_buffers(shards: ShardedState, saved: Saved, path: Path) -> None:
    """Every buffer saved with this model's shape (the weights' are checked with the
    metadata): DCP would otherwise fail mid-read."""
    for name, t in shards.buffers.items():
        md = saved.metadata.get(EntryKey("buffer", name).text)
        size = getattr(md, "size", None)
        if size is not None and list(size) != list(t.shape):
            raise CheckpointError(
                f"{path}: buffer '{name}' has shape {list(size)} in the checkpoint, "
                f"{list(t.shape)} in this model; build the model that was saved (same "
                "architecture and sizes)"
            )


def _read_dirs(
    engine: CheckpointedEngine,
    pins: list[PinnedCheckpoint],
    state: dict[str, torch.Tensor | None],
    saved: Saved,
) -> None:
    """Fill ``state`` in place from the pinned directories, each entry under its name on
    disk; every rank reads every directory, in the same order (DCP's reads are collective)."""
    comm = engine.checkpoint_comm
    named = {on_disk: key for key, on_disk in saved.disk.items()}
    for i, pinned in enumerate(pins):
        part = {saved.disk.get(k, k): v for k, v in state.items() if saved.source[k] == i}
        files = engine.checkpoint_io  # state in swap files is written there in place
        planner = StreamingLoadPlanner(files, comm.rank) if files is not None else None
        with single_process_ok(comm.active), read_errors(pinned.path):
            dcp.load(
                part,
                storage_reader=SafeReader(pinned.path, pinned=pinned),
                planner=planner,
                process_group=comm.group,
                no_dist=not comm.active,
            )
        if planner is not None:
            planner.done()
        state.update({named.get(k, k): v for k, v in part.items()})


def _optimizer_destinations(
    engine: CheckpointedEngine, shards: ShardedState, saved: Saved
) -> tuple[dict[str, torch.Tensor], list[OptimizerEntry]]:
    """Tensors to load the optimizer state into: this rank's pieces of per-element state
    (created if the optimizer has not stepped yet) and placeholders for the rest, which
    :func:`_install_optimizer_state` puts in place once read."""
    opt, files = engine.optimizer, engine.checkpoint_io
    out: dict[str, torch.Tensor] = {}
    installs = []
    for i, slot in enumerate(shards.optimizer):
        for key in saved.optimizer_of(slot.placement.name, engine.checkpoint_aliases):
            md = saved.tensor(key.text)
            if key.kind != "optim":
                out[key.text] = torch.empty(md.size, dtype=md.properties.dtype)
                installs.append(OptimizerEntry(slot, key))
                continue
            st = opt.state[slot.tensor]
            if is_quantized(st.get(key.state)):  # read plain, quantized again after the load
                del st[key.state]
            if key.state not in st:  # with NVMe offload: made out in a swap file, not in memory
                # in the dtype the optimizer makes it in (the saved one is converted on the
                # way in): a bf16 checkpoint's state loads as fp32 into an fp32 optimizer
                dtype = slot.tensor.dtype
                st[key.state] = (
                    files.new_state(i, key.state, slot.tensor, dtype)
                    if files is not None
                    else torch.zeros_like(slot.tensor, dtype=dtype)
                )
            out[key.text] = flat_piece(slot.placement, st[key.state].view(-1))
    return out, installs


def _install_optimizer_state(
    engine: CheckpointedEngine,
    installs: list[OptimizerEntry],
    state: Mapping[str, torch.Tensor | None],
    groups: object,
    path: Path,
    trust: bool,
) -> None:
    """Put the optimizer's other state and its param groups' hyper-parameters in place.

    Args:
        engine: the engine loaded into.
        installs: the entries read into placeholders (scalars and packed objects).
        state: every entry as read, by name.
        groups: the saved param groups, unpacked.
        path: the checkpoint, for messages.
        trust: unpickle objects other than tensors and plain data.
    """
    opt = engine.optimizer
    for entry in installs:
        value: object = state[entry.key.text]
        if entry.key.kind == "optim_obj":
            assert isinstance(value, torch.Tensor)
            value = unpack(value, f"{path}: optimizer state", trust)
        opt.state[entry.slot.tensor][entry.key.state] = value
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{path}: '{OPTIMIZER_GROUPS}' is not a list of param groups")
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"checkpoint has {len(groups)} optimizer param groups, this optimizer has "
            f"{len(opt.param_groups)}; build the optimizer with the same param groups"
        )
    for live, saved in zip(opt.param_groups, groups, strict=True):
        live.update({k: v for k, v in dict(saved).items() if k != "param_names"})


def _loaded_as_is() -> None:
    """Nothing to do after loading: the entries went straight into place."""


def _extra_destinations(
    engine: CheckpointedEngine, shards: ShardedState, saved: Saved
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """What to load the residuals into, and what to do once loaded: nothing when the
    checkpoint has none (a dense run's: the residuals start at zero) or the same world size;
    the mean over the saved ranks' rows otherwise (see [Note: compression residuals in a
    checkpoint] in ``collect.py``)."""
    comm = engine.checkpoint_comm
    held = [x for x in shards.extra if extra_key(x) in saved]
    if not held:
        return {}, _loaded_as_is
    first = held[0]
    saved_world = saved.tensor(extra_key(first).text).size.numel() // first.tensor.numel()
    if saved_world == comm.world_size:
        return {k.text: v for k, v in extra_entries(shards, comm).items()}, _loaded_as_is
    rows = {extra_key(x).text: torch.empty(saved_world * x.tensor.numel()) for x in held}

    def average() -> None:
        for x in held:
            n = x.tensor.numel()
            x.tensor.copy_(rows[extra_key(x).text].view(saved_world, n).mean(0))

    return {k: FlatPiece(t, 0, t.numel()) for k, t in rows.items()}, average


def _restore_engine(
    engine: CheckpointedEngine,
    objects: dict[str, object],
    rng: str,
    with_optimizer: bool,
    path: Path,
) -> None:
    record, rng_state = objects[ENGINE], objects.get(rng)
    if not isinstance(record, dict) or not isinstance(rng_state, (dict, type(None))):
        raise CheckpointError(f"{path}: '{ENGINE}' or '{rng}' is not a record of this library")
    # the lr schedule belongs to the optimizer it drives
    engine.restore_checkpoint_state(record, lr_scheduler=with_optimizer)
    if rng_state is not None:
        torch.set_rng_state(rng_state["torch"])
        random.setstate(rng_state["python"])
        if "cuda" in rng_state and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng_state["cuda"])
