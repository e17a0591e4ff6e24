"""Tensor parallelism applied to a model with torch's DTensor (``parallelize_module``,
``ColwiseParallel``, ``RowwiseParallel``), then each split weight handed to ZeRO as the plain
tensor of this rank's part.

[Note: local parameters, DTensor compute]
ZeRO flattens parameters into buffers and swaps their storage, which a DTensor parameter does
not allow. So after ``parallelize_module`` every DTensor parameter is replaced by a plain
parameter holding its local part, and a parametrization (``torch.nn.utils.parametrize``) turns
it back into the DTensor whenever the layer reads it (``DTensor.from_local``: no copy, no
communication). The layer computes exactly as torch's tensor parallelism computes, the
style's input/output hooks do the collectives, and autograd delivers the local gradient to
the plain parameter, which ZeRO reduces over the data-parallel ranks like any other.
The model's parameter names gain ``parametrizations.<name>.original``; :meth:`full_state_dict`
gives the original names and full shapes back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.utils import parametrize

from ..collectives import Comm
from .plan import FUSED_CHUNKS, is_conv1d

__all__ = ["TPParam", "TensorParallel"]


def _interleave(t: torch.Tensor, dim: int, chunks: int, size: int) -> torch.Tensor:
    """``t`` whose ``dim`` is ``chunks`` equal blocks (q | k | v) reordered rank by rank, so
    that an even split over ``size`` ranks gives each rank its part of every block."""
    shape = t.shape
    blocks = t.reshape(*shape[:dim], chunks, size, shape[dim] // (chunks * size), *shape[dim + 1 :])
    return blocks.transpose(dim, dim + 1).reshape(shape)


def _uninterleave(t: torch.Tensor, dim: int, chunks: int, size: int) -> torch.Tensor:
    shape = t.shape
    ranks = t.reshape(*shape[:dim], size, chunks, shape[dim] // (chunks * size), *shape[dim + 1 :])
    return ranks.transpose(dim, dim + 1).reshape(shape)


def _partition(weight_dim: int, shard_bias: bool, chunks: int, style: ParallelStyle):
    """``distribute_module``'s partition function: the weight split along ``weight_dim``, the
    bias split (column-wise) or replicated (row-wise), fused blocks interleaved first."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for attr, dim in (("weight", weight_dim), ("bias", 0 if shard_bias else None)):
            p = getattr(module, attr, None)
            if p is None:
                continue
            data = p.detach()
            if dim is not None and chunks > 1:
                data = _interleave(data, dim, chunks, mesh.size())
            placement = Shard(dim) if dim is not None else Replicate()
            dist_p = distribute_tensor(data, mesh, [placement], src_data_rank=style.src_data_rank)
            module.register_parameter(attr, nn.Parameter(dist_p, requires_grad=p.requires_grad))

    return partition


class _Colwise(ColwiseParallel):
    """``ColwiseParallel`` for GPT-2's ``Conv1D`` (its weight is (in, out): split along 1) and
    for a fused layer whose outputs are ``chunks`` equal blocks, each split over the ranks."""

    def __init__(self, chunks: int = 1) -> None:
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        partition = _partition(1 if is_conv1d(module) else 0, True, self.chunks, self)
        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _Rowwise(RowwiseParallel):
    """``RowwiseParallel`` for GPT-2's ``Conv1D`` (its weight is (in, out): split along 0)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            _partition(0, False, 1, self),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _style(module: nn.Module, style: str) -> ParallelStyle:
    """torch's styles for ``nn.Linear``; ours for ``Conv1D`` and fused column-wise layers."""
    chunks = FUSED_CHUNKS.get(style, 1)
    if style == "rowwise":
        return _Rowwise() if is_conv1d(module) else RowwiseParallel()
    return _Colwise(chunks) if is_conv1d(module) or chunks > 1 else ColwiseParallel()


