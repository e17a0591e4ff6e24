"""Which dtype each piece of model state lives in.

=============  ====================  =================  ==============================
config         parameters (compute)  master / optimizer  gradient reduction
=============  ====================  =================  ==============================
fp32           fp32                  fp32 (the params)  fp32
bf16           bf16                  fp32 master        ``communication_data_type``
bf16, no       bf16                  bf16 (the params)  ``communication_data_type``
master
fp16           fp16 (loss-scaled)    fp32 master        ``communication_data_type``
bf16/fp16,     bf16/fp16             the params,        ``communication_data_type``
``*_master_                          stepped in fp32,
weights_and_                         rounded
grads``                              stochastically
=============  ====================  =================  ==============================

``bf16_optimizer_states`` keeps the optimizer's per-element state in bf16 as well, stepped the
same way (``state_dtype``). Both run the step through ``core/precision/step.py``.

``communication_data_type`` defaults to the parameter dtype, as in DeepSpeed. Gradients are
kept (and accumulated) in the parameter dtype and converted to fp32 only for the step, which
is what gives the ZeRO paper's K=12 memory: 2Ψ parameters + 2Ψ gradients + 12Ψ of fp32
master weights and Adam moments, each sharded as the stage says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ...config import ZeroConfig

__all__ = ["COMM_DTYPES", "PrecisionPolicy"]

# the dtype of each CommDataType choice (communication_data_type, the sequence all-to-all's)
COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_weights: bool = False  # an fp32 copy of this rank's shard is what the optimizer updates
    loss_scaling: bool = False
    # optimizer offload: on an accelerator the fp32 master shard is allocated in host memory
    # (always, fp32 training included), so the device never holds it (core/offload)
    offload_master: bool = False
    # DeepSpeed's *_master_weights_and_grads: the optimizer steps the low-precision weights
    # themselves, computing in fp32 and rounding stochastically (see core/precision/step.py)
    low_master: bool = False
    # bf16_optimizer_states: the per-element optimizer state is stored in this dtype
    # (None: in whatever dtype the optimizer makes it)
    state_dtype: torch.dtype | None = None
    # a low-bit optimizer's quantization block (torchao's 8-bit, 4-bit, fp8 AdamW): shards
    # align to it so no block straddles two ranks (core/optim/lowbit.py); 1 otherwise
    state_block: int = 1
    # bytes an element of one such quantized state costs (1 + 4 / block for 8-bit); 0: none
    quantized_state_bytes: float = 0.0
    # Muon: a matrix keeps this many per-element states (its momentum), the rest AdamW's two
    matrix_moments: int | None = None

    @staticmethod
    def from_config(cfg: ZeroConfig) -> PrecisionPolicy:
        low, states = False, None
        if cfg.fp16.enabled:
            param, scaling = torch.float16, True
            low = cfg.fp16.fp16_master_weights_and_grads
            master = not low
        elif cfg.bf16.enabled:
            param, scaling = torch.bfloat16, False
            low = cfg.bf16.bf16_master_weights_and_grads
            master = cfg.bf16.master_weights and not low
            states = torch.bfloat16 if cfg.bf16.bf16_optimizer_states else None
        else:
            param, master, scaling = torch.float32, False, False
        reduce = COMM_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else param
        offload = cfg.zero_optimization.offload_optimizer.device != "none"
        return PrecisionPolicy(param, reduce, master, scaling, offload, low, states)

    @property
    def rounded_step(self) -> bool:
        """The step computes in fp32 over low-precision weights or state, and rounds back."""
        return self.low_master or self.state_dtype is not None

    def element_bytes(self, moments: int = 2) -> tuple[int, int, float]:
        """Bytes a parameter element costs ``(P, G, K)``: parameter, gradient, and optimizer
        state (the master apart from the parameter, and ``moments`` per-element states).

        Args:
            moments: per-element state tensors of the optimizer (Adam: 2).
        """
        p = _itemsize(self.param_dtype)
        master = 4 if self.master_weights and self.mixed else 0
        # states follow the tensor the optimizer steps unless stored apart
        stepped = 4 if master or not self.mixed or self.low_master else p
        state: float = _itemsize(self.state_dtype) if self.state_dtype is not None else stepped
        if self.quantized_state_bytes:
            state = self.quantized_state_bytes
        return p, p, master + moments * state

    def formula_bytes(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """``(P, G, K)`` of a matrix and of any other parameter (they differ under Muon)."""
        other = self.element_bytes()
        if self.matrix_moments is None:
            return other, other
        return self.element_bytes(self.matrix_moments), other

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of a master copy kept apart from the parameters (offload's host copy)."""
        return self.param_dtype if self.low_master else torch.float32

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32

    def cast_inputs(self, tree: Any) -> Any:
        """Floating-point tensors in a forward's arguments, to the compute dtype."""
        if not self.mixed:
            return tree
        return tree_map(lambda t: t.to(self.param_dtype) if _is_float(t) else t, tree)

    def cast_outputs(self, tree: Any) -> Any:
        """Floating-point outputs back to fp32: the user wrote an fp32 model and computes the
        loss in fp32 (as under autocast)."""
        if not self.mixed:
            return tree
        return tree_map(
            lambda t: t.float() if _is_float(t) and t.dtype == self.param_dtype else t, tree
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_float(t: Any) -> bool:
    return torch.is_tensor(t) and t.is_floating_point()
