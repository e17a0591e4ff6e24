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

The tier does this by the store it gives each group when the group is built (``HostStore``,
see [Note: a group's store] in ``core/zero/stores.py``): the group allocates its master and
shard in host memory from the start, so nothing is moved or replaced afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the offload tier works on zero's groups without importing zero
    from ..zero.stores import GradStore

__all__ = ["HostStore"]


class HostStore:
    """The ``ShardStore`` of a group under CPU offload: on an accelerator its fp32 master
    (trainable groups) and, with ``params`` (stage 3's ``offload_param``), its partitioned
    shard live in host memory, pinned when ``pin``; a gather sends a device copy."""

    kind = "host"
    master_on_host = True

    def __init__(self, *, pin: bool, params: bool) -> None:
        self.pin = pin
        self.shard_on_host = params

    @property
    def grads(self) -> GradStore | None:
        return None

    @property
    def master_in_file(self) -> bool:
        return False

    def for_gather(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        if shard.device == device:
            return shard
        return shard.to(device, non_blocking=True)

    def after_gather(self) -> None:
        pass

    def sync_master(self) -> None:
        pass
