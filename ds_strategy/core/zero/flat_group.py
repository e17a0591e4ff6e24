"""A group of parameters flattened into one padded buffer, sharded across ranks.

One class serves every stage; what differs is a ``GroupPolicy``:

=========  ==================  ===================  =====================================
stage      parameters          gradients            reduction
=========  ==================  ===================  =====================================
0          full, resident      full, resident       all-reduce at the accumulation boundary
1          full, resident      full, resident       reduce-scatter at the boundary
2          full, resident      shard only           reduce-scatter every backward
3          shard only          shard only           reduce-scatter every backward
=========  ==================  ===================  =====================================

[Note: why the full buffer's storage is resized, not reallocated]
Under stage 3 a released group frees its full buffer with ``untyped_storage().resize_(0)``
and a gather grows the *same* storage back. Autograd may have saved views of a parameter
during forward (``weight.t()`` inside ``F.linear``); those views point at this storage, so
refilling it in place makes them valid again for backward without keeping the memory alive
in between. While released, each parameter's ``.data`` is an empty tensor, so a stray use
fails loudly instead of reading freed memory.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..collectives import Comm, Work
from ..memory import ModelStateMeter
from ..precision.policy import PrecisionPolicy
from .inflight import Fold, Gather, GradScaling, Reduction
from .layout import FlatLayout
from .stores import DeviceStore, GradStore, ShardStore
from .transports import Transport

__all__ = ["FlatParamGroup", "GradScaling", "GroupMaker", "GroupPolicy", "ShardState"]


class ShardState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(frozen=True)
class GroupPolicy:
    shard_optimizer: bool  # stage >= 1: the optimizer sees only this rank's slice
    shard_grads: bool  # stage >= 2: only the reduced slice of the gradients is kept
    shard_params: bool  # stage 3: only the slice of the parameters is kept between uses


class FlatParamGroup:
    """Parameters of one dtype flattened into one buffer; this rank owns one contiguous slice.

    Built with everything it will use: ``comm`` (its layout, broadcasts and the post-step
    gathers), ``transport`` (how its gathers and reductions travel, plain over ``comm`` by
    default: see [Note: a group's transport] in transports.py), ``store`` (where its shard
    and master live: see [Note: a group's store] in stores.py) and ``meter`` (where its
    transient buffers are counted; a plan shares one among its groups)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        comm: Comm,
        policy: GroupPolicy,
        *,
        trainable: bool = True,
        device: torch.device | None = None,
        precision: PrecisionPolicy | None = None,
        transport: Transport | None = None,
        store: ShardStore | None = None,
        meter: ModelStateMeter | None = None,
        unfilled: bool = False,
    ) -> None:
        if not params:
            raise ValueError("a FlatParamGroup needs at least one parameter")
        self.params = params
        self.comm = comm
        self.policy = policy
        self.transport = transport or Transport.plain(comm)
        self.store: ShardStore = store or DeviceStore()
        self.trainable = trainable
        self.precision = precision or PrecisionPolicy()
        self.dtype = (
            self.precision.param_dtype if params[0].is_floating_point() else params[0].dtype
        )
        self.device = device or params[0].device
        self.shapes = [p.shape for p in params]
        world = comm.world_size if policy.shard_optimizer else 1
        self.rank = comm.rank if policy.shard_optimizer else 0
        self.layout = FlatLayout([p.numel() for p in params], world)
        lo, hi = self.layout.shard_range(self.rank)
        # unfilled: see bind_unfilled (never written, so never resident)
        make = torch.empty if unfilled else torch.zeros
        self._full = make(self.layout.padded_total, dtype=self.dtype, device=self.device)
        self._full_nbytes = self._full.untyped_storage().nbytes()
        self.state = ShardState.GATHERED
        # the full buffer holds the values it was built from, not a gather's: its release
        # frees nothing the meter counted, and keeps no hpZ secondary shard
        self._as_built = True
        self._gather: Gather | None = None
        self.meter = meter or ModelStateMeter()
        # ZeRO++ hpZ (stage 3): see [Note: hpZ's secondary shard]
        self._secondary: torch.Tensor | None = None
        self.shard, self.master = self._allocate_slices(lo, hi)
        self._staging: torch.Tensor | None = None
        self._pending_scale: list[float] = []  # see scale_grads_by
        self._step_grad: torch.Tensor | None = None
        # gradients
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if trainable:
            if policy.shard_grads:  # see [Note: the gradient shard, from the first backward]
                self.grad_shard = torch.empty(hi - lo, dtype=self.dtype, device=self.device)
                self.grad_shard.untyped_storage().resize_(0)
            else:
                self.grad_full = torch.zeros_like(self._full)
                self.grad_shard = self.grad_full[lo:hi]
        self.grad_seen = torch.zeros(len(params), dtype=torch.float64)
        self.transient_grads = False  # see free_grads
        self._ready = 0
        self._launched = False
        self._accumulation_form = False  # see to_accumulation_form
        self._shard_empty = True  # stages 2/3: grad_shard holds no reduction yet
        self._bucket: torch.Tensor | None = None  # stages 2/3: gradients not yet reduced
        self._filled: list[bool] = []
        self._local: torch.Tensor | None = None  # a bucket taken by take_local_grad

    def _allocate_slices(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's slice of the parameters (a view of the full buffer, or at stage 3 its
        own tensor, in host memory when the store keeps it there) and the fp32 master of it
        that the optimizer updates (mixed precision, or a store keeping it on the host)."""
        on_accelerator = self.device.type != "cpu"
        host = torch.device("cpu")
        pin = self.store.pin and torch.cuda.is_available()
        if not self.policy.shard_params:
            shard = self._full[lo:hi]
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
        master = torch.zeros(hi - lo, dtype=torch.float32, device=where, pin_memory=pin and on_host)
        return shard, master

    # -- initial values ------------------------------------------------------------------------

    def load_from_params(self) -> None:
        """Copy the parameters' current values into the flat buffer (skipped for meta). With
        an fp32 master they go to an fp32 staging buffer first, so the master starts from the
        exact values rather than their low-precision rounding."""
        dst = self._full
        if self.master is not None and self._exact_master:
            dst = self._staging = torch.zeros(
                self.layout.padded_total, dtype=torch.float32, device=self.device
            )
        for p, slot in zip(self.params, self.layout.slots, strict=True):
            if p.device.type != "meta":
                dst[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))

    def broadcast_and_bind(self, src: int = 0) -> None:
        """Make rank ``src``'s values everyone's, keep this rank's slice, point the parameters
        at the flat buffer (or release them, under stage 3)."""
        lo, hi = self.layout.shard_range(self.rank)
        if self._staging is not None:
            self.comm.broadcast(self._staging, src)
            assert self.master is not None
            self.master.copy_(self._staging[lo:hi])
            self._full.copy_(self._staging)
            self._staging = None
        else:
            self.comm.broadcast(self._full, src)
        if self.policy.shard_params:
            self.shard.copy_(self._full[lo:hi])
        if self.master is not None and not self._exact_master:
            self.master.copy_(self._full[lo:hi])
        self._bind_params()
        self._bind_grads()
        if self.policy.shard_params:
            self.release()

    def bind_unfilled(self) -> None:
        """Stage 3, built for values read into the shards right after (a strict pretrained
        load, ``ZeroEngine.load_weights``): nothing to copy or broadcast, the shard stays
        zeros until the load, and the full buffer, never written, is released untouched, so a
        rank never holds a whole unit (as DeepSpeed's ``zero.Init`` with ``from_pretrained``)."""
        assert self.policy.shard_params, "bind_unfilled is for a partitioned (stage 3) group"
        self._bind_params()
        self._bind_grads()
        self.release()

    def load_shard(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Stage 3 filled from a weights file (inference): this rank's slice read piece by
        piece, ``read(index, start, stop)`` giving elements ``[start, stop)`` of parameter
        ``index`` flattened; nothing is broadcast. Then the parameters are bound and released."""
        assert self.policy.shard_params, "load_shard fills a partitioned (stage 3) group"
        for pc in self.layout.pieces(self.rank):
            stop = pc.param_start + pc.length
            piece = read(pc.index, pc.param_start, stop)
            self.shard[pc.shard_start : pc.shard_start + pc.length].copy_(piece)
        if self.master is not None:
            self.master.copy_(self.shard)
        self._bind_params()
        self.release()

    def _bind_params(self) -> None:
        for p, slot, shape in zip(self.params, self.layout.slots, self.shapes, strict=True):
            p.data = self._full[slot.offset : slot.offset + slot.numel].view(shape)

    def _bind_grads(self) -> None:
        """Stages 0/1 accumulate straight into the flat gradient buffer, like DDP's
        ``gradient_as_bucket_view``; stages 2/3 leave ``.grad`` to autograd between hooks."""
        if self.grad_full is None:
            return
        for p, slot, shape in zip(self.params, self.layout.slots, self.shapes, strict=True):
            p.grad = self.grad_full[slot.offset : slot.offset + slot.numel].view(shape)

    def grad_view(self, index: int) -> torch.Tensor:
        assert self.grad_full is not None
        slot = self.layout.slots[index]
        return self.grad_full[slot.offset : slot.offset + slot.numel].view(self.shapes[index])

    @property
    def numel(self) -> int:
        return self.layout.padded_total

    @property
    def grad_store(self) -> GradStore | None:
        """Where the gradient shard lives between reductions, when its store keeps it in a
        file (NVMe optimizer offload, stages 2/3); None while in memory."""
        return self.store.grads

    @property
    def full_nbytes(self) -> int:
        return self._full_nbytes

    # -- stage 3 gather / release ---------------------------------------------------------------

    # [Note: hpZ's secondary shard]
    # With ``zero_hpz_partition_size`` P, the first release after a gather from the primary
    # shards (the forward's, over every rank) keeps this rank's 1/P of the full parameters:
    # its secondary shard, shared with the P ranks of its machine. Until the shards change
    # (the optimizer step, a checkpoint load: ``drop_secondary``) every gather, the
    # backward's and the next micro-batch's forward, all-gathers the secondary shards inside
    # the machine instead. They hold exactly the values the first gather produced (with qwZ,
    # the rounded ones), so backward computes with the forward's weights. The copy is a
    # transient of the step (the meter's, like the gathered parameters), not resident state.

    def gather(self, async_op: bool = True) -> None:
        if self.state is not ShardState.SHARDED:
            return
        self._full.untyped_storage().resize_(self._full_nbytes)
        self.meter.alloc(self._full_nbytes)
        self._as_built = False
        src = self.store.for_gather(self.shard, self.device)
        if self._secondary is not None:
            self._gather = self.transport.gather_secondary(self._full, self._secondary, async_op)
        else:
            self._gather = self.transport.gather(self._full, src, async_op)
            self.meter.alloc(self._gather.scratch)
        self.state = ShardState.GATHERING

    def wait_gathered(self) -> None:
        if self.state is ShardState.GATHERING:
            assert self._gather is not None
            self._gather.complete()
            self.meter.free(self._gather.scratch)
            self._gather = None
            self.store.after_gather()
            self._bind_params()
            self.state = ShardState.GATHERED
        if self.state is not ShardState.GATHERED:
            raise RuntimeError("wait_gathered() on a group that was never gathered")

    def release(self) -> None:
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.GATHERING:
            self.wait_gathered()
        secondary = self.transport.secondary
        if secondary is not None and self._secondary is None and not self._as_built:
            parts = self._full.view(secondary.world_size, -1)
            self._secondary = parts[secondary.rank].clone()
            self.meter.alloc(_nbytes(self._secondary))
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty
        self._full.untyped_storage().resize_(0)
        if not self._as_built:
            self.meter.free(self._full_nbytes)
        self._as_built = False
        self.state = ShardState.SHARDED

    # -- gradients ------------------------------------------------------------------------------

    def begin_backward(self) -> None:
        self._ready = 0
        self._launched = False

    def mark_ready(self, index: int) -> bool:
        """Record that parameter ``index`` got its gradient in this backward; True when every
        trainable parameter of the group has.

        Stages 2/3 move the gradient into the group's bucket right away and free ``.grad``
        (DeepSpeed's ``contiguous_gradients``): peak memory holds at most the buckets being
        filled, and the copy happens while the gradient is still hot in cache. Under
        ``no_sync`` the bucket outlives the backward and later gradients are added to it.
        """
        self.grad_seen[index] = 1.0
        if self.policy.shard_grads:
            self._absorb(index)
        self._ready += 1
        return self._ready >= len(self.params)

    @property
    def all_ready(self) -> bool:
        return self._ready >= len(self.params)

    def launch_reduce(self, scaling: GradScaling) -> Reduction | None:
        """Start the (async) reduction of this backward's gradients; None when there is
        nothing to reduce (a frozen group, or one already launched in this backward)."""
        if not self.trainable or self._launched:
            return None
        self._launched = True
        held = 0  # bytes the reduction frees when it completes
        if self.policy.shard_grads:
            if self.grad_store is None:
                self.ensure_grad_shard()
            full = self._take_bucket()
            held = _nbytes(full)
        else:
            assert self.grad_full is not None
            full = self.grad_full
        if scaling.pre != 1.0:
            full.div_(scaling.pre)
        rdt = self.precision.reduce_dtype
        send = full
        if full.dtype != rdt:  # communication_data_type differs from the gradients' dtype
            send = full.to(rdt)
            self.meter.alloc(_nbytes(send))
            self.meter.free(held)  # a bucket is dropped once converted
            held = _nbytes(send)
        del full
        assert self.grad_shard is not None
        if not self.policy.shard_optimizer:  # stage 0: all-reduce the whole buffer
            assert self.grad_full is not None
            work = self.comm.all_reduce(send, async_op=True)
            fold = Fold.IN_PLACE if send is self.grad_full else Fold.REPLACE
            return Reduction(self, work, send, send, self.grad_full, fold, scaling.post, held)
        if self.policy.shard_grads and self._shard_empty and send.dtype == self.grad_shard.dtype:
            # the first reduction since zero_grad writes straight into the gradient shard
            self._shard_empty = False
            out, fold = self.ensure_grad_shard(), Fold.IN_PLACE
        else:
            if self.grad_store is not None:  # the earlier micro-steps' sum, read meanwhile
                self.grad_store.prefetch()
            out = torch.empty(self.shard.numel(), dtype=rdt, device=self.device)
            self.meter.alloc(_nbytes(out))
            held += _nbytes(out)
            fold = Fold.ADD if self.policy.shard_grads else Fold.REPLACE
        work = self.transport.reduce(out, send)
        self.meter.alloc(work.scratch_nbytes)  # gloo's receive buffer
        held += work.scratch_nbytes
        return Reduction(self, work, send, out, self.grad_shard, fold, scaling.post, held)

    def before_fold(self) -> None:
        """A reduction of this group is about to land in the gradient shard."""
        if self.grad_store is not None:
            self.ensure_grad_shard()

    def reduction_done(self, reduction: Reduction) -> None:
        """A reduction of this group completed (``Reduction.complete``)."""
        self.meter.free(reduction.held)
        if reduction.fold is Fold.REPLACE:  # the slice holds the averaged result now
            self._accumulation_form = False
        if self.grad_store is not None and self.grad_store.held:
            self.grad_store.put_away(self._sq_norm(self.ensure_grad_shard()))

    def _bucket_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s slot in the full-size gradient bucket (allocated on first
        use; ``self._filled[index]`` says whether the slot holds a gradient yet)."""
        if self._bucket is None:
            self._bucket = torch.empty(
                self.layout.padded_total, dtype=self.dtype, device=self.device
            )
            self.meter.alloc(_nbytes(self._bucket))
            self._filled = [False] * len(self.params)
        slot = self.layout.slots[index]
        return self._bucket[slot.offset : slot.offset + slot.numel]

    def _absorb(self, index: int) -> None:
        p = self.params[index]
        if p.grad is None:
            return
        if self._bucket is None and self._can_adopt(p.grad):
            # a group of one parameter and no padding: the gradient itself is the bucket,
            # which saves a copy and a second full-size buffer (an embedding's, say)
            self._bucket = p.grad.detach().view(-1)
            self.meter.alloc(_nbytes(self._bucket))
            self._filled = [True]
            p.grad = None
            return
        dst = self._bucket_view(index)
        if self._filled[index]:
            dst.add_(p.grad.reshape(-1))
        else:
            dst.copy_(p.grad.reshape(-1))
            self._filled[index] = True
        self.meter.touch(_nbytes(p.grad))  # alive until this line
        p.grad = None

    def _can_adopt(self, grad: torch.Tensor) -> bool:
        return (
            len(self.params) == 1
            and self.layout.padding == 0
            and grad.dtype == self.dtype
            and grad.device == self.device
            and grad.is_contiguous()
            and grad._base is None  # owns its storage, all of it
            and grad.untyped_storage().nbytes() == _nbytes(grad)
        )

    def accumulated_grad(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient accumulated since the last reduction, not yet
        reduced, as a flat view the coming reduction reads (so changing it in place changes
        what is reduced): the flat gradient buffer under stages 0/1, the bucket under 2/3."""
        if self.grad_full is not None:
            return self.grad_view(index)
        self._absorb(index)
        view = self._bucket_view(index)
        if not self._filled[index]:
            view.zero_()
            self._filled[index] = True
        return view

    def _take_bucket(self) -> torch.Tensor:
        """The flat gradients of this group (zeros where no gradient arrived); the group
        starts a new bucket afterwards."""
        for i in range(len(self.params)):  # a .grad that bypassed the hook (set by hand)
            self._absorb(i)
        bucket, filled = self._bucket, self._filled
        self._bucket, self._filled = None, []
        if bucket is None:
            bucket = torch.zeros(self.layout.padded_total, dtype=self.dtype, device=self.device)
            self.meter.alloc(_nbytes(bucket))
            return bucket
        bucket[self.layout.total :].zero_()  # padding
        for slot, ok in zip(self.layout.slots, filled, strict=True):
            if not ok:
                bucket[slot.offset : slot.offset + slot.numel].zero_()
        return bucket

    # -- compressed reduction (core/compression/topk_reduce.py) ---------------------------------

    def take_local_grad(self) -> torch.Tensor:
        """This rank's accumulated, unreduced gradients of the whole group (flat, padded, read
        only): the flat buffer at stages 0/1, the bucket at stage 2 (kept until
        :meth:`set_reduced_grad`)."""
        if self.grad_full is not None:
            return self.grad_full
        self._local = self._take_bucket()
        return self._local

    def set_reduced_grad(
        self, entries: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None
    ) -> None:
        """This rank's reduced gradient slice from averaged sparse ``(indices, values)`` over
        the whole group (the entries outside the slice are ignored), or from a dense tensor
        over the whole (padded) group; ``None`` makes it NaN (an overflow on some rank: the
        step is skipped)."""
        assert self.grad_shard is not None
        self.ensure_grad_shard()
        if self._local is not None:
            self.meter.free(_nbytes(self._local))
            self._local = None
        self._shard_empty = False
        if entries is None:
            self.grad_shard.fill_(float("nan"))
            return
        lo, hi = self.layout.shard_range(self.rank)
        if isinstance(entries, torch.Tensor):
            self.grad_shard.copy_(entries[lo:hi])
            return
        indices, values = entries
        mine = (indices >= lo) & (indices < hi)
        self.grad_shard.zero_()
        self.grad_shard.index_add_(0, indices[mine] - lo, values[mine].to(self.grad_shard.dtype))

    def to_accumulation_form(self, scaling: GradScaling) -> None:
        """Stages 0/1, right after a reduction finished: make the flat buffer safe to keep
        accumulating into (several backward calls per optimizer step without ``no_sync``).

        The next reduction runs over the same buffer, so what was already reduced must enter
        it exactly once. Under all-reduce every rank holds the mean, which the next sum
        counts once per rank: already right. Under reduce-scatter, this rank's slice goes
        back to the unscaled sum and the other slices, already counted in their owners'
        results, are zeroed. ``to_final_form`` undoes the scaling before the step.
        """
        if not self.policy.shard_optimizer or self.grad_full is None or self.grad_shard is None:
            return
        lo, hi = self.layout.shard_range(self.rank)
        self.grad_full[:lo].zero_()
        self.grad_full[hi:].zero_()
        self.grad_shard.mul_(scaling.pre / scaling.post)
        self._accumulation_form = True

    def to_final_form(self, scaling: GradScaling) -> None:
        if self._accumulation_form:
            assert self.grad_shard is not None
            self.grad_shard.mul_(scaling.post / scaling.pre)
            self._accumulation_form = False

    def holds_grads(self) -> bool:
        """Whether a gradient reached any parameter of the group since :meth:`zero_grad`."""
        return bool(self.grad_seen.any())

    def zero_grad(self) -> None:
        self._drop_step_grad()
        self._pending_scale.clear()
        self._accumulation_form = False
        self._shard_empty = True
        self.grad_seen.zero_()
        if self.grad_shard is not None and self.policy.shard_grads:
            if self.transient_grads:
                self._drop_grads()
            elif self.grad_shard.untyped_storage().nbytes() > 0:
                self.grad_shard.zero_()
        if self.grad_full is not None:
            self.grad_full.zero_()
            self._bind_grads()  # the user may have set .grad to None meanwhile
        elif self.trainable:
            if self._bucket is not None:  # gradients kept by no_sync, never reduced
                self.meter.free(_nbytes(self._bucket))
            self._bucket, self._filled = None, []
            for p in self.params:
                p.grad = None

    # -- optimizer side ---------------------------------------------------------------------

    @property
    def step_params(self) -> torch.Tensor:
        """The flat tensor the optimizer updates: the fp32 master, else the shard itself."""
        return self.master if self.master is not None else self.shard

    def step_grad(self) -> torch.Tensor:
        """This rank's reduced gradients in the optimizer's dtype (an fp32 copy under mixed
        precision, made once per step and dropped by ``zero_grad``), scaled by any factor
        :meth:`scale_grads_by` deferred."""
        grad = self.ensure_grad_shard()
        if self._step_grad is not None:
            out = self._step_grad
        else:
            out = self._in_step_form(grad)
            if out is not grad:  # kept (offload on a GPU: the copy lands in host memory)
                self._step_grad = out
                self.meter.alloc(_nbytes(out))
        for factor in self._pending_scale:
            out.mul_(factor)
        self._pending_scale.clear()
        return out

    def scale_grads_by(self, factor: float) -> None:
        """Multiply the step's gradients by ``factor`` (unscaling, clipping). A gradient shard
        out in its file is not read for it: the factor is applied when the optimizer step
        brings the shard in (:meth:`step_grad`), the same multiplications in the same order."""
        if self._grads_in_file:
            self._pending_scale.append(factor)
        else:
            self.step_grad().mul_(factor)

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared L2 norm of :meth:`step_grad` (float64, summed over fp32 partial norms);
        a gradient shard out in its file gives the norm taken as it was put away."""
        if self._grads_in_file:
            assert self.grad_store is not None and not self._pending_scale
            return self.grad_store.sq  # (the norm is taken before scaling)
        return _sq_norm_of(self.step_grad())

    @property
    def _grads_in_file(self) -> bool:
        """The step's gradients are out in their file (neither the shard nor its copy in
        the optimizer's dtype is in memory)."""
        return self.grad_store is not None and self._step_grad is None and not self.grad_store.held

    def _in_step_form(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (this group's gradient shard) in the optimizer's dtype and device: itself,
        or a new copy."""
        target = self.step_params
        if grad.dtype == target.dtype and grad.device == target.device:
            return grad
        return grad.to(device=target.device, dtype=target.dtype)

    def _sq_norm(self, grad: torch.Tensor) -> torch.Tensor:
        """What :meth:`grad_sq_norm` returns for ``grad``, this group's gradient shard, without
        keeping a copy: the values :meth:`step_grad` would hold, normed the same way."""
        return _sq_norm_of(self._in_step_form(grad))

    def release_step_grads(self) -> None:
        """The optimizer step is done with this group's gradients (NVMe optimizer offload):
        free them now rather than at ``zero_grad``, so a step holds one group's at a time."""
        if self.grad_store is not None:
            self._drop_step_grad()
            self.grad_store.discard()

    def _drop_step_grad(self) -> None:
        if self._step_grad is not None:
            self.meter.free(_nbytes(self._step_grad))
            self._step_grad = None

    def sync_from_master(self) -> None:
        """After the optimizer step (or a load): the compute-dtype shard from the master."""
        if self.master is None:
            return
        if self.master.untyped_storage().nbytes() > 0 or self.master.numel() == 0:
            self.shard.copy_(self.master)
        elif self.store.master_in_file:  # NVMe offload: brought in, then this again
            self.store.sync_master()

    def consolidated(self, only_rank: int | None = None) -> torch.Tensor | None:
        """The whole flat buffer in fp32 from every rank's master (or shard); collective when
        sharded. With ``only_rank`` the buffer is gathered to that group rank alone and the
        others get None (no full-size buffer on them)."""
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

    def all_gather_after_step(self) -> Work:
        """Stages 1/2: every rank updated its slice; rebuild the full parameters."""
        if not self.policy.shard_optimizer:
            return Work(None)
        return self.comm.all_gather(self._full, self.shard, async_op=True)

    def full_tensor(self, index: int) -> torch.Tensor:
        """A view of parameter ``index`` in the full buffer (valid only while gathered)."""
        slot = self.layout.slots[index]
        return self._full[slot.offset : slot.offset + slot.numel].view(self.shapes[index])

    def drop_secondary(self) -> None:
        """The shards changed: the hpZ secondary shard is stale (see the note)."""
        if self._secondary is not None:
            self.meter.free(_nbytes(self._secondary))
            self._secondary = None

    # -- gradient shards that exist only during a step -----------------------------------------

    def free_grads(self) -> None:
        """[Note: gradient shards only during a step]
        Stages 2/3 keep a gradient shard per group (4 bytes per element of this rank's shard,
        in fp32): with parameter offload it is the one per-rank state that would still grow
        with the model while the parameters stream to disk. Here the shard's storage is
        freed, allocated (zeroed) when the first reduction of a step lands in it and freed
        again by ``zero_grad``: it costs nothing while the model is built or between steps,
        and is counted by the meter as a transient buffer while it exists."""
        assert self.policy.shard_grads and self.grad_shard is not None
        self._drop_grads()  # (never counted as transient: built before the meter's first count)
        self.transient_grads = True

    def ensure_grad_shard(self) -> torch.Tensor:
        """[Note: the gradient shard, from the first backward]
        Stages 2/3 allocate a group's gradient shard when the first reduction lands in it,
        not when the group is built: a model built and loaded (``load_weights``) holds its
        parameter shards alone until it trains, as with ``zero.Init`` and
        ``from_pretrained``. From then on it is resident, as the ZeRO formula counts it. With
        :meth:`free_grads` it is transient instead: allocated here at every step, dropped by
        ``zero_grad``. With a :attr:`grad_store` it is read back from its file."""
        assert self.grad_shard is not None
        if self.grad_store is not None:
            return self.grad_store.fill()
        storage = self.grad_shard.untyped_storage()
        if storage.nbytes() == 0 and self.grad_shard.numel() > 0:
            nbytes = _nbytes(self.grad_shard)
            storage.resize_(nbytes)
            self.grad_shard.zero_()
            if self.transient_grads:
                self.meter.alloc(nbytes)
            else:
                self.meter.set_resident(self.meter.resident + nbytes)
        return self.grad_shard

    def _drop_grads(self) -> None:
        assert self.grad_shard is not None
        if self.grad_store is not None:
            self.grad_store.discard()
            return
        storage = self.grad_shard.untyped_storage()
        if storage.nbytes() > 0 and self.transient_grads:
            self.meter.free(storage.nbytes())
        storage.resize_(0)

    def resident_bytes(self) -> dict[str, int]:
        param = self._full_nbytes if not self.policy.shard_params else 0
        if self.policy.shard_params:
            param += self.shard.untyped_storage().nbytes()
        if self.master is not None:
            param += self.master.untyped_storage().nbytes()
        grad = 0
        if self.grad_full is not None:
            grad = self.grad_full.untyped_storage().nbytes()
        elif self.grad_shard is not None and not self.transient_grads:  # else: the meter's
            grad = self.grad_shard.untyped_storage().nbytes()
        return {"params": param, "grads": grad}


def _sq_norm_of(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float32).double().square()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class GroupMaker:
    """What every flat group of one plan is built with: the shard group's ``comm``, the
    ``device`` and ``precision``, the plan's ``meter``, and ``store``, which gives each new
    group its own store (the default: on the device)."""

    comm: Comm
    device: torch.device
    precision: PrecisionPolicy
    meter: ModelStateMeter
    store: Callable[[], ShardStore] = DeviceStore

    def __call__(
        self,
        params: list[nn.Parameter],
        policy: GroupPolicy,
        *,
        trainable: bool = True,
        transport: Transport | None = None,
        unfilled: bool = False,
    ) -> FlatParamGroup:
        return FlatParamGroup(
            params,
            self.comm,
            policy,
            trainable=trainable,
            device=self.device,
            precision=self.precision,
            transport=transport,
            store=self.store(),
            meter=self.meter,
            unfilled=unfilled,
        )
