"""A flat group's parameter half: the full buffer, this rank's shard and its fp32 master.

Stages 0-2 keep the full buffer resident and the shard is a slice of it. Stage 3 keeps only
the shard between uses: ``gather`` fills the full buffer from every rank's shard, ``release``
frees it again. The state (``ShardState``) changes only through those two, and the bytes a
gather holds (the full buffer, qwZ's int8 blocks, hpZ's secondary shard) are held by this
half in the group's meter (``memory.Held``) and dropped by it.

[Note: why the full buffer's storage is resized, not reallocated]
Under stage 3 a released group frees its full buffer with ``untyped_storage().resize_(0)``
and a gather grows the *same* storage back. Autograd may have saved views of a parameter
during forward (``weight.t()`` inside ``F.linear``); those views point at this storage, so
refilling it in place makes them valid again for backward without keeping the memory alive
in between. While released, each parameter's ``.data`` is an empty tensor, so a stray use
fails loudly instead of reading freed memory.

[Note: hpZ's secondary shard]
With ``zero_hpz_partition_size`` P, the first release after a gather from the primary
shards (the forward's, over every rank) keeps this rank's 1/P of the full parameters:
its secondary shard, shared with the P ranks of its machine. Until the shards change
(the optimizer step, a checkpoint load: ``drop_secondary``) every gather, the
backward's and the next micro-batch's forward, all-gathers the secondary shards inside
the machine instead. They hold exactly the values the first gather produced (with qwZ,
the rounded ones), so backward computes with the forward's weights. The copy is a
transient of the step (the meter's, like the gathered parameters), not resident state.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..collectives import Comm, Work
from ..memory import CountedBuffer, Held, ModelStateMeter
from ..precision.policy import PrecisionPolicy
from ..streams import side_stream
from .inflight import Gather
from .layout import FlatLayout
from .stores import ShardStore
from .transports import Transport

__all__ = ["FlatParams", "GroupPolicy", "ShardState"]


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(frozen=True)
class GroupPolicy:
    shard_optimizer: bool  # stage >= 1: the optimizer sees only this rank's slice
    shard_grads: bool  # stage >= 2: only the reduced slice of the gradients is kept
    shard_params: bool  # stage 3: only the slice of the parameters is kept between uses


class FlatParams:
    """The parameters of one flat group: full buffer, shard, master and gather state.

    Args:
        params: the parameters, bound to views of the full buffer.
        comm: the shard group (layout, broadcasts, the post-step gathers).
        policy: what the stage keeps sharded.
        trainable: whether the optimizer steps them (a master may be kept).
        device: where the group computes.
        precision: the dtype policy (compute dtype, fp32 master).
        transport: how stage 3's gathers travel (hpZ's secondary group too).
        store: where the shard and the master live.
        meter: where a gather's bytes are counted.
        unfilled: built for values read into the shard later (see ``bind_unfilled``).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        comm: Comm,
        policy: GroupPolicy,
        *,
        trainable: bool,
        device: torch.device,
        precision: PrecisionPolicy,
        transport: Transport,
        store: ShardStore,
        meter: ModelStateMeter,
        unfilled: bool,
    ) -> None:
        self.params = params
        self.comm = comm
        self.policy = policy
        self.trainable = trainable
        self.device = device
        self.precision = precision
        self.transport = transport
        self.store = store
        self.meter = meter
        p0 = params[0]
        self.dtype = precision.param_dtype if p0.is_floating_point() else p0.dtype
        self.shapes = [p.shape for p in params]
        world = comm.world_size if policy.shard_optimizer else 1
        self.rank = comm.rank if policy.shard_optimizer else 0
        align = precision.state_block if policy.shard_optimizer else 1
        self.layout = FlatLayout([p.numel() for p in params], world, align)
        # unfilled: see bind_unfilled (never written, so never resident)
        make = torch.empty if unfilled else torch.zeros
        self.full = make(self.layout.padded_total, dtype=self.dtype, device=device)
        self.full_nbytes = self.full.untyped_storage().nbytes()
        self.state = ShardState.GATHERED
        # the gathered full buffer's bytes; None while it holds the values it was built
        # from: their release frees nothing the meter counted, and keeps no hpZ secondary
        self._gathered: Held | None = None
        self._gather: tuple[Gather, Held] | None = None  # in flight, with qwZ's scratch
        self.secondary: CountedBuffer | None = None  # see [Note: hpZ's secondary shard]
        self._staging: torch.Tensor | None = None  # see load_from_params
        self.shard, self.master = self._allocate_slices(*self.layout.shard_range(self.rank))

    def _allocate_slices(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's slice of the parameters and the fp32 master the optimizer updates.

        The slice is a view of the full buffer, or at stage 3 its own tensor (in host memory
        when the store keeps it there). A master exists under mixed precision, or when a
        store keeps it on the host.
        """
        on_accelerator = self.device.type != "cpu"
        host = torch.device("cpu")
        pin = self.store.pin and torch.cuda.is_available()
        if not self.policy.shard_params:
            shard = self.full[lo:hi]
        elif self.store.shard_on_host and on_accelerator:
            shard = torch.zeros(hi - lo, dtype=self.dtype, device=host, pin_memory=pin)
        else:
            shard = torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
        # mixed precision: the master starts from the parameters' exact values (see
        # load_from_params); a master only the store asks for starts from the shard's
        self._exact_master = self.precision.master_weights and self.dtype != torch.float32
        on_host = on_accelerator and (self.precision.offload_master or self.store.master_on_host)
        if not (self.trainable and (on_host or self._exact_master)):
            return shard, None
        self._exact_master = self._exact_master or self.precision.offload_master
        where = host if on_host else self.device
        dtype = self.precision.master_dtype
        master = torch.zeros(hi - lo, dtype=dtype, device=where, pin_memory=pin and on_host)
        return shard, master

    @property
    def step_params(self) -> torch.Tensor:
        """The flat tensor the optimizer updates: the fp32 master, else the shard itself."""
        return self.master if self.master is not None else self.shard

    # -- initial values ------------------------------------------------------------------------

    def load_from_params(self) -> None:
        """Copy the parameters' current values into the flat buffer (skipped for meta).

        With an exact fp32 master they go to an fp32 staging buffer first. The master then
        starts from the exact values, not their low-precision rounding.
        """
        dst = self.full
        if self.master is not None and self._exact_master:
            dst = self._staging = torch.zeros(
                self.layout.padded_total, dtype=torch.float32, device=self.device
            )
        for p, slot in zip(self.params, self.layout.slots, strict=True):
            if p.device.type != "meta":
                dst[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))

    def broadcast_and_bind(self, src: int = 0) -> None:
        """Make rank ``src``'s values everyone's and keep this rank's slice.

        The parameters then point at the flat buffer; under stage 3 they are released.

        Args:
            src: the group rank whose values every rank takes.
        """
        lo, hi = self.layout.shard_range(self.rank)
        if self._staging is not None:
            self.comm.broadcast(self._staging, src)
            assert self.master is not None
            self.master.copy_(self._staging[lo:hi])
            self.full.copy_(self._staging)
            self._staging = None
        else:
            self.comm.broadcast(self.full, src)
        if self.policy.shard_params:
            self.shard.copy_(self.full[lo:hi])
        if self.master is not None and not self._exact_master:
            self.master.copy_(self.full[lo:hi])
        self.bind()
        if self.policy.shard_params:
            self.release()

    def bind_unfilled(self) -> None:
        """Stage 3, built for values read into the shards right after.

        That is a strict pretrained load (``ZeroEngine.load_weights``). Nothing is copied or
        broadcast, the shard stays zeros until the load, and the full buffer is released
        unwritten. A rank never holds a whole unit (as DeepSpeed's ``zero.Init`` with
        ``from_pretrained``).
        """
        assert self.policy.shard_params, "bind_unfilled is for a partitioned (stage 3) group"
        self.bind()
        self.release()

    def load_shard(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Stage 3 filled from a weights file (inference); nothing is broadcast.

        This rank's slice is read piece by piece, then the parameters are bound and released.

        Args:
            read: ``read(index, start, stop)`` gives elements ``[start, stop)`` of parameter
                ``index``, flattened.
        """
        assert self.policy.shard_params, "load_shard fills a partitioned (stage 3) group"
        for pc in self.layout.pieces(self.rank):
            stop = pc.param_start + pc.length
            piece = read(pc.index, pc.param_start, stop)
            self.shard[pc.shard_start : pc.shard_start + pc.length].copy_(piece)
        if self.master is not None:
            self.master.copy_(self.shard)
        self.bind()
        self.release()

    def bind(self) -> None:
        """Point each parameter at its view of the full buffer."""
        for p, slot, shape in zip(self.params, self.layout.slots, self.shapes, strict=True):
            p.data = self.full[slot.offset : slot.offset + slot.numel].view(shape)

    # -- stage 3 gather / release ---------------------------------------------------------------

    def gather(self, async_op: bool = True) -> None:
        """SHARDED -> GATHERING: start filling the full buffer (see the notes).

        Args:
            async_op: leave the gather in flight (``wait_gathered`` completes it).
        """
        if self.state is not ShardState.SHARDED:
            return
        self.full.untyped_storage().resize_(self.full_nbytes)
        self._gathered = self.meter.held()
        self._gathered.take_bytes(self.full_nbytes)
        scratch = self.meter.held()
        # on a GPU the host-to-device copy of an offloaded shard runs on the gather's own
        # stream, overlapped with the compute (core/streams.py); on a CPU this is nothing
        with side_stream("all_gather", self.full, when=async_op):
            src = self.store.for_gather(self.shard, self.device)
            if self.secondary is not None:
                part = self.secondary.tensor
                gather = self.transport.gather_secondary(self.full, part, async_op)
            else:
                gather = self.transport.gather(self.full, src, async_op)
                scratch.take_bytes(gather.scratch)
        self._gather = (gather, scratch)
        self.state = ShardState.GATHERING

    def wait_gathered(self) -> None:
        """GATHERING -> GATHERED: the gather has landed; the parameters are bound to it."""
        if self.state is ShardState.GATHERING:
            assert self._gather is not None
            gather, scratch = self._gather
            gather.complete()
            scratch.drop()
            self._gather = None
            self.store.after_gather()
            self.bind()
            self.state = ShardState.GATHERED
        if self.state is not ShardState.GATHERED:
            raise RuntimeError("wait_gathered() on a group that was never gathered")

    def release(self) -> None:
        """GATHERING or GATHERED -> SHARDED: free the full buffer (keeping hpZ's part)."""
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.GATHERING:
            self.wait_gathered()
        secondary = self.transport.secondary
        if secondary is not None and self.secondary is None and self._gathered is not None:
            parts = self.full.view(secondary.world_size, -1)
            self.secondary = self.meter.counted(parts[secondary.rank].clone())
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
        self.full.untyped_storage().resize_(0)
        if self._gathered is not None:
            self._gathered.drop()
            self._gathered = None
        self.state = ShardState.SHARDED

    def drop_secondary(self) -> None:
        """The shards changed: the hpZ secondary shard is stale (see the note)."""
        if self.secondary is not None:
            self.secondary.drop()
            self.secondary = None

    # -- after the optimizer step ---------------------------------------------------------------

    def sync_from_master(self) -> None:
        """After the optimizer step (or a load): the compute-dtype shard from the master."""
        if self.master is None:
            return
        if self.master.untyped_storage().nbytes() > 0 or self.master.numel() == 0:
            self.shard.copy_(self.master)
        elif self.store.master_in_file:  # NVMe offload: brought in, then this again
            self.store.sync_master()

    def all_gather_after_step(self) -> Work:
        """Stages 1/2: every rank updated its slice; rebuild the full parameters."""
        if not self.policy.shard_optimizer:
            return Work(None)
        return self.comm.all_gather(self.full, self.shard, async_op=True)

    def consolidated(self, only_rank: int | None = None) -> torch.Tensor | None:
        """The whole flat buffer in fp32 from every rank's master (or shard).

        Collective when sharded.

        Args:
            only_rank: gather to this group rank alone; the others get None (no full-size
                buffer on them).
        """
        src = self.step_params if self.trainable else self.shard
        if only_rank is not None and only_rank != self.rank and not self.policy.shard_optimizer:
            return None
        if not self.policy.shard_optimizer:
            return src.float().clone()
        src = src.to(device=self.device, dtype=torch.float32)
        if only_rank is not None and only_rank != self.rank:
            self.comm.gather(None, src, dst=only_rank)
            return None
        full = torch.empty(self.layout.padded_total, dtype=torch.float32, device=self.device)
        if only_rank is None:
            self.comm.all_gather(full, src)
        else:
            self.comm.gather(full, src, dst=only_rank)
        return full

    def full_tensor(self, index: int) -> torch.Tensor:
        """A view of parameter ``index`` in the full buffer (valid only while gathered).

        Args:
            index: the parameter's position in the group.
        """
        slot = self.layout.slots[index]
        return self.full[slot.offset : slot.offset + slot.numel].view(self.shapes[index])

    def resident_bytes(self) -> int:
        """Parameter bytes as ``memory_report`` counts them: buffer or shard, and master."""
        if self.policy.shard_params:
            nbytes = self.shard.untyped_storage().nbytes()
        else:
            nbytes = self.full_nbytes
        if self.master is not None:
            nbytes += self.master.untyped_storage().nbytes()
        return nbytes
