"""Turn a sharded checkpoint, ours or DeepSpeed's, into the weights file(s) the plain model
loads with ``load_state_dict``: one file, or Hugging Face's shards and index.

[Note: bounded memory]
The output is written tensor by tensor: each parameter is read from the checkpoint (ours:
through DCP, only the chunks of that one tensor; DeepSpeed's: from its memory-mapped
partitions, ``deepspeed/weights.py``), converted, written and dropped, so peak memory is about
two copies of the largest single tensor (the pieces read, then the tensor they fill; one more
for a dtype conversion), never the whole model. A ``.safetensors`` file is written by hand in
its documented layout (an 8-byte little-endian header length, a JSON header of dtypes, shapes
and byte offsets, then the raw tensors back to back), which is what allows streaming. A ``.pt``
file is one pickle that ``torch.save`` writes from a dict of tensors, so it is built in memory:
its peak is the whole model's weights, or one shard's under ``max_shard_size``. Prefer
``.safetensors`` for large models (``benchmarks/bench_consolidate.py`` measures both).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..names import saved_name
from ..progress import Progress
from .deepspeed.layout import find_deepspeed
from .deepspeed.opening import open_deepspeed
from .deepspeed.weights import DeepSpeedWeights
from .keys import CLIENT_STATE, MODEL_KINDS, OPTIMIZER_KINDS, EntryKey
from .manager import resolve_sources
from .pinned import PinnedCheckpoint, pinned_sources
from .store import single_process_ok
from .trust import SafeReader, UntrustedContentError, read_errors, unpack
from .validate import META_FILE, CheckpointError, check_files
from .weights_file import Output, check_room
from .weights_shards import WeightEntry, parse_size, write_weight_files

__all__ = ["LIGHTNING_VERSION", "consolidate", "consolidated_state"]

# the entry Lightning's Trainer writes into every checkpoint it saves (under ours: in the
# client_state); a Lightning checkpoint is told apart by it
LIGHTNING_VERSION = "pytorch-lightning_version"
_TORCH_SAVE = (".pt", ".pth", ".bin", ".ckpt")


def _entries(reader: SafeReader) -> dict[EntryKey, TensorStorageMetadata]:
    """The weights and buffers a checkpoint holds."""
    md = reader.read_metadata().state_dict_metadata
    out = {}
    for key, m in md.items():
        entry = EntryKey.parse(key)
        if entry is not None and entry.kind in MODEL_KINDS and isinstance(m, TensorStorageMetadata):
            out[entry] = m
    return out


def _by_name(entries: dict[EntryKey, TensorStorageMetadata]) -> list[EntryKey]:
    return sorted(entries, key=lambda entry: entry.text)


def _out_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and saved.is_floating_point else saved


class _OwnWeights:
    """A ds_strategy checkpoint's weights and buffers by name: each of ``sources``' entries
    that no earlier source holds, in name order, read one at a time through DCP from the
    pinned files (``pinned.py``)."""

    def __init__(
        self, sources: list[PinnedCheckpoint], dtype: torch.dtype | None, exclude_frozen: bool
    ) -> None:
        self.dtype = dtype
        self.entries: list[WeightEntry] = []
        self._where: dict[
            str, tuple[PinnedCheckpoint, EntryKey, TensorStorageMetadata, list[int]]
        ] = {}
        for src, owned in _owned(sources):
            shapes = src.meta.get("shapes") or {}
            frozen = _frozen(src) if exclude_frozen else set()
            for entry in _by_name(owned):
                if entry.kind == "model" and entry.param in frozen:
                    continue
                m = owned[entry]
                shape = shapes.get(entry.param, list(m.size))
                self._where[entry.param] = (src, entry, m, shape)
                out_dtype = _out_dtype(m.properties.dtype, dtype)
                self.entries.append(WeightEntry(entry.param, out_dtype, tuple(shape)))

    def read(self, name: str) -> torch.Tensor:
        src, entry, m, shape = self._where[name]
        t = torch.empty(m.size, dtype=m.properties.dtype)
        with single_process_ok(False):
            dcp.load({entry.text: t}, storage_reader=_reader(src), no_dist=True)
        return t.view(shape).to(_out_dtype(t.dtype, self.dtype))


def _reader(src: PinnedCheckpoint) -> SafeReader:
    return SafeReader(src.path, pinned=src)


def _frozen(src: PinnedCheckpoint) -> set[str]:
    """The parameters of ``src`` that did not train: weights without optimizer state."""
    fix = "export without exclude_frozen_parameters (--exclude-frozen-parameters)"
    if not src.meta.get("optimizer", True):
        raise CheckpointError(
            f"{src.path}: saved without optimizer state (include_optimizer=False), so the "
            f"checkpoint does not record which parameters were frozen; {fix}"
        )
    keys = [EntryKey.parse(k) for k in _reader(src).read_metadata().state_dict_metadata]
    weights = {k.param for k in keys if k is not None and k.kind == "model"}
    trained = {k.param for k in keys if k is not None and k.kind in OPTIMIZER_KINDS}
    if weights and not trained:
        raise CheckpointError(
            f"{src.path}: holds optimizer state for no parameter (saved before the first "
            "step, or by an optimizer that keeps none, such as SGD without momentum), so the "
            f"checkpoint does not record which parameters were frozen; {fix}"
        )
    return weights - trained


def _owned(
    sources: list[PinnedCheckpoint],
) -> list[tuple[PinnedCheckpoint, dict[EntryKey, TensorStorageMetadata]]]:
    """Each checkpoint's entries that no earlier one has (a pipeline's stages hold disjoint
    layers; only a weight tied across stages is in two of them, under two names)."""
    seen: set[EntryKey] = set()
    out = []
    for src in sources:
        entries = {k: m for k, m in _entries(_reader(src)).items() if k not in seen}
        seen.update(entries)
        out.append((src, entries))
    return out


def _own_sources(path: Path, tag: str | None) -> list[Path]:
    sources = resolve_sources(path, tag)
    for src in sources:
        if not (src / META_FILE).is_file():
            raise FileNotFoundError(_neither(path if tag is None else path / tag))
    return sources


def _neither(where: Path) -> str:
    return (
        f"checkpoint '{where}': neither a ds_strategy checkpoint (no {META_FILE} in it, nor "
        "in the directory a 'latest' file there names, nor a pipeline's stage_<k>) nor a "
        "DeepSpeed checkpoint (no mp_rank_00_model_states.pt or "
        "zero_pp_rank_<r>_mp_rank_00_model_states.pt in it, nor in the tag directory its "
        "'latest' names); give the directory save_checkpoint wrote or its root, and --tag / "
        "tag= for a tag other than the latest"
    )


def _output(output_path: str | os.PathLike) -> Path:
    out = Path(output_path)
    if out.suffix not in (".safetensors", *_TORCH_SAVE) or out.is_dir():
        raise ValueError(
            f"output {str(output_path)!r}: choose a .safetensors, .pt, .pth, .bin or .ckpt "
            "file name"
        )
    return out


def consolidate(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    dtype: torch.dtype | None = torch.float32,
    require_checksums: bool = True,
    *,
    tag: str | None = None,
    max_shard_size: int | str | None = None,
    exclude_frozen_parameters: bool = False,
    trust_checkpoint: bool = False,
    plain_weights: bool = False,
) -> Path:
    """Write a sharded checkpoint's weights to one ``.safetensors`` or ``.pt`` file.

    The checkpoint may be ours or DeepSpeed's. The output may also be shards of that file, as
    Hugging Face writes them. It runs in one process, with no process group, and without
    DeepSpeed installed. Any world size may have written the checkpoint.

    Our checkpoints: every file is first checked against the sizes and checksums recorded at
    save time. Tied weights appear once, under their first name.
    ``load_state_dict(strict=False)``, or re-tying after loading, restores the other name.

    DeepSpeed's: the file holds what DeepSpeed's ``zero_to_fp32.py`` gives. That is buffers,
    frozen and trained parameters, and each tied weight under every name. Its pickles load
    DeepSpeed's few classes as records. Any other object is refused unless
    ``trust_checkpoint=True``.

    Lightning's: a ``Trainer`` saved it under ``ZeroStrategy``. Written to one ``.ckpt``,
    ``.pt``, ``.pth`` or ``.bin`` file (no ``max_shard_size``), it becomes Lightning's own
    checkpoint file. ``LightningModule.load_from_checkpoint`` reads that file. It holds the
    Trainer's entries as saved: ``pytorch-lightning_version``, ``hyper_parameters``, loops,
    callbacks, and no optimizer state. The weights go under ``state_dict``, as Lightning's
    ``convert_zero_checkpoint_to_fp32_state_dict`` writes a DeepSpeed one. Those entries are
    read as plain data. Any other object in them needs ``trust_checkpoint=True``. Without it,
    the weights alone are written, with a warning.

    A long export logs its progress, tensors written so far, to the
    ``ds_strategy.core.progress`` logger (see ``core/progress.py``). ``DS_STRATEGY_PROGRESS=0``
    silences it.

    Args:
        checkpoint_dir: a checkpoint directory, or a checkpoint root (its ``latest``, or
            ``tag``). Or a pipeline checkpoint's root: its stages' layers together, as one
            model. Or DeepSpeed's save directory or tag directory. The content tells which.
        output_path: the file to write.
        dtype: converts floating-point tensors. ``None`` keeps the saved dtype. A DeepSpeed
            checkpoint's trained parameters are its fp32 master weights.
        require_checksums: refuse one of our checkpoints that records no checksums.
            ``False`` accepts it.
        tag: a tag under the root, other than the one its ``latest`` names.
        max_shard_size: bytes, or ``"5GB"``, ``"500MB"``, ``"10KB"``. It writes shards of at
            most that size, filled as ``transformers`` fills them. For
            ``out/model.safetensors`` they are ``out/model-00001-of-0000N.safetensors`` ...
            and ``out/model.safetensors.index.json``. A tensor larger than the limit gets a
            shard of its own. When everything fits in one shard, it is just ``output_path``.
        exclude_frozen_parameters: leave out the parameters that did not train. DeepSpeed's
            are its ``frozen_param_shapes``. Ours are the weights without optimizer state. A
            checkpoint saved without optimizer state does not record them, and is refused.
        trust_checkpoint: load pickled objects other than plain data (see above).
        plain_weights: for a Lightning checkpoint, write the weights alone
            (``{name: tensor}``) instead.

    Returns:
        The file written, or the index of the shards.

    Example:
        >>> ds_strategy.consolidate("ckpt/step100", "model.safetensors")  # doctest: +SKIP
        >>> ds_strategy.consolidate(  # doctest: +SKIP
        ...     "ds_run", "out/model.safetensors", tag="global_step500", max_shard_size="5GB"
        ... )
    """
    out = _output(output_path)
    if max_shard_size is not None:
        parse_size(max_shard_size)  # a bad size is refused before anything is read
    path = _checkpoint_dir(checkpoint_dir)
    tag_dir = find_deepspeed(path, tag)
    if tag_dir is not None:
        ckpt = open_deepspeed(tag_dir, trust_checkpoint)
        weights = DeepSpeedWeights(ckpt, dtype, exclude_frozen_parameters)
        return _write(path, weights, out, max_shard_size)
    # the files stay open while they are read: a job saving the tag again meanwhile changes
    # nothing this export reads
    with pinned_sources(None, lambda: _own_sources(path, tag), require_checksums) as pins:
        for src in pins:  # a damaged file is an error naming it, never a wrong export
            check_files(src, require_checksums)
        own = _OwnWeights(pins, dtype, exclude_frozen_parameters)
        lightning = None
        if not plain_weights and max_shard_size is None and out.suffix in _TORCH_SAVE:
            lightning = _lightning_entries(pins[0], trust_checkpoint)
        return _write(path, own, out, max_shard_size, lightning)


def consolidated_state(
    checkpoint_dir: str | os.PathLike,
    dtype: torch.dtype | None = torch.float32,
    *,
    tag: str | None = None,
    require_checksums: bool = True,
    trust_checkpoint: bool = False,
) -> tuple[dict[str, torch.Tensor], object]:
    """One of our checkpoints in memory: its weights and buffers by name, and the
    ``client_state`` it was saved with. Runs in this process alone, with no process group.

    Args:
        checkpoint_dir: a checkpoint directory, its root, or a pipeline checkpoint's root.
        dtype: converts floating-point tensors (None keeps the saved dtype).
        tag: a tag under the root other than the one its ``latest`` names.
        require_checksums: refuse a checkpoint that records no checksums.
        trust_checkpoint: unpickle objects in ``client_state`` other than plain data.

    Returns:
        ``(weights, client_state)``; ``client_state`` is None when the save passed none.

    Example::

        weights, client_state = consolidated_state("ckpt/step100")
        model.load_state_dict(weights)
    """
    path = _checkpoint_dir(checkpoint_dir)
    with pinned_sources(None, lambda: _own_sources(path, tag), require_checksums) as pins:
        for src in pins:  # a damaged file is an error naming it, never wrong weights
            check_files(src, require_checksums)
        own = _OwnWeights(pins, dtype, exclude_frozen=False)
        entries, saved_as = _model_names(own.entries)
        weights: dict[str, torch.Tensor] = {}
        for e in entries:
            known = e.source in weights
            weights[e.name] = weights[e.source] if known else own.read(saved_as[e.source])
        return weights, _client_state(pins[0], trust_checkpoint)


def _checkpoint_dir(checkpoint_dir: str | os.PathLike) -> Path:
    path = Path(checkpoint_dir).absolute()
    if not str(checkpoint_dir) or not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint {str(checkpoint_dir)!r}: no such directory (give one written by "
            "save_checkpoint, its root, a pipeline checkpoint's root, or a DeepSpeed "
            "checkpoint's save or tag directory)"
        )
    return path


def _client_state(src: PinnedCheckpoint, trusted: bool) -> object:
    """The ``client_state`` saved in ``src`` (of a pipeline's stages, or several engines'
    parts, the first holds it)."""
    md = _reader(src).read_metadata().state_dict_metadata.get(CLIENT_STATE)
    if not isinstance(md, TensorStorageMetadata):
        return None
    packed = torch.empty(md.size, dtype=torch.uint8)
    with single_process_ok(False), read_errors(src.path):
        dcp.load({CLIENT_STATE: packed}, storage_reader=_reader(src), no_dist=True)
    return unpack(packed, f"{src.path}: '{CLIENT_STATE}'", trusted)


def _lightning_entries(src: PinnedCheckpoint, trusted: bool) -> dict[str, object] | None:
    """The Lightning Trainer's entries of ``src`` but optimizer state (None: another
    saver's checkpoint, or entries that need trust to read, with a warning)."""
    try:
        state = _client_state(src, trusted)
    except UntrustedContentError as e:
        warnings.warn(
            f"{e}. Writing the weights alone; if a Lightning Trainer saved this checkpoint, "
            "trust_checkpoint=True (--trust-checkpoint) keeps its entries, for "
            "LightningModule.load_from_checkpoint",
            UserWarning,
            stacklevel=4,
        )
        return None
    if not isinstance(state, dict) or LIGHTNING_VERSION not in state:
        return None
    return {k: v for k, v in state.items() if k not in ("state_dict", "optimizer_states")}


