"""Stages 2/3's gradient half: a bucket per backward, reduce-scattered into this rank's
gradient shard (see [Note: gradient states] in flat_grads.py).

The shard is allocated at the first reduction that lands in it, and lives in a file between
reductions under NVMe optimizer offload.
"""

from __future__ import annotations

import torch

from ..memory import CountedBuffer, Held
from .flat_grads import FlatGrads, GradSpec, GradState, nbytes_of, sq_norm_of
from .inflight import Fold, GradScaling, Reduction
from .layout import FlatLayout
from .stores import GradStore, ShardStore
from .transports import ReducePath

__all__ = ["ShardedGrads"]


class _Bucket:
    """Full-size gradients of one group not reduced yet, counted while held.

    ``filled[i]`` says whether parameter ``i``'s slot holds a gradient yet.
    """

    def __init__(self, buffer: CountedBuffer, filled: list[bool]) -> None:
        self.buffer = buffer
        self.filled = filled

    def slot(self, layout: FlatLayout, index: int) -> torch.Tensor:
        s = layout.slots[index]
        return self.buffer.tensor[s.offset : s.offset + s.numel]

    def complete(self, layout: FlatLayout) -> torch.Tensor:
        """The flat gradients, zeros in the padding and where no gradient arrived."""
        flat = self.buffer.tensor
        flat[layout.total :].zero_()
        for lo, hi in layout.gaps():
            flat[lo:hi].zero_()
        for s, ok in zip(layout.slots, self.filled, strict=True):
            if not ok:
                flat[s.offset : s.offset + s.numel].zero_()
        return flat


