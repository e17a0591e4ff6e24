"""The CPU tier: where the fp32 master shards and parameter shards live when offloaded.

[Note: CPU offload on a CPU-only machine is free]
Without an accelerator every tensor already lives in host memory, so ``device: cpu`` moves
nothing: the optimizer runs over the same shards, with no copies. On a GPU the fp32 master
shard of every trainable group moves to (optionally pinned) host memory, so the optimizer
and its state live there: the gradient shard is copied to the host once per step
(``FlatParamGroup.step_grad``), the step runs on the CPU, and the updated master is copied
back into the device shard (``sync_from_master``). With parameter offload (stage 3) the
compute-dtype shard of each partitioned group also moves to the host and is copied to the
device just for its all-gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the offload tier works on zero's groups without importing zero
    from ..zero.flat_group import FlatParamGroup


__all__ = ["HostParamStore", "host_copy", "place_on_host"]


def host_copy(src: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    out = torch.empty(src.numel(), dtype=dtype, pin_memory=pin and torch.cuda.is_available())
    out.copy_(src.reshape(-1))
    return out


class HostParamStore:
    """A partitioned group's shard kept on the host; the gather sends a device copy."""

    def __init__(self, group: FlatParamGroup) -> None:
        self.group = group

    def for_gather(self) -> torch.Tensor:
        return self.group.shard.to(self.group.device, non_blocking=True)

    def after_gather(self) -> None:
        pass


def place_on_host(groups: list[FlatParamGroup], pin: bool, params: bool) -> None:
    """Move fp32 masters (and, with ``params``, partitioned shards) of device-resident groups to
    the host. Groups already on the CPU are left untouched (see the note above)."""
    for g in groups:
        if g.device.type == "cpu":
            continue
        if g.trainable and (g.master is None or g.master.device.type != "cpu"):
            src = g.master if g.master is not None else g.shard
            g.master = host_copy(src, torch.float32, pin)
        elif g.trainable and pin and not g.master.is_pinned():
            g.master = host_copy(g.master, torch.float32, pin)
        if params and g.policy.shard_params:
            g.shard = host_copy(g.shard, g.dtype, pin)
            g.param_store = HostParamStore(g)