class _FromLocal(nn.Module):
    """The parametrization: this rank's part -> the DTensor the layer computes with."""

    def __init__(self, mesh: DeviceMesh, placements: tuple[Placement, ...], shape, stride) -> None:
        super().__init__()
        self.mesh, self.placements, self.shape, self.stride = mesh, placements, shape, stride

    def forward(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


@dataclass(frozen=True)
class TPParam:
    """Where a local parameter's full tensor is: its original name and shape, the dimension
    split across the tensor-parallel ranks (``None``: replicated), and the layer's pieces."""

    name: str
    local_name: str
    shape: torch.Size
    dim: int | None
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    stride: tuple[int, ...]
    local_shape: torch.Size
    offset: int  # where this rank's part starts along ``dim`` (in each block, when fused)
    chunks: int = 1  # ``dim`` holds this many equal blocks (q | k | v), each split

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def full_runs(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """Elements ``[start, start + length)`` of this rank's flattened part as
        ``(offset in them, start in the full flattened tensor, length)`` runs: one run for a
        split along the first dimension, one per row (outer index) otherwise, and one per
        block of a fused layer."""
        if self.dim is None:
            return [(0, start, length)]
        inner = self.local_shape[self.dim + 1 :].numel()
        block = self.local_shape[self.dim] // self.chunks * inner  # one block's elements, here
        full_block = self.shape[self.dim] // self.chunks * inner  # and in the full tensor
        runs = []
        i, end = start, start + length
        while i < end:
            outer, within = divmod(i, block)  # outer: (outer index, block) pairs in order
            n = min(block - within, end - i)
            runs.append((i - start, outer * full_block + self.offset * inner + within, n))
            i += n
        return runs


class TensorParallel:
    """A model split over ``mesh`` (one dimension, the tensor-parallel ranks) by ``plan``."""

    def __init__(
        self, model: nn.Module, mesh: DeviceMesh, plan: dict[str, str], comm: Comm
    ) -> None:
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(
                "tensor_parallel with a model on the meta device is not supported yet; build the "
                "model on the CPU (each rank then keeps only its part)"
            )
        self.mesh = mesh
        self.size = mesh.size()
        self.plan = plan
        # the parameters the user's optimizer holds, by (module, name), before torch swaps them
        before = {
            (name, attr): p
            for name in plan
            for attr, p in model.get_submodule(name).named_parameters(recurse=False)
        }
        styles = {name: _style(model.get_submodule(name), s) for name, s in plan.items()}
        parallelize_module(model, mesh, styles)
        self._localize_attention(model)
        self.comm = comm  # the tensor-parallel group: counts what the layers exchange
        self._count_exchanges(model)
        self.params: dict[int, TPParam] = {}  # id(local parameter) -> where its full tensor is
        self.replaced: dict[int, nn.Parameter] = {}  # id(original full parameter) -> local
        for mod_name, module in model.named_modules():
            for attr, p in list(module.named_parameters(recurse=False)):
                if isinstance(p, DTensor):
                    chunks = FUSED_CHUNKS.get(plan.get(mod_name, ""), 1)
                    held = self._localize(module, mod_name, attr, p, chunks)
                    original = before.get((mod_name, attr))
                    if original is not None:
                        self.replaced[id(original)] = held

    def _count_exchanges(self, model: nn.Module) -> None:
        """What the styles' collectives send, counted from the tensors they exchange (ring
        all-reduce: 2(T-1)/T of the tensor per rank): a row-wise layer all-reduces its output in
        forward, a column-wise layer the gradient of its input in backward."""
        factor = 2 * (self.size - 1) / self.size

        @torch.compiler.disable  # a count Dynamo traced would guard on it and recompile
        def count(t: torch.Tensor) -> None:
            self.comm.record("all_reduce", factor * t.numel() * t.element_size())

        def after_rowwise(module: nn.Module, args: tuple[object, ...], out: torch.Tensor) -> None:
            count(out)

        def before_colwise(module: nn.Module, args: tuple[object, ...]) -> None:
            x = args[0] if args else None
            if torch.is_grad_enabled() and torch.is_tensor(x) and x.requires_grad:
                x.register_hook(lambda g: count(g))

        for name, style in self.plan.items():
            module = model.get_submodule(name)
            if style == "rowwise":
                module.register_forward_hook(after_rowwise)  # after the style's: local output
            else:
                module.register_forward_pre_hook(before_colwise, prepend=True)  # the local input

    def _localize_attention(self, model: nn.Module) -> None:
        """GPT-2's attention splits its fused q|k|v output at ``split_size`` (the model width):
        with a rank's heads that is the width over T."""
        for name, style in self.plan.items():
            parent = model.get_submodule(name.rpartition(".")[0])
            if style == "colwise_qkv" and hasattr(parent, "split_size"):
                # an int (GPT-2's), which nn.Module's attribute typing cannot name
                parent.split_size //= self.size  # type: ignore[operator, assignment]

    def _localize(
        self, module: nn.Module, mod_name: str, attr: str, p: DTensor, chunks: int
    ) -> nn.Parameter:
        local = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
        placements = tuple(p.placements)
        shard = next((pl.dim for pl in placements if isinstance(pl, Shard)), None)
        delattr(module, attr)
        module.register_parameter(attr, local)
        parametrize.register_parametrization(
            module, attr, _FromLocal(p.device_mesh, placements, p.shape, p.stride()), unsafe=True
        )
        held = getattr(module.parametrizations, attr).original
        prefix = f"{mod_name}." if mod_name else ""
        # the divisibility checks of the plan make every part the same size
        part = 0 if shard is None else local.shape[shard] // chunks
        offset = part * p.device_mesh.get_local_rank()
        self.params[id(held)] = TPParam(
            f"{prefix}{attr}",
            f"{prefix}parametrizations.{attr}.original",
            p.shape,
            shard,
            p.device_mesh,
            placements,
            p.stride(),
            local.shape,
            offset,
            chunks if shard is not None else 1,
        )
        return held

    def is_split(self, param: torch.Tensor) -> bool:
        info = self.params.get(id(param))
        return info is not None and info.dim is not None

    def norm_weight(self, param: torch.Tensor) -> float:
        """A split parameter's squared norm is summed over the tensor-parallel ranks; a
        replicated one's is the same on every one of them, so each counts 1/T of it."""
        return 1.0 if self.is_split(param) else 1.0 / self.size

    def full_state_dict(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``local`` (this rank's names and parts) with original names and full tensors.
        Collective over the tensor-parallel ranks."""
        by_local_name = {info.local_name: info for info in self.params.values()}
        out: dict[str, torch.Tensor] = {}
        for key, tensor in local.items():
            info = by_local_name.get(key)
            if info is None:
                out[key] = tensor
                continue
            full = DTensor.from_local(
                tensor,
                info.mesh,
                info.placements,
                run_check=False,
                shape=info.shape,
                stride=info.stride,
            ).full_tensor()
            if info.chunks > 1:  # the blocks back in their original order
                assert info.dim is not None  # a fused layer is split (chunks > 1 needs a dim)
                full = _uninterleave(full, info.dim, info.chunks, self.size)
            out[info.name] = full
        return out
