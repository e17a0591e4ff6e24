"""Which of an optimizer's state tensors are per-element (one value per element of the
parameter piece: Adam's moments, momentum), as opposed to scalars and step counts."""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["per_element"]


def per_element(state: Mapping[str, object], t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` shaped like ``t``: what is sharded, swapped, rounded,
    quantized and checkpointed with the piece ``t`` (a torchao quantized state has the
    parameter's shape too).

    >>> per_element({"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}, torch.ones(4))
    {'exp_avg': tensor([0., 0., 0., 0.])}
    """
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == t.shape}
