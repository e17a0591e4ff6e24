"""torchao's low-bit Adam and AdamW (8-bit, 4-bit and fp8 states) over ZeRO's shards.

[Note: quantized state per shard]
torchao keeps each moment of a parameter as codes (1 byte, or half a byte) and one fp32 scale
per block of ``block_size`` elements counted from the parameter's start, and quantizes only a
parameter of at least 4,096 elements whose size is a multiple of the block (bitsandbytes'
rule); any other keeps plain state. Under ZeRO the optimizer sees one piece of each parameter
per rank. Three things make each rank's state exactly the part of one process's state:

- the flat layout aligns every parameter and every shard to the block
  (``PrecisionPolicy.state_block``), so a piece starts on a block boundary of its parameter
  and the blocks of one process are the blocks of the pieces;
- whether a piece is quantized follows its whole parameter (``QuantizedStates``), not the
  piece's own size;
- a checkpoint saves the state dequantized to fp32, placed like any other per-element state,
  so it reshards to another world size or stage. Loaded, it is quantized again (``settle``)
  to the same codes, and the same scales within an fp32 rounding (see ``_anchored``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from ...config import ConfigError
from ...config.rules import LOWBIT_OPTIMIZERS
from .state import per_element


class _Group(Protocol):
    @property
    def shapes(self) -> Sequence[Sequence[int]]: ...


class _Piece(Protocol):
    """What is read of a ``zero.optimizer.OptimizerPiece``: the tensor, its group and index."""

    tensor: torch.Tensor
    index: int

    @property
    def group(self) -> _Group: ...


__all__ = [
    "LOWBIT_TYPES",
    "QuantizedStates",
    "is_quantized",
    "lowbit_block",
    "lowbit_class",
    "plain_state",
    "state_parts",
]

# the config's optimizer.type spellings (lower case) and torchao's class names
LOWBIT_TYPES = {name.lower(): name for name in LOWBIT_OPTIMIZERS}
# bytes of one state element: codes, plus an fp32 scale per block
_CODE_BYTES = {"8bit": 1.0, "4bit": 0.5, "Fp8": 1.0}
_SMALLEST = 4096  # torchao's rule: fewer elements keep plain state


def lowbit_class(name: str) -> type[torch.optim.Optimizer] | None:
    """torchao's class a config's ``optimizer.type`` names (None: not a low-bit one).

    Args:
        name: the type as written (case-insensitive).
    """
    cls_name = LOWBIT_TYPES.get(str(name).lower())
    if cls_name is None:
        return None
    try:
        module = importlib.import_module("torchao.optim")
    except ImportError as e:
        raise ConfigError(
            f"optimizer.type: {cls_name} is torchao's; install it with "
            "pip install 'ds_strategy[quant]'",
            key="optimizer.type",
        ) from e
    cls: type[torch.optim.Optimizer] = getattr(module, cls_name)
    return cls


def _is_lowbit(cls: type) -> bool:
    return cls.__module__.startswith("torchao.optim") and hasattr(cls, "_subclass_zeros")


def lowbit_block(optimizer: object) -> tuple[int, float]:
    """The quantization block of a torchao low-bit optimizer and the bytes of one quantized
    state element; ``(1, 0.0)`` for any other optimizer.

    Args:
        optimizer: an optimizer, or the factory of the config's (``optimizer_factory``).
    """
    cls = type(optimizer)
    built = getattr(optimizer, "optimizer_class", None)  # the config's factory
    if isinstance(built, type):
        cls = built
    if not _is_lowbit(cls):
        return 1, 0.0
    block = getattr(optimizer, "block_size", None) or getattr(optimizer, "block", None)
    if not isinstance(block, int):
        import inspect

        block = inspect.signature(cls.__init__).parameters["block_size"].default
    assert isinstance(block, int)
    kind = next(k for k in _CODE_BYTES if cls.__name__.endswith(k))
    return block, _CODE_BYTES[kind] + 4.0 / block


def is_quantized(t: object) -> bool:
    """A state tensor that is a wrapper of codes and scales (torchao's), not plain storage."""
    return isinstance(t, torch.Tensor) and hasattr(type(t), "__tensor_flatten__")


def state_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes: itself, or a quantized state's codes, scales
    and code map.

    Args:
        t: a state tensor.
    """
    if not is_quantized(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [part for n in names for part in state_parts(getattr(t, n))]


def plain_state(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: a quantized state dequantized to fp32, anything else itself.

    Args:
        t: a state tensor.
    """
    return t.dequantize() if is_quantized(t) else t


class QuantizedStates:
    """Makes the optimizer quantize a piece exactly when one process quantizes its whole
    parameter, and quantizes loaded plain state again (see the note).

    Args:
        optimizer: the torchao optimizer rebuilt over the pieces.
        pieces: what it updates.
        block: its quantization block.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, pieces: Iterable[_Piece], block: int
    ) -> None:
        self.optimizer = optimizer
        self.block = block
        self.pieces = list(pieces)
        # the whole parameter's size (from its shape: a stage-3 parameter is empty between uses)
        self.whole = {id(pc.tensor): math.prod(pc.group.shapes[pc.index]) for pc in self.pieces}
        # torchao decides per tensor in _new_buffer, from the tensor's own size: decide here
        optimizer._new_buffer = self._new_buffer  # type: ignore[attr-defined]

    def quantized(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s state is quantized: as its whole parameter's would be.

        Args:
            t: a piece the optimizer updates.
        """
        n = self.whole.get(id(t), t.numel())
        return n >= _SMALLEST and n % self.block == 0 and t.numel() % self.block == 0

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        if self.quantized(p):
            zeros = type(self.optimizer)._subclass_zeros  # type: ignore[attr-defined]
            out: torch.Tensor = zeros(p, signed, self.block)
            return out.to(p.device)
        return torch.zeros_like(p)

    def settle(self) -> None:
        """Plain per-element state (loaded from a checkpoint) quantized where it belongs."""
        for pc in self.pieces:
            st = self.optimizer.state.get(pc.tensor, {})
            for k, v in per_element(st, pc.tensor).items():
                if not is_quantized(v) and self.quantized(pc.tensor):
                    q = self._new_buffer(pc.tensor, signed=(k == "exp_avg"))
                    q.copy_(_anchored(v, q))
                    st[k] = q


def _anchored(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``v`` (a dequantized state) made to quantize back to its own codes and scales.

    A block's scale is its largest magnitude, and a signed code map ends at 1.0 but starts
    above -1.0 (-0.99297 for 8 bits). A block whose largest magnitude was negative therefore
    comes back from its codes with that element a little smaller; quantized again as it is,
    the whole block would get a smaller scale. That element is put back at its scale, which
    the code map's first entry gives, so the block's scale and codes come back (the scale
    within an fp32 rounding)."""
    qmap = getattr(q, "qmap", None)
    block = getattr(q, "block_size", None)
    if qmap is None or not isinstance(block, int) or float(qmap.min()) >= 0:
        return v  # unsigned, or a symmetric format (fp8): quantizing again is exact
    x = v.detach().reshape(-1, block).clone()
    low, where = x.min(dim=1)
    scale = low / float(qmap.min())  # the negative end's magnitude before it was coded
    fix = scale > x.max(dim=1).values
    rows = torch.nonzero(fix).flatten()
    x[rows, where[rows]] = -scale[rows]
    return x.reshape(v.shape)