class ShardedGrads(FlatGrads):
    """Stages 2/3: a bucket per backward, reduce-scattered into this rank's gradient shard.

    Args:
        spec: the group's parameters, layout, dtypes and meter.
        reduce: the reduce-scatter path (the group's transport).
        store: the group's store (a gradient file, under NVMe optimizer offload).
    """

    def __init__(self, spec: GradSpec, *, reduce: ReducePath, store: ShardStore) -> None:
        super().__init__(spec)
        self.reduce = reduce
        self.store = store
        self._bucket: _Bucket | None = None
        self._transient: Held | None = None  # the shard's bytes, while transient
        self._taken: Held | None = None  # the bucket take_local_grad handed out
        lo, hi = spec.layout.shard_range(spec.rank)
        # see [Note: the gradient shard, from the first backward]
        self.grad_shard = torch.empty(hi - lo, dtype=spec.dtype, device=spec.device)
        self.grad_shard.untyped_storage().resize_(0)
        self._stale = False  # the shard holds the last step's sums, not zeros (see _clear)

    @property
    def grad_store(self) -> GradStore | None:
        """The gradient shard's file (NVMe optimizer offload); None while in memory."""
        return self.store.grads

    # -- the bucket ---------------------------------------------------------------------------

    def _receive(self, index: int) -> None:
        """Move the gradient into the bucket and free ``.grad``.

        As DeepSpeed's ``contiguous_gradients``: peak memory holds at most the buckets being
        filled, and the copy happens while the gradient is still hot in cache. Under
        ``no_sync`` the bucket outlives the backward and later gradients are added to it.
        """
        p = self.params[index]
        if p.grad is None:
            return
        if self._bucket is None and self._can_adopt(p.grad):
            # a group of one parameter and no padding: the gradient itself is the bucket,
            # which saves a copy and a second full-size buffer (an embedding's, say)
            self._bucket = _Bucket(self.meter.counted(p.grad.detach().view(-1)), [True])
            p.grad = None
            return
        bucket = self._open_bucket()
        dst = bucket.slot(self.layout, index)
        if bucket.filled[index]:
            dst.add_(p.grad.reshape(-1))
        else:
            dst.copy_(p.grad.reshape(-1))
            bucket.filled[index] = True
        self.meter.touch(nbytes_of(p.grad))  # alive until this line
        p.grad = None

    def _open_bucket(self) -> _Bucket:
        if self._bucket is None:
            flat = torch.empty(self.layout.padded_total, dtype=self.dtype, device=self.device)
            self._bucket = _Bucket(self.meter.counted(flat), [False] * len(self.params))
        return self._bucket

    def _can_adopt(self, grad: torch.Tensor) -> bool:
        return (
            len(self.params) == 1
            and self.layout.padding == 0
            and grad.dtype == self.dtype
            and grad.device == self.device
            and grad.is_contiguous()
            and grad._base is None  # owns its storage, all of it
            and grad.untyped_storage().nbytes() == nbytes_of(grad)
        )

    def _take_bucket(self) -> tuple[torch.Tensor, Held]:
        """This backward's flat gradients, and what holds their bytes; a new bucket starts."""
        for i in range(len(self.params)):  # a .grad that bypassed the hook (set by hand)
            self._receive(i)
        bucket, self._bucket = self._bucket, None
        if bucket is None:
            held = self.meter.held()
            flat = held.take(
                torch.zeros(self.layout.padded_total, dtype=self.dtype, device=self.device)
            )
            return flat, held
        return bucket.complete(self.layout), bucket.buffer.held

    def accumulated_grad(self, index: int) -> torch.Tensor:
        self._receive(index)
        self._accumulated()
        bucket = self._open_bucket()
        view = bucket.slot(self.layout, index)
        if not bucket.filled[index]:
            view.zero_()
            bucket.filled[index] = True
        return view

    # -- reduction ----------------------------------------------------------------------------

    def _launch(self, scaling: GradScaling) -> Reduction:
        first = self._begin_reducing() in (GradState.EMPTY, GradState.ACCUMULATING)
        store = self.grad_store
        # the first reduction since zero_grad writes straight into the gradient shard
        in_place = first and self.reduce_dtype == self.grad_shard.dtype
        if store is None:
            self.ensure_grad_shard(overwritten=in_place)
        bucket, held = self._take_bucket()
        send, held = self._send(bucket, held, scaling.pre)
        del bucket
        assert send.dtype == self.reduce_dtype
        if in_place:
            out, fold = self.ensure_grad_shard(overwritten=True), Fold.IN_PLACE
        else:
            if store is not None:  # the earlier micro-steps' sum, read meanwhile
                store.prefetch()
            out = held.take(
                torch.empty(self.grad_shard.numel(), dtype=send.dtype, device=self.device)
            )
            fold = Fold.ADD
        work = self.reduce(out, send)
        held.take_bytes(work.scratch_nbytes)  # gloo's receive buffer
        return Reduction(self, work, send, out, self.grad_shard, fold, scaling.post, held)

    def before_fold(self) -> None:
        if self.grad_store is not None:
            self.ensure_grad_shard()

    def reduction_done(self, reduction: Reduction) -> None:
        super().reduction_done(reduction)
        store = self.grad_store
        if store is not None and store.held:
            store.put_away(sq_norm_of(self._in_step_form(self.ensure_grad_shard())))

    def take_local_grad(self) -> torch.Tensor:
        """The bucket, held until :meth:`set_reduced_grad`."""
        self._begin_reducing()
        flat, self._taken = self._take_bucket()
        return flat

    def _drop_taken(self) -> None:
        if self._taken is not None:
            self._taken.drop()
            self._taken = None

    # -- the gradient shard -------------------------------------------------------------------

    def ensure_grad_shard(self, overwritten: bool = False) -> torch.Tensor:
        """[Note: the gradient shard, from the first backward]
        Stages 2/3 allocate a group's gradient shard when the first reduction lands in it,
        not when the group is built: a model built and loaded (``load_weights``) holds its
        parameter shards alone until it trains, as with ``zero.Init`` and
        ``from_pretrained``. From then on it is resident, as the ZeRO formula counts it. With
        :meth:`free_grads` it is transient instead: allocated here at every step, dropped by
        ``zero_grad``. With a :attr:`grad_store` it is read back from its file.

        ``zero_grad`` does not zero a resident shard: the first reduction after it overwrites
        the shard whole (``overwritten``, its in-place fold), and any other first use zeroes
        it here. That saves a write of the shard every step.

        Args:
            overwritten: the caller writes every element before anything reads one.
        """
        store = self.grad_store
        if store is not None:
            return store.fill()
        storage = self.grad_shard.untyped_storage()
        if storage.nbytes() == 0 and self.grad_shard.numel() > 0:
            nbytes = nbytes_of(self.grad_shard)
            storage.resize_(nbytes)
            self._stale = True
            if self.transient:
                self._transient = self.meter.held()
                self._transient.take_bytes(nbytes)
            else:
                self.meter.set_resident(self.meter.resident + nbytes)
        if self._stale and not overwritten:
            self.grad_shard.zero_()
        self._stale = False
        return self.grad_shard

    def free_grads(self) -> None:
        """[Note: gradient shards only during a step]
        Stages 2/3 keep a gradient shard per group (4 bytes per element of this rank's shard,
        in fp32): with parameter offload it is the one per-rank state that would still grow
        with the model while the parameters stream to disk. Here the shard's storage is
        freed, allocated (zeroed) when the first reduction of a step lands in it and freed
        again by ``zero_grad``: it costs nothing while the model is built or between steps,
        and is counted by the meter as a transient buffer while it exists."""
        self._drop_grads()  # (never counted as transient: built before the meter's first count)
        self.transient = True

    def _drop_grads(self) -> None:
        store = self.grad_store
        if store is not None:
            store.discard()
            return
        if self._transient is not None:
            self._transient.drop()
            self._transient = None
        self.grad_shard.untyped_storage().resize_(0)

    def _clear(self) -> None:
        if self.transient:
            self._drop_grads()
        elif self.grad_shard.untyped_storage().nbytes() > 0:
            self._stale = True  # zeroed or overwritten at its next use: ensure_grad_shard
        if self._bucket is not None:  # gradients kept by no_sync, never reduced
            self._bucket.buffer.drop()
        self._bucket = None
        for p in self.params:
            p.grad = None

    def resident_bytes(self) -> int:
        if self.transient:  # the meter's, while it exists
            return 0
        return self.grad_shard.untyped_storage().nbytes()
