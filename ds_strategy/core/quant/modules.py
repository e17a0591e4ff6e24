"""Layers whose weights are stored quantized (``scheme.py``), the kernels they compute with, and
the swap that puts them in a model in place of ``nn.Linear`` / ``nn.Embedding``.

[Note: quantized tensors are plain frozen parameters]
``qweight``, ``scales`` and ``zeros`` are ``nn.Parameter``s with ``requires_grad=False``, not
buffers and not tensor subclasses: ZeRO-3 then flattens, shards, gathers and offloads them as
it does any frozen parameter (an int8 ``qweight`` travels as int8 in the all-gather, one byte
per value, and a 4-bit one as packed bytes), checkpoints and ``save_quantized`` see ordinary
tensors, and tensor parallelism slices them like weights. A kernel that wants torchao's
tensor subclass gets a wrapper around the gathered tensors at call time (no copy).

[Note: kernels]
- ``torchao``: 8-bit symmetric weights as torchao's ``Int8Tensor`` (its weight-only linear).
- ``torch``: 8-bit symmetric weights through ``torch._weight_int8pack_mm`` (CPU, CUDA).
- ``dequantize``: the layer's weight rebuilt in the compute dtype for one matmul, then
  dropped; covers every scheme and device.
Unset, the kernel is torchao's where it covers the scheme (8-bit symmetric) and torchao is
installed, else ``dequantize``. torchao's 4-bit tensors need CUDA kernels (or the ``mslk``
package on CPU), so 4 bits dequantize here on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.types import Device

from ...config import ConfigError
from ..warnings import PerformanceWarning
from .scheme import QuantizedWeight, QuantScheme, dequantize, quantize

__all__ = [
    "QuantPlan",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "quantize_modules",
    "resolve_kernel",
    "torchao_available",
]

KERNELS = ("torchao", "torch", "dequantize")


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao logs a warning per CUDA extension it cannot load on a CPU-only machine."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@functools.cache
def _torchao_int8() -> Callable[..., torch.Tensor] | None:
    """torchao's ``Int8Tensor`` class (its weight-only int8 tensor), None without torchao."""
    try:
        with _quiet_import():
            from torchao.quantization import Int8Tensor
    except ImportError:
        return None
    return Int8Tensor


def torchao_available() -> bool:
    return _torchao_int8() is not None


def resolve_kernel(requested: str | None, scheme: QuantScheme) -> str:
    """The kernel a layer of ``scheme`` computes with (``None``: the best available); an
    explicit request the scheme or the installation cannot serve is an error naming
    ``quantization.kernel``."""
    int8_sym = scheme.bits == 8 and scheme.symmetric
    if requested is None:
        return "torchao" if int8_sym and torchao_available() else "dequantize"
    if requested in ("torchao", "torch") and not int8_sym:
        raise ConfigError(
            f"quantization.kernel={requested!r} computes with 8-bit symmetric weights only "
            f"(bits={scheme.bits}, symmetric={scheme.symmetric} here); leave it unset or "
            "use 'dequantize'",
            key="quantization.kernel",
        )
    if requested == "torchao" and not torchao_available():
        raise ConfigError(
            "quantization.kernel='torchao': torchao is not installed (pip install torchao); "
            "or leave it unset",
            key="quantization.kernel",
        )
    if requested not in KERNELS:
        raise ConfigError(
            f"quantization.kernel={requested!r}: use one of {', '.join(KERNELS)}",
            key="quantization.kernel",
        )
    return requested


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: Device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Quantized(nn.Module):
    """What both layers hold: the stored tensors of a (rows, cols) weight."""

    scheme: QuantScheme
    qweight: nn.Parameter
    scales: nn.Parameter
    zeros: nn.Parameter | None

    def _init_quantized(
        self, rows: int, cols: int, scheme: QuantScheme, device: Device, dtype: torch.dtype
    ) -> None:
        """Scales and zero points are kept in the compute ``dtype`` (as torchao keeps them)."""
        self.scheme = scheme
        for name, shape in scheme.shapes(rows, cols).items():
            kind = scheme.qdtype if name == "qweight" else dtype
            self.register_parameter(name, _param(shape, kind, device))
        if scheme.symmetric:
            self.register_parameter("zeros", None)

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros)

    def set_quantized(self, qw: QuantizedWeight) -> None:
        with torch.no_grad():
            for name, t in qw.tensors().items():
                getattr(self, name).copy_(t)


class QuantizedLinear(_Quantized):
    """``nn.Linear`` with a quantized weight; ``bias`` in the compute dtype."""

    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        *,
        dtype: torch.dtype = torch.float32,
        device: Device = None,
        kernel: str = "dequantize",
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_quantized(out_features, in_features, scheme, device, dtype)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.kernel = kernel

    def extra_repr(self) -> str:
        s = self.scheme
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={s.bits}, group={s.group(self.in_features)}, symmetric={s.symmetric}, "
            f"kernel={self.kernel}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y + self.bias if self.bias is not None else y

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "torchao":
            int8_tensor = _torchao_int8()
            assert int8_tensor is not None  # resolve_kernel chose torchao: it is installed
            w = int8_tensor(self.qweight, self.scales, [1, self.in_features], x.dtype)
            return F.linear(x, w)
        if self.kernel == "torch":
            flat = x.reshape(-1, self.in_features)
            y = torch._weight_int8pack_mm(flat, self.qweight, self.scales.view(-1).to(x.dtype))
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, dequantize(self.quantized(), self.scheme, x.dtype))


