"""``InferenceEngine.save_quantized``: the weights as the engine holds them, quantized layers
included, streamed to one ``.safetensors`` file by rank 0.

Under ZeRO-Inference each flat group is gathered in turn (every rank takes part; only one
group is whole at a time) and rank 0 writes its parameters before the next is gathered, so no
rank ever holds the whole model. The file's metadata records the quantization
(``quant/export.py``), which is how ``init_inference`` knows to read the layers as stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.weights_file import stream_safetensors
from ..collectives import Comm
from ..quant.export import quant_meta
from ..quant.scheme import QuantScheme
from ..zero.flat_group import FlatParamGroup

__all__ = ["write_quantized"]


def _entries(module: nn.Module) -> list[tuple[str, nn.Parameter | torch.Tensor]]:
    """(name, tensor) of every parameter (a tied one once, under its first name) and
    persistent buffer, in state-dict order."""
    out: list[tuple[str, nn.Parameter | torch.Tensor]] = []
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _tensors(
    groups: list[FlatParamGroup], entries: list[tuple[str, torch.Tensor]]
) -> Iterator[torch.Tensor]:
    """The full tensors of ``entries`` in order; collective under ZeRO (a group is gathered
    when its first parameter comes up and released after its last)."""
    group_of = {id(p): g for g in groups for p in g.params}
    last_use: dict[int, int] = {}
    for i, (_, t) in enumerate(entries):
        g = group_of.get(id(t))
        if g is not None:
            last_use[id(g)] = i
    for i, (_, t) in enumerate(entries):
        g = group_of.get(id(t))
        if g is None:
            yield t.detach()
            continue
        g.gather(async_op=False)
        g.wait_gathered()
        index = next(k for k, p in enumerate(g.params) if p is t)
        yield g.full_tensor(index).detach().clone()
        if last_use[id(g)] == i:
            g.release()


def write_quantized(
    path: Path,
    module: nn.Module,
    groups: list[FlatParamGroup],
    comm: Comm,
    scheme: QuantScheme,
    modules: list[str],
    tensor_parallel: bool,
) -> None:
    """Collective: rank 0 writes ``module``'s weights, the sharded ones gathered group by
    group from ``groups``, with the quantization ``scheme`` of ``modules`` in the metadata."""
    if tensor_parallel:
        raise ValueError(
            "save_quantized: this engine splits its layers over tensor-parallel ranks; save from "
            "an engine without tensor parallelism (the file then loads into any layout, "
            "tensor-parallel included)"
        )
    entries = _entries(module)
    shapes = {}
    for g in groups:
        for p, shape in zip(g.params, g.shapes, strict=True):
            shapes[id(p)] = list(shape)
    declared = [(name, t.dtype, shapes.get(id(t), list(t.shape))) for name, t in entries]
    tensors = _tensors(groups, entries)
    if comm.rank == 0:
        stream_safetensors(path, declared, tensors, quant_meta(scheme, modules))
    else:
        for _ in tensors:  # take part in the gathers
            pass
    comm.barrier()
