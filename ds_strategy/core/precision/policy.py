"""Which dtype each piece of model state lives in.

=============  ====================  =================  ==============================
config         parameters (compute)  master / optimizer  gradient reduction
=============  ====================  =================  ==============================
fp32           fp32                  fp32 (the params)  fp32
bf16           bf16                  fp32 master        ``communication_data_type``
bf16, no       bf16                  bf16 (the params)  ``communication_data_type``
master
fp16           fp16 (loss-scaled)    fp32 master        ``communication_data_type``
=============  ====================  =================  ==============================

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

    @staticmethod
    def from_config(cfg: ZeroConfig) -> PrecisionPolicy:
        if cfg.fp16.enabled:
            param, master, scaling = torch.float16, True, True
        elif cfg.bf16.enabled:
            param, master, scaling = torch.bfloat16, cfg.bf16.master_weights, False
        else:
            param, master, scaling = torch.float32, False, False
        reduce = COMM_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else param
        offload = cfg.zero_optimization.offload_optimizer.device != "none"
        return PrecisionPolicy(param, reduce, master, scaling, offload)

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


def _is_float(t: Any) -> bool:
    return torch.is_tensor(t) and t.is_floating_point()
