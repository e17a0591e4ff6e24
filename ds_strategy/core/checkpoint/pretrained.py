"""Pretrained weights into an engine's shards (``ZeroEngine.load_weights``), the counterpart of
DeepSpeed's ``zero.Init`` with ``from_pretrained``.

[Note: a pretrained load]
The engine's records (``seam.py``) say which elements of which flattened parameter each local
tensor holds; each run of them is read from the files straight into the live storage (or, with
NVMe offload, written into its swap file in place), so a rank reads the bytes of its own
shard and nothing else, one run at a time (``weights_source.py``). Persistent buffers are read
whole on every rank. The shards are then the engine's, so the derived copies are rebuilt as
after a checkpoint load (``checkpoint_loaded``). Names are matched as ``from_pretrained``
matches them: as they are, or across the model's ``base_model_prefix`` (a ``LlamaModel``
loading a ``LlamaForCausalLM`` file, or the reverse), and a tied weight under any of its names.

Buffers that no file holds and no initialisation computed (``materialize.py``'s unset
buffers) are refused by name: a rotary ``inv_freq`` left at zero trains silently wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..faults import together
from ..materialize import MARK, unset_buffers
from ..names import plain_names, unwrapped
from ..offload.streaming import SwapFiles
from .converted import add_converted_views
from .errors import CheckpointError
from .seam import CheckpointedEngine, Placement
from .weights_source import CHUNK, PretrainedFiles, open_weights

__all__ = ["LoadedWeights", "load_pretrained", "pending_weights", "pretrained"]

# MARK, the attribute marking a module whose engine reads its weights once built, is on the
# module itself, so that a copy of it (TRL's reference model, copy.deepcopy of the policy) is
# marked too.


def pretrained(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Mark ``model`` so that its engine reads the weights at ``path`` into its shards.

    The engine reads them as soon as it is built
    (:meth:`~ds_strategy.ZeroEngine.load_weights`), whichever front end builds it. The model
    is typically built on the meta device. This is the counterpart of DeepSpeed's
    ``zero.Init`` with ``from_pretrained``.

    Args:
        model: the model the engine will be built on.
        path: a weights file or a ``save_pretrained`` directory.
        strict: as in ``load_weights``.

    Returns:
        ``model``, marked.

    >>> with torch.device("meta"):  # doctest: +SKIP
    ...     model = ds_strategy.pretrained(MyModel(), "weights.safetensors")
    >>> trainer = lightning.Trainer(strategy="zero3")  # doctest: +SKIP
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"pretrained({str(path)!r}): no such file or directory")
    setattr(model, MARK, (p, strict))
    return model


def pending_weights(model: nn.Module) -> list[tuple[str, Path, bool]]:
    """``(prefix, path, strict)`` of ``model`` and each submodule marked to load weights
    (:func:`pretrained`; ``prefix`` is the submodule's name and a dot, ``""`` for ``model``),
    once: the marks go."""
    out = []
    plain = plain_names(model)
    for name, sub in model.named_modules():
        mark = sub.__dict__.pop(MARK, None)
        if mark is not None:
            name = plain(name + ".x")[:-1] if name else ""  # (the mapping takes a full name)
            out.append((name, *mark))
    return out


@dataclass(frozen=True)
class LoadedWeights:
    """What :meth:`~ds_strategy.ZeroEngine.load_weights` did.

    Attributes:
        path: the weights file or directory read.
        loaded: the parameters and buffers it loaded, by the model's names.
        missing: those the files lack, left as initialised.
        unexpected: the files' tensors the model has no place for. They are ignored, as
            ``from_pretrained`` does.
    """

    path: Path
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def load_pretrained(
    engine: CheckpointedEngine,
    module: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    unset: list[str] | None = None,
    prefix: str = "",
) -> LoadedWeights:
    """Read the weights at ``path`` into ``engine``'s shards (see the note). ``strict``: a
    parameter the files lack is an error (else it keeps its initial value and is reported);
    ``unset``: the names of buffers the model's initialisation left unset; ``prefix``: the
    files hold the submodule of ``module`` at this name (``"llama."``), not all of it."""
    comm = engine.checkpoint_comm
    with together(comm, CheckpointError):
        source = open_weights(path)
        add_converted_views(source, unwrapped(module))
    with source:
        shards = engine.checkpoint_shards()
        with together(comm, CheckpointError):
            shapes = {k: v for k, v in shards.shapes.items() if k.startswith(prefix)}
            buffers = {k: v for k, v in shards.buffers.items() if k.startswith(prefix)}
            names = _match(source, module, shapes, buffers, prefix)
            report = _report(source, names, shapes, buffers, Path(path))
            if strict and report.missing:
                params = [n for n in report.missing if n in shapes]
                if params:
                    raise CheckpointError(_missing_message(report.path, params))
            for piece in shards.weights:
                _read_piece(source, names, piece.placement, piece.tensor, engine.checkpoint_io)
            for name, buf in buffers.items():
                if name in names:
                    _read_whole(source, names[name], buf, report.path)
    engine.checkpoint_loaded()
    with together(comm, CheckpointError):
        still = unset_buffers(module, [n for n in unset or [] if n.startswith(prefix)])
        if still:
            raise CheckpointError(
                f"{report.path}: buffer(s) {still} are in no file there and the model's "
                "initialisation did not compute them (they were on the meta device); pass "
                "ds_strategy.initialize(..., param_init_fn=fn) where fn(module) computes them, "
                "or build the modules holding them on the CPU"
            )
    return report


def _match(
    source: PretrainedFiles,
    module: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    buffers: dict[str, torch.Tensor],
    prefix: str,
) -> dict[str, str]:
    """The file's name for each of the model's parameters and buffers (under ``prefix``) that
    the files hold."""
    plain = plain_names(module)  # the records' names: no torch.compile / DDP wrapper parts
    aliases: dict[str, list[str]] = {}  # a tied weight's first name -> all its names
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(first.setdefault(id(p), plain(name)), []).append(plain(name))
    held = unwrapped(module)
    for sub_name, sub in module.named_modules():
        if prefix and plain(sub_name) == prefix[:-1]:
            held = unwrapped(sub)
    base = getattr(held, "base_model_prefix", "") or ""
    out: dict[str, str] = {}
    for name in [*shapes, *buffers]:
        for candidate in aliases.get(name, [name]):
            if not candidate.startswith(prefix):
                continue
            found = _in_source(source, candidate[len(prefix) :], base)
            if found is not None:
                out[name] = found
                break
    return out


def _in_source(source: PretrainedFiles, name: str, prefix: str) -> str | None:
    if name in source:
        return name
    if prefix:
        if f"{prefix}.{name}" in source:  # a base model, from a file of the model with a head
            return f"{prefix}.{name}"
        if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in source:
            return name[len(prefix) + 1 :]
    return None


def _report(
    source: PretrainedFiles,
    names: dict[str, str],
    shapes: dict[str, tuple[int, ...]],
    buffers: dict[str, torch.Tensor],
    path: Path,
) -> LoadedWeights:
    for name, file_name in names.items():
        want = tuple(shapes[name]) if name in shapes else tuple(buffers[name].shape)
        got = tuple(source.shape(file_name))
        if got != want:
            raise CheckpointError(
                f"{path}: '{file_name}' has shape {list(got)} there and {list(want)} in this "
                "model; build the model from the same config as the files (config.json)"
            )
    used = {part for found in names.values() for part in source.parts_of(found)}
    return LoadedWeights(
        path,
        loaded=list(names),
        missing=[n for n in [*shapes, *buffers] if n not in names],
        unexpected=[n for n in source.names if n not in used],
    )


def _missing_message(path: Path, params: list[str]) -> str:
    return (
        f"{path}: {len(params)} parameter(s) of this model are in no file there, e.g. "
        f"{params[:4]}; check the model matches the checkpoint (its config.json), or pass "
        "load_weights(..., strict=False) to keep their initial values"
    )


def _read_piece(
    source: PretrainedFiles,
    names: dict[str, str],
    where: Placement,
    tensor: torch.Tensor,
    files: SwapFiles | None,
) -> None:
    """This rank's runs of one parameter, into the live storage or its swap file."""
    name = names.get(where.name)
    if name is None:
        return  # missing, and allowed (strict=False)
    for run in where.runs:
        located = files.find(tensor, run.offset, run.length) if files is not None else None
        if files is None or located is None:
            source.read(name, run.start, tensor[run.offset : run.offset + run.length])
            continue
        swap, offset, _ = located  # out in a swap file: a bounded buffer at a time
        step = tensor.element_size()
        buf = torch.empty(min(CHUNK, run.length), dtype=tensor.dtype)
        for i in range(0, run.length, CHUNK):
            part = buf[: min(CHUNK, run.length - i)]
            source.read(name, run.start + i, part)
            files.write((swap, offset + i * step, part.numel()), part)


def _read_whole(source: PretrainedFiles, name: str, buf: torch.Tensor, path: Path) -> None:
    flat = torch.empty(buf.numel(), dtype=buf.dtype)
    source.read(name, 0, flat)
    with torch.no_grad():
        buf.copy_(flat.view(buf.shape))
