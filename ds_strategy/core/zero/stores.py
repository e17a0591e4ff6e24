"""Where a flat group's shard and fp32 master live, chosen when the group is built.

[Note: a group's store]
A ``FlatParamGroup`` is built with its ``ShardStore``: on the device (``DeviceStore``, the
default), in host memory (CPU offload) or in files (NVMe offload). The store says where the
group allocates its fp32 master and, at stage 3, its partitioned shard, and hands the shard to
each gather; the offload tier (``core/offload``) provides the host and NVMe stores, so that
zero never imports it. What the NVMe tier attaches later (the files, once its swap directory
is open) is attached to its own store, never to the group.

On a machine without an accelerator every tensor already lives in host memory: a host store
moves nothing there (see ``core/offload/cpu.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["DeviceStore", "GradStore", "ShardStore"]


class GradStore(Protocol):
    """Where a group's gradient shard lives between reductions (``core/offload``, NVMe
    optimizer offload): see [Note: gradient shards in files]."""

    held: bool  # the shard is in memory, in use
    sq: torch.Tensor  # float64 squared norm of the shard as last put away (0 while empty)

    def fill(self) -> torch.Tensor: ...

    def prefetch(self) -> None: ...

    def put_away(self, sq: torch.Tensor) -> None: ...

    def discard(self) -> None: ...


class ShardStore(Protocol):
    """What a group asks of its store (see the note)."""

    kind: str  # "device", "host" or "nvme"
    # on an accelerator: the fp32 master of a trainable group in host memory (the optimizer
    # steps there), and at stage 3 the partitioned shard too; pinned when ``pin``
    master_on_host: bool
    shard_on_host: bool
    pin: bool

    @property
    def grads(self) -> GradStore | None:
        """The gradient shard's file, once the NVMe tier has opened one."""
        ...

    @property
    def master_in_file(self) -> bool:
        """The fp32 master lives in a file between uses (see :meth:`sync_master`)."""
        ...

    def for_gather(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The tensor the all-gather sends from the group's ``shard``: the shard itself, or a
        copy of it on ``device``, the group's."""
        ...

    def after_gather(self) -> None:
        """The gather has landed: what ``for_gather`` brought in may go back."""
        ...

    def sync_master(self) -> None:
        """The group's ``sync_from_master`` with its master in a file: brought in for it."""
        ...


class DeviceStore:
    """The shard and the master stay where the group computes."""

    kind = "device"
    master_on_host = False
    shard_on_host = False
    pin = False
    grads: GradStore | None = None
    master_in_file = False

    def for_gather(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        return shard

    def after_gather(self) -> None:
        pass

    def sync_master(self) -> None:
        pass