class QuantizedEmbedding(_Quantized):
    """``nn.Embedding`` with a quantized table: a lookup dequantizes only the rows it reads."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        scheme: QuantScheme,
        *,
        padding_idx: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: Device = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.compute_dtype = dtype
        self._init_quantized(num_embeddings, embedding_dim, scheme, device, dtype)

    def extra_repr(self) -> str:
        s = self.scheme
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={s.bits}"

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        flat = idx.reshape(-1)
        zeros = self.zeros[flat] if self.zeros is not None else None
        rows = QuantizedWeight(self.qweight[flat], self.scales[flat], zeros)
        out = dequantize(rows, self.scheme, self.compute_dtype)
        return out.view(*idx.shape, self.embedding_dim)


@dataclass
class QuantPlan:
    """What :func:`quantize_modules` changed: each quantized module's name and the name of the
    full-precision weight it stands for (a tied weight: the first name it was found under);
    ``skipped``: layers left in full precision because their input features do not split
    into whole groups."""

    scheme: QuantScheme
    weights: dict[str, str] = field(default_factory=dict)  # module name -> weight name
    skipped: list[str] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return list(self.weights)


def _candidates(
    model: nn.Module,
    embeddings: bool,
    skip: list[re.Pattern[str]],
    linear: tuple[type, ...] = (nn.Linear,),
    embedding: tuple[type, ...] = (nn.Embedding,),
) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(weight) -> every (name, module) using it, for the weights a quantization may take:
    one used only by convertible, not excluded modules (a tied weight is converted in all its
    modules or in none). Convertible: exactly these classes (a subclass such as the
    ``out_proj`` of ``nn.MultiheadAttention``, whose weight its parent reads directly, is not)."""
    users: dict[int, list[tuple[str, nn.Module]]] = {}
    refused: set[int] = set()
    for name, m in model.named_modules(remove_duplicate=False):
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor):
            continue
        users.setdefault(id(w), []).append((name, m))
        cls = parametrize.type_before_parametrizations(m)  # a tensor-parallel layer's own class
        kind_ok = cls in linear or (embeddings and cls in embedding)
        if not kind_ok or any(p.search(name) for p in skip):
            refused.add(id(w))
    return {k: v for k, v in users.items() if k not in refused}


def quantize_modules(
    model: nn.Module,
    scheme: QuantScheme,
    *,
    dtype: torch.dtype = torch.float32,
    kernel: str = "dequantize",
    embeddings: bool = True,
    modules_to_not_convert: list[str] | tuple[str, ...] = (),
    only: set[str] | None = None,
) -> QuantPlan:
    """Replace every ``nn.Linear`` (and ``nn.Embedding``) of ``model`` by its quantized layer,
    in place. Weights on the meta device give layers on the meta device (filled later by the
    loader); real weights are quantized now. ``only``: the module names to convert (a
    quantized checkpoint says which), instead of every convertible one."""
    skip = [re.compile(p) for p in modules_to_not_convert]
    plan = QuantPlan(scheme)
    groups = _candidates(model, embeddings, skip).values()
    for group in fitting(groups, scheme, plan.skipped):
        names = [n for n, _ in group]
        if only is not None and not any(n in only for n in names):
            continue
        first_name, first = group[0]
        weight: torch.Tensor = first.weight  # type: ignore[assignment]
        shared: _Quantized | None = None
        for name, m in group:
            new = _replacement(m, scheme, dtype, kernel)
            if shared is None:
                if weight.device.type != "meta":
                    new.set_quantized(quantize(weight, scheme))
                shared = new
            else:  # tied: the same stored tensors in every module
                for attr in ("qweight", "scales", "zeros"):
                    setattr(new, attr, getattr(shared, attr))
            _set_submodule(model, name, new)
            plan.weights[name] = f"{first_name}.weight" if first_name else "weight"
    return plan


def fitting(
    groups: Iterable[list[tuple[str, nn.Module]]],
    scheme: QuantScheme,
    skipped: list[str],
    columns: Callable[[str, nn.Module], int] | None = None,
) -> Iterator[list[tuple[str, nn.Module]]]:
    """The groups whose weight ``scheme`` can hold; the others' names go to ``skipped``, with
    one warning naming them (torchao leaves such layers alone too). ``columns(name, module)``:
    a layer's input features, when its weight is not at hand (a released ZeRO-3 shard)."""
    for group in groups:
        name, module = group[0]
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        cols = columns(name, module) if columns is not None else int(weight.shape[1])
        if scheme.fits(cols):
            yield group
        else:
            skipped.extend(n for n, _ in group)
    if skipped:
        warnings.warn(
            f"quantization: {len(skipped)} layer(s) kept in full precision, their input "
            f"features not a multiple of group_size={scheme.group_size}: "
            f"{', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}",
            PerformanceWarning,
            stacklevel=3,
        )


def _replacement(m: nn.Module, scheme: QuantScheme, dtype: torch.dtype, kernel: str) -> _Quantized:
    if isinstance(m, nn.Linear):
        device = m.weight.device
        new: _Quantized = QuantizedLinear(
            m.in_features,
            m.out_features,
            m.bias is not None,
            scheme,
            dtype=dtype,
            device=device,
            kernel=kernel,
        )
        if m.bias is not None and device.type != "meta":
            with torch.no_grad():
                new.bias.copy_(m.bias)  # type: ignore[operator]
        return new
    assert isinstance(m, nn.Embedding)
    device = m.weight.device
    return QuantizedEmbedding(
        m.num_embeddings,
        m.embedding_dim,
        scheme,
        padding_idx=m.padding_idx,
        dtype=dtype,
        device=device,
    )


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    if not name:
        raise ValueError(
            f"quantization: the model itself is a {type(model).__name__}; wrap it in a module "
            "(nn.Sequential(model)) so its layer can be replaced"
        )
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
