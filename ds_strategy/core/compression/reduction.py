"""What the engine, the reducer and checkpoints ask of a compressed reduction.

Three classes answer it: top-k (``topk_reduce.py``), the 1-bit optimizers' momentum exchange
(``onebit_reduce.py``) and 0/1 Adam's exchanges (``zeroone_reduce.py``). The engine never
asks which one it holds: each carries its own answer to every question here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..zero.flat_group import FlatParamGroup

__all__ = ["GradientCompression", "SavedBuffers"]

# per trainable flat group: the buffers a checkpoint saves, by name
SavedBuffers = list[tuple["FlatParamGroup", dict[str, torch.Tensor]]]


class GradientCompression(Protocol):
    """A reduction that replaces backward's for some steps."""

    @property
    def active(self) -> bool:
        """Backward reduces nothing; the step's :meth:`reduce` exchanges instead."""
        ...

    @property
    def exchanged(self) -> bool:
        """This step's ``.grad`` came from an exchange that clipped each rank's gradient.

        The engine then clips no more, and ``clip_grad_norm_`` is refused.
        """
        ...

    @property
    def replicas_drift(self) -> bool:
        """The ranks' replicas differ between synchronisations.

        A checkpoint then takes weights and optimizer state from rank 0 alone.
        """
        ...

    def reduce(self) -> None:
        """The compressed exchange of everything accumulated. Collective."""
        ...

    def reset(self) -> None:
        """After a checkpoint load: state the checkpoint does not hold starts again."""
        ...

    def state_bytes(self) -> int:
        """Bytes of state the reduction keeps between steps, for ``memory_report()``."""
        ...

    def saved_buffers(self) -> SavedBuffers:
        """Per trainable flat group, the buffers a checkpoint saves (none: ``[]``)."""
        ...
