"""Weight-only integer quantization: the arithmetic and the stored format, as pure functions.

[Note: the format, and why it is torchao's arithmetic]
A weight ``W`` of shape (rows, cols) (``nn.Linear``: (out, in); ``nn.Embedding``: (num, dim))
is cut into groups of ``group`` consecutive columns of one row: 8 bits use one group per row
(per output channel), 4 bits ``group_size`` columns. Each group gets a scale (and, asymmetric,
a zero point):

- symmetric: ``scale = max|w| / ((qmax - qmin) / 2)``, ``q = clamp(round(w * (1 / scale)),
  qmin, qmax)`` with ``[qmin, qmax] = [-2^(b-1), 2^(b-1) - 1]``, ``w' = q * scale``;
- asymmetric: ``scale = (max w - min w) / (2^b - 1)``, ``zero = min w + scale * 2^(b-1)``,
  ``q = clamp(round((w - (zero - scale * 2^(b-1))) / scale), 0, 2^b - 1)``, ``w' = (q - 2^(b-1)) * scale + zero``
  (the float zero point of torch's int4 matmul kernels).

Both are torchao's affine quantization to the rounding (``choose_qparams_affine`` with
``MappingType.SYMMETRIC``; the "tinygemm" float-zero-point form), so a model trained with
torchao's fake quantization (``qat.py``) sees exactly the integers this module exports
(``tests/test_quant.py`` checks it against torchao). Scales are clamped to the smallest normal
fp32 so an all-zero group stays zero.

Stored tensors: ``qweight`` — int8 (rows, cols) for symmetric 8 bits (what torch's and
torchao's int8 kernels take), else uint8 holding ``q + 2^(b-1)`` (symmetric) or ``q``; at 4
bits two values a byte, column ``2j`` in the low nibble and ``2j + 1`` in the high one, so
(rows, cols / 2). ``scales`` and ``zeros``: (rows, cols / group), computed in fp32 and kept
by the layers in their compute dtype (as torchao keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantScheme", "QuantizedWeight", "dequantize", "quantize"]

_EPS = torch.finfo(torch.float32).smallest_normal


@dataclass(frozen=True)
class QuantScheme:
    """How one weight is quantized: ``bits`` (8 or 4), ``group_size`` (4 bits only; 8 bits
    quantize per output channel) and ``symmetric``.

    >>> QuantScheme(4, 32).group(128), QuantScheme(8, 32).group(128)
    (32, 128)
    """

    bits: int
    group_size: int = 64
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantization.bits={self.bits}: use 8 or 4")

    def group(self, cols: int) -> int:
        return cols if self.bits == 8 else self.group_size

    @property
    def mid(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def qdtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 and self.symmetric else torch.uint8

    def fits(self, cols: int) -> bool:
        """Whether a weight of ``cols`` columns splits into whole groups (as torchao, a layer
        that does not is left in full precision)."""
        return cols % self.group(cols) == 0

    def shapes(self, rows: int, cols: int) -> dict[str, tuple[int, int]]:
        """The stored tensors' shapes for a (rows, cols) weight."""
        out = {
            "qweight": (rows, cols * self.bits // 8),
            "scales": (rows, cols // self.group(cols)),
        }
        if not self.symmetric:
            out["zeros"] = out["scales"]
        return out


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"qweight": self.qweight, "scales": self.scales}
        if self.zeros is not None:
            out["zeros"] = self.zeros
        return out


def quantize(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """``w`` (rows, cols; any float dtype) in the stored format (see the note above).

    >>> qw = quantize(torch.tensor([[0.5, -1.0, 0.25, 0.0]]), QuantScheme(8))
    >>> qw.qweight.tolist(), round(qw.scales.item(), 6)
    ([[64, -127, 32, 0]], 0.007843)
    """
    rows, cols = w.shape
    g = scheme.group(cols)
    x = w.detach().float().reshape(rows, cols // g, g)
    if scheme.symmetric:
        lo, hi = -scheme.mid, scheme.mid - 1
        scale = (x.abs().amax(-1) / ((hi - lo) / 2)).clamp(min=_EPS)
        q = torch.clamp(torch.round(x * (1.0 / scale[..., None])), lo, hi)
        zeros = None
        stored = q if scheme.bits == 8 else q + scheme.mid
    else:
        qmax = (1 << scheme.bits) - 1
        low = x.amin(-1)
        scale = ((x.amax(-1) - low) / qmax).clamp(min=_EPS)
        zeros = low + scale * scheme.mid
        base = zeros - scale * scheme.mid  # torchao's rounding of min w, kept to the bit
        stored = torch.clamp(torch.round((x - base[..., None]) / scale[..., None]), 0, qmax)
    stored = stored.reshape(rows, cols).to(torch.int16)
    return QuantizedWeight(_pack(stored, scheme), scale, zeros)


def _pack(q: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    if scheme.bits == 8:
        return q.to(scheme.qdtype)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack(qweight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The stored integers as one value per column (int16), undoing the 4-bit packing."""
    q = qweight.to(torch.int16)
    if scheme.bits == 8:
        return q
    return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], -1)


def dequantize(qw: QuantizedWeight, scheme: QuantScheme, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``qw`` stands for, in ``dtype`` (rows, cols).

    >>> s = QuantScheme(4, 32, symmetric=False)
    >>> w = torch.linspace(-1, 1, 64).reshape(2, 32)
    >>> (dequantize(quantize(w, s), s, torch.float32) - w).abs().max() <= 1 / 15 + 1e-6
    tensor(True)
    """
    q = unpack(qw.qweight, scheme)
    rows, cols = q.shape
    groups = qw.scales.shape[1]
    x = q.reshape(rows, groups, cols // groups).float()
    if scheme.symmetric:
        if scheme.bits == 4:
            x = x - scheme.mid
        w = x * qw.scales[..., None]
    else:
        assert qw.zeros is not None
        w = (x - scheme.mid) * qw.scales[..., None] + qw.zeros[..., None]
    return w.reshape(rows, cols).to(dtype)