def _write(
    path: Path,
    weights: DeepSpeedWeights | _OwnWeights,
    out: Path,
    max_shard_size: int | str | None,
    lightning: dict[str, object] | None = None,
) -> Path:
    # one process: it reports as rank 0 (core/progress.py)
    progress = Progress(f"consolidating {path.name}", len(weights.entries), 0, "tensors")
    entries, saved_as = _model_names(weights.entries)

    def read(name: str) -> torch.Tensor:
        t = weights.read(saved_as[name])
        progress.advance()
        return t

    if lightning is not None:
        written = [_write_lightning(out, entries, read, lightning)]
    else:
        written = write_weight_files(out, entries, read, max_shard_size)
    progress.done()
    return written[-1]


def _write_lightning(
    out: Path,
    entries: list[WeightEntry],
    read: Callable[[str], torch.Tensor],
    lightning: dict[str, object],
) -> Path:
    """Lightning's checkpoint file: its entries, the weights under ``state_dict``
    (atomically: ``weights_file.py``, [Note: a weights file is whole or absent])."""
    weights: dict[str, torch.Tensor] = {}
    for e in entries:
        weights[e.name] = weights[e.source] if e.source in weights else read(e.source)
    nbytes = sum(e.nbytes for e in entries if e.tied_to is None)
    check_room([(out, nbytes)])
    with Output(out, nbytes) as f:
        with f.failing(RuntimeError):  # torch.save's own error for a failed write
            torch.save({**lightning, "state_dict": weights}, f.tmp)
        f.commit()
    return out


def _model_names(entries: list[WeightEntry]) -> tuple[list[WeightEntry], dict[str, str]]:
    """The entries under the plain model's names (an older save of a compiled model recorded
    ``_orig_mod.`` in them: ``core/names.py``), and the saved name each is read under."""
    saved_as: dict[str, str] = {}
    out = []
    for e in entries:
        name = saved_name(e.name)
        if name not in saved_as:
            saved_as[name] = e.name
            tied = saved_name(e.tied_to) if e.tied_to is not None else None
            out.append(replace(e, name=name, tied_to=tied))
    return out, saved_as
