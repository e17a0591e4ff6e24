"""Tensor-parallel inference: the training plans (``core/tp/plan.py``) applied to a model on
the meta device, each split layer replaced by one of its local size, so every rank reads and
holds only its part of each split weight.

[Note: no DTensor at inference]
Training splits layers with DTensor because autograd must route gradients through the styles'
collectives. Inference needs only the forward, which is Megatron's: a column-wise layer keeps
its rows of the weight (and of the bias) and returns its part of the output features; a
row-wise layer keeps its columns, takes the part of the features the layer before it returned,
and all-reduces its output over the tensor-parallel ranks, its bias added by the first rank
only (a zero bias elsewhere), so the sum holds it once. Attention reads its heads from the
tensor (``view(..., -1, head_dim)``), so the local layers just give it fewer of them; GPT-2's
attention, which splits its fused output at ``split_size``, gets its local width. Plain local
layers keep every kernel and quantization path a whole layer has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...config import ConfigError
from ..collectives import Comm
from ..tp.plan import FUSED_CHUNKS, is_conv1d

__all__ = ["Split", "TensorParallelInference"]


@dataclass(frozen=True)
class Split:
    """This rank's part of a source tensor: dimension ``dim`` cut in ``size`` equal parts (each
    of ``chunks`` blocks cut so: a fused q|k|v), part ``rank``; ``first_only``: a replicated
    tensor only the first rank holds (a row-wise bias), zeros elsewhere."""

    dim: int | None
    rank: int
    size: int
    chunks: int = 1
    first_only: bool = False

    def runs(self, full: int) -> list[tuple[int, int]]:
        """``(start, stop)`` ranges of the full dimension that make up this rank's part, in
        local order.

        >>> Split(0, 1, 2, chunks=3).runs(12)
        [(2, 4), (6, 8), (10, 12)]
        """
        block = full // self.chunks
        part = block // self.size
        return [
            (b * block + self.rank * part, b * block + (self.rank + 1) * part)
            for b in range(self.chunks)
        ]

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return shape
        out = list(shape)
        out[self.dim] //= self.size
        return tuple(out)


class TensorParallelInference:
    """``plan`` (module name -> style) applied to ``model`` (on the meta device) over the
    tensor-parallel group ``comm``; ``splits`` says, for each parameter name, which part of
    the source tensor this rank holds."""

    def __init__(self, model: nn.Module, plan: dict[str, str], comm: Comm) -> None:
        self.comm = comm
        self.size, self.rank = comm.world_size, comm.rank
        self.plan = plan
        self.splits: dict[str, Split] = {}
        for name, style in plan.items():
            module = model.get_submodule(name)
            local = self._localize(name, module, style)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, local)
            if style == "colwise_qkv":
                attention = model.get_submodule(parent)
                width = getattr(attention, "split_size", None)
                if width is not None:  # GPT-2: the width its q|k|v split at
                    attention.split_size = int(width) // self.size  # type: ignore[assignment]

    def install_reductions(self, model: nn.Module) -> None:
        """Each row-wise layer sums its partial outputs over the ranks; call it once the layers
        are final (after quantization replaced them)."""
        for name, style in self.plan.items():
            if style == "rowwise":
                model.get_submodule(name).register_forward_hook(self._sum_partial_outputs)

    def _sum_partial_outputs(
        self, module: nn.Module, args: tuple[object, ...], out: torch.Tensor
    ) -> None:
        self.comm.all_reduce(out, kind="tp_all_reduce")  # in place: the layer's output

    def _localize(self, name: str, module: nn.Module, style: str) -> nn.Module:
        conv = is_conv1d(module)
        # the weight's dimension holding the output features (Conv1D stores (in, out))
        out_dim, in_dim = (1, 0) if conv else (0, 1)
        chunks = FUSED_CHUNKS.get(style, 1)
        weight_dim = in_dim if style == "rowwise" else out_dim
        self.splits[f"{name}.weight"] = Split(weight_dim, self.rank, self.size, chunks)
        if getattr(module, "bias", None) is not None:
            bias = (
                Split(None, self.rank, self.size, first_only=True)
                if style == "rowwise"
                else Split(0, self.rank, self.size, chunks)
            )
            self.splits[f"{name}.bias"] = bias
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        shape = self.splits[f"{name}.weight"].local_shape(tuple(weight.shape))
        has_bias = getattr(module, "bias", None) is not None
        with torch.device("meta"):
            if conv:
                local = type(module)(shape[1], shape[0])  # Conv1D(nf=out, nx=in)
            elif isinstance(module, nn.Linear):
                local = nn.Linear(shape[1], shape[0], bias=has_bias)
            else:
                raise ConfigError(
                    f"tensor_parallel: {name!r} is a {type(module).__name__}; inference splits "
                    "nn.Linear and Conv1D layers (leave it out of tensor_parallel.plan)",
                    key="tensor_parallel.plan",
                )
        local.weight.requires_grad_(False)
        if has_bias:
            local.bias.requires_grad_(False)
        return local
