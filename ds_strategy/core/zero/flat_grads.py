"""A flat group's gradient half, picked once when the group is built.

=============  ======  ===============================================================
class          stages  gradients
=============  ======  ===============================================================
FullGrads      0, 1    the flat buffer autograd accumulates into, reduced at the
                       boundary (stage 0 all-reduces it, stage 1 reduce-scatters it)
ShardedGrads   2, 3    a full-size bucket per backward, reduce-scattered into this
                       rank's gradient shard (allocated at the first reduction; in a
                       file between reductions under NVMe optimizer offload;
                       in ``sharded_grads.py``)
=============  ======  ===============================================================

A frozen group has no gradient half. Whichever class a group has, it never asks which stage
it is in: the class is the choice.

[Note: gradient states]
A group's gradients are in one ``GradState``, changed only by the named transitions, each
asserting the states it starts from::

    EMPTY --gradient--> ACCUMULATING
    EMPTY, ACCUMULATING, REDUCED, ACCUMULATION_FORM --launch_reduce--> REDUCING
    EMPTY, ACCUMULATING, REDUCED --take_local_grad--> REDUCING    (a compressed exchange)
    REDUCING --reduction_done, set_reduced_grad--> REDUCED
    REDUCED --to_accumulation_form--> ACCUMULATION_FORM           (stage 1; carried out
                                                                   before the next gradient
                                                                   is added, if one is)
    ACCUMULATION_FORM --to_final_form--> REDUCED
    any --zero_grad--> EMPTY

A gradient arriving in REDUCED or ACCUMULATION_FORM leaves the state as it is: it is added
to what was reduced by the next reduction. So a sharded group's first reduction after
``zero_grad`` (from EMPTY or ACCUMULATING) writes straight into the gradient shard, and the
later ones add to it. Which parameters got a gradient in this backward (``all_ready``)
is bookkeeping of one backward, reset by ``begin_backward``.

Every transient buffer is held by this half in the group's meter (``memory.Held``): the
bucket, a reduction's converted input, output and receive buffer, the step's copy in the
optimizer's dtype, and a gradient shard that exists only during a step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from ..collectives import Comm
from ..memory import CountedBuffer, Held, ModelStateMeter
from .inflight import Fold, GradScaling, Reduction
from .layout import FlatLayout
from .stores import GradStore
from .transports import ReducePath

__all__ = ["FlatGrads", "FullGrads", "GradSpec", "GradState", "nbytes_of", "sq_norm_of"]


class GradState(enum.Enum):
    """Where a group's gradients stand (see [Note: gradient states])."""

    EMPTY = "empty"  # no gradient since zero_grad
    ACCUMULATING = "accumulating"  # local gradients, none reduced yet
    REDUCING = "reducing"  # a reduction (or a compressed exchange) in flight
    REDUCED = "reduced"  # reduced; the optimizer step may read them
    ACCUMULATION_FORM = "accumulation_form"  # stage 1: see FullGrads.to_accumulation_form


_LAUNCHABLE = (
    GradState.EMPTY,
    GradState.ACCUMULATING,
    GradState.REDUCED,
    GradState.ACCUMULATION_FORM,
)


@dataclass(frozen=True)
class GradSpec:
    """What either kind of gradient half is built from.

    Attributes:
        params: the group's parameters.
        layout: the group's flat layout.
        rank: this rank's place in the layout.
        dtype: the gradients' dtype (the parameters' compute dtype).
        device: where the group computes.
        reduce_dtype: the dtype gradients travel in.
        meter: where transient buffers are counted.
        step_like: the tensor the optimizer steps (its dtype and device).
    """

    params: list[nn.Parameter]
    layout: FlatLayout
    rank: int
    dtype: torch.dtype
    device: torch.device
    reduce_dtype: torch.dtype
    meter: ModelStateMeter
    step_like: torch.Tensor


class FlatGrads:
    """What full and sharded gradients share: their state, readiness and the step's view.

    ``grad_shard`` is this rank's slice of the reduced gradients; ``grad_full`` the flat
    buffer, where there is one.

    Args:
        spec: the group's parameters, layout, dtypes and meter.
    """

    grad_shard: torch.Tensor

    def __init__(self, spec: GradSpec) -> None:
        self.params, self.layout, self.rank = spec.params, spec.layout, spec.rank
        self.dtype, self.device, self.reduce_dtype = spec.dtype, spec.device, spec.reduce_dtype
        self.meter, self.step_like = spec.meter, spec.step_like
        self.shapes = [p.shape for p in spec.params]
        self.grad_seen = torch.zeros(len(spec.params), dtype=torch.float64)
        self.state = GradState.EMPTY
        self.grad_full: torch.Tensor | None = None  # the flat buffer (FullGrads)
        self.transient = False  # see ShardedGrads.free_grads
        self._ready = 0  # parameters that got their gradient in this backward
        self._launched = False  # this backward's reduction has started
        self._step_grad: CountedBuffer | None = None  # see step_grad
        self._pending_scale: list[float] = []  # see scale_grads_by

    # -- transitions ------------------------------------------------------------------------

    def _move(self, to: GradState, *start: GradState) -> GradState:
        """Go to ``to`` from one of ``start`` (asserted); returns the state left."""
        was = self.state
        assert was in start, f"gradients {was.name}: cannot go to {to.name}"
        self.state = to
        return was

    def _accumulated(self) -> None:
        """A gradient arrived: EMPTY -> ACCUMULATING (else unchanged, see the note)."""
        if self.state is GradState.EMPTY:
            self.state = GradState.ACCUMULATING

    def _begin_reducing(self) -> GradState:
        return self._move(GradState.REDUCING, *_LAUNCHABLE)

    # -- backward ---------------------------------------------------------------------------

    def bind(self) -> None:
        """Point the parameters' ``.grad`` where autograd accumulates (see ``FullGrads``).

        Sharded gradients leave ``.grad`` to autograd between the hooks.
        """

    def begin_backward(self) -> None:
        self._ready = 0
        self._launched = False

    def mark_ready(self, index: int) -> bool:
        """Record that parameter ``index`` got its gradient in this backward.

        Args:
            index: the parameter's position in the group.

        Returns:
            True when every parameter of the group has.
        """
        self._receive(index)
        self.grad_seen[index] = 1.0
        self._accumulated()
        self._ready += 1
        return self.all_ready

    def _receive(self, index: int) -> None:
        raise NotImplementedError

    def before_accumulate(self) -> None:
        """Autograd is about to add a gradient to one of the group's parameters."""

    @property
    def all_ready(self) -> bool:
        return self._ready >= len(self.params)

    def launch_reduce(self, scaling: GradScaling) -> Reduction | None:
        """Start the (async) reduction of this backward's gradients.

        Args:
            scaling: how gradients are averaged.

        Returns:
            The reduction in flight, or None when it already started in this backward.
        """
        if self._launched:
            return None
        self._launched = True
        return self._launch(scaling)

    def _launch(self, scaling: GradScaling) -> Reduction:
        raise NotImplementedError

    def _send(self, full: torch.Tensor, held: Held, pre: float) -> tuple[torch.Tensor, Held]:
        """``full`` divided by ``pre``, in the reduce dtype (a new buffer that takes the place
        of ``held``'s when ``communication_data_type`` differs), and what holds its bytes."""
        if pre != 1.0:
            full.div_(pre)
        if full.dtype == self.reduce_dtype:
            return full, held
        converted = self.meter.held()
        send = converted.take(full.to(self.reduce_dtype))
        held.drop()  # the gradients are dropped once converted
        return send, converted

    def before_fold(self) -> None:
        """A reduction of this group is about to land in the gradient shard."""

    def reduction_done(self, reduction: Reduction) -> None:
        """REDUCING -> REDUCED: a reduction completed (``Reduction.complete``).

        Args:
            reduction: the one that completed; its buffers are dropped here.
        """
        self._move(GradState.REDUCED, GradState.REDUCING)
        reduction.held.drop()

    def accumulated_grad(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient accumulated since the last reduction, not reduced.

        A flat view the coming reduction reads: changing it in place changes what is reduced.

        Args:
            index: the parameter's position in the group.
        """
        raise NotImplementedError

    def to_accumulation_form(self, scaling: GradScaling) -> None:
        """Right after a reduction finished: make the reduced gradients safe to add to.

        Args:
            scaling: how gradients are averaged.
        """

    def to_final_form(self, scaling: GradScaling) -> None:
        """Undo ``to_accumulation_form`` before the step.

        Args:
            scaling: how gradients are averaged.
        """
        assert self.state is not GradState.REDUCING, "to_final_form with a reduction in flight"

    # -- compressed reduction (core/compression) ---------------------------------------------

    def take_local_grad(self) -> torch.Tensor:
        """This rank's accumulated, unreduced gradients (flat, padded, read only).

        Until :meth:`set_reduced_grad`, a compressed exchange of them is in flight.
        """
        raise NotImplementedError

    def set_reduced_grad(
        self, entries: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None
    ) -> None:
        """REDUCING -> REDUCED: this rank's reduced slice from a compressed exchange.

        Args:
            entries: averaged sparse ``(indices, values)`` over the whole group (those
                outside the slice ignored), a dense tensor over the whole (padded) group, or
                None for NaN (an overflow on some rank: the step is skipped).
        """
        self.ensure_grad_shard()
        self._drop_taken()
        self._move(GradState.REDUCED, GradState.REDUCING)
        shard = self.grad_shard
        if entries is None:
            shard.fill_(float("nan"))
            return
        lo, hi = self.layout.shard_range(self.rank)
        if isinstance(entries, torch.Tensor):
            shard.copy_(entries[lo:hi])
            return
        indices, values = entries
        mine = (indices >= lo) & (indices < hi)
        shard.zero_()
        shard.index_add_(0, indices[mine] - lo, values[mine].to(shard.dtype))

    def _drop_taken(self) -> None:
        """What ``take_local_grad`` took is no longer needed."""

    # -- between steps ----------------------------------------------------------------------

    def holds_grads(self) -> bool:
        """Whether a gradient reached any parameter of the group since :meth:`zero_grad`."""
        return bool(self.grad_seen.any())

    def zero_grad(self) -> None:
        """Any state -> EMPTY."""
        self._drop_step_grad()
        self._pending_scale.clear()
        self.state = GradState.EMPTY
        self.grad_seen.zero_()
        self._clear()

    def _clear(self) -> None:
        raise NotImplementedError

    def ensure_grad_shard(self) -> torch.Tensor:
        """This rank's gradient shard, in memory."""
        return self.grad_shard

    @property
    def grad_store(self) -> GradStore | None:
        """Where the gradient shard lives between reductions, when in a file."""
        return None

    def resident_bytes(self) -> int:
        raise NotImplementedError

    # -- optimizer side ---------------------------------------------------------------------

    def step_grad(self) -> torch.Tensor:
        """This rank's reduced gradients in the optimizer's dtype.

        Under mixed precision that is an fp32 copy, made once per step and dropped by
        ``zero_grad``. Any factor :meth:`scale_grads_by` deferred is applied.
        """
        grad = self.ensure_grad_shard()
        if self._step_grad is not None:
            out = self._step_grad.tensor
        else:
            out = self._in_step_form(grad)
            if out is not grad:  # kept (offload on a GPU: the copy lands in host memory)
                self._step_grad = self.meter.counted(out)
        for factor in self._pending_scale:
            out.mul_(factor)
        self._pending_scale.clear()
        return out

    def scale_grads_by(self, factor: float) -> None:
        """Multiply the step's gradients by ``factor`` (unscaling, clipping).

        A gradient shard out in its file is not read for it. The factor is applied when the
        step brings the shard in (:meth:`step_grad`): the same products in the same order.

        Args:
            factor: the multiplier.
        """
        if self._grads_in_file:
            self._pending_scale.append(factor)
        else:
            self.step_grad().mul_(factor)

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared L2 norm of :meth:`step_grad` (float64, over fp32 partial norms).

        A gradient shard out in its file gives the norm taken as it was put away.
        """
        store = self.grad_store
        if store is not None and self._grads_in_file:
            assert not self._pending_scale
            return store.sq  # (the norm is taken before scaling)
        return sq_norm_of(self.step_grad())

    @property
    def _grads_in_file(self) -> bool:
        """Neither the shard nor its copy in the optimizer's dtype is in memory."""
        store = self.grad_store
        return store is not None and self._step_grad is None and not store.held

    def _in_step_form(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (the gradient shard) in the step's dtype and device: itself, or a copy."""
        target = self.step_like
        if grad.dtype == target.dtype and grad.device == target.device:
            return grad
        return grad.to(device=target.device, dtype=target.dtype)

    def release_step_grads(self) -> None:
        """The step is done with these gradients (NVMe optimizer offload): free them now.

        Rather than at ``zero_grad``, so that a step holds one group's at a time.
        """
        store = self.grad_store
        if store is not None:
            self._drop_step_grad()
            store.discard()

    def _drop_step_grad(self) -> None:
        if self._step_grad is not None:
            self._step_grad.drop()
            self._step_grad = None


class FullGrads(FlatGrads):
    """Stages 0/1: the flat gradient buffer, reduced at the accumulation boundary.

    Autograd accumulates straight into it, like DDP's ``gradient_as_bucket_view``.

    Args:
        spec: the group's parameters, layout, dtypes and meter.
        comm: the group's ranks (stage 0 all-reduces over them).
        scatter: stage 1's reduce-scatter into this rank's slice; None at stage 0.
    """

    def __init__(self, spec: GradSpec, *, comm: Comm, scatter: ReducePath | None) -> None:
        super().__init__(spec)
        self.comm = comm
        self.scatter = scatter
        self.flat = torch.zeros(spec.layout.padded_total, dtype=spec.dtype, device=spec.device)
        self.grad_full = self.flat
        lo, hi = spec.layout.shard_range(spec.rank)
        self.grad_shard = self.flat[lo:hi]
        self._deferred: GradScaling | None = None  # see to_accumulation_form
        # see [Note: a slot written by its first gradient]
        self._written = [True] * len(spec.params)
        self._holes = False  # some slot not written since zero_grad

    def bind(self) -> None:
        """Point each parameter's ``.grad`` at its view of the flat buffer."""
        for i, p in enumerate(self.params):
            p.grad = self.grad_view(i)

    def grad_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s view of the flat buffer, shaped like it (zeros where no
        gradient arrived since ``zero_grad``).

        Args:
            index: the parameter's position in the group.
        """
        view = self._slot(index)
        if not self._written[index]:
            view.zero_()
            self._written[index] = True
        return view

    def _slot(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s view of the flat buffer, whatever it holds."""
        slot = self.layout.slots[index]
        return self.flat[slot.offset : slot.offset + slot.numel].view(self.shapes[index])

    def _receive(self, index: int) -> None:
        """[Note: a slot written by its first gradient]
        ``zero_grad`` does not zero the flat buffer: it sets each ``.grad`` to None, and
        autograd hands the first gradient over as a new tensor, which is copied into the
        parameter's slot (``.grad`` then becomes the slot's view, and later gradients are
        added to it in place). Zeroing the buffer and adding the first gradient to the
        zeros read and wrote the whole buffer once more every step. A slot no gradient
        reached is zeroed before anything reads it (:meth:`_fill_holes`, :meth:`grad_view`).

        Autograd also replaces ``.grad`` when create_graph=True or after the user set it to
        None; such a gradient is added to the slot as well.
        """
        p = self.params[index]
        if p.grad is None:
            return
        view = self._slot(index)
        if p.grad.data_ptr() == view.data_ptr():
            return
        if self._written[index]:
            view.add_(p.grad)
        else:
            view.copy_(p.grad)
            self._written[index] = True
        self.meter.touch(nbytes_of(p.grad))  # autograd's tensor, alive until this line
        p.grad = view

    def _fill_holes(self) -> None:
        """Every slot holds its gradient or zeros, and ``.grad`` is its view: before the
        buffer is read whole. A ``.grad`` set by hand (no hook saw it) is taken in. The
        padding and gaps are zeroed too: a skipped step's NaN may have reached them."""
        if not self._holes:
            return
        self.flat[self.layout.total :].zero_()
        for lo, hi in self.layout.gaps():
            self.flat[lo:hi].zero_()
        for i in range(len(self.params)):
            self._receive(i)
        self.bind()
        self._holes = False

    def ensure_grad_shard(self) -> torch.Tensor:
        self._fill_holes()
        return self.grad_shard

    def _launch(self, scaling: GradScaling) -> Reduction:
        self._fill_holes()
        self._settle()
        self._begin_reducing()
        send, held = self._send(self.flat, self.meter.held(), scaling.pre)
        if self.scatter is None:  # stage 0: all-reduce the whole buffer
            work = self.comm.all_reduce(send, async_op=True)
            fold = Fold.IN_PLACE if send is self.flat else Fold.REPLACE
            return Reduction(self, work, send, send, self.flat, fold, scaling.post, held)
        if send is self.flat and self.scatter.comm.reduces_into_input(send):
            # this rank's slice of the sum lands in its own slice of the buffer
            work = self.scatter(self.grad_shard, send)
            post = scaling.post
            return Reduction(self, work, send, None, self.grad_shard, Fold.IN_PLACE, post, held)
        out = held.take(torch.empty(self.grad_shard.numel(), dtype=send.dtype, device=self.device))
        work = self.scatter(out, send)
        held.take_bytes(work.scratch_nbytes)  # gloo's receive buffer
        return Reduction(self, work, send, out, self.grad_shard, Fold.REPLACE, scaling.post, held)

    def accumulated_grad(self, index: int) -> torch.Tensor:
        self._settle()
        self._receive(index)  # a .grad no hook saw yet
        self._accumulated()
        return self.grad_view(index)

    def before_accumulate(self) -> None:
        self._settle()

    def to_accumulation_form(self, scaling: GradScaling) -> None:
        """REDUCED -> ACCUMULATION_FORM (stage 1): the buffer can take more backward passes.

        The next reduction runs over the same buffer, so what was already reduced must enter
        it exactly once. Under all-reduce (stage 0) every rank holds the mean, which the
        next sum counts once per rank: already right. Under reduce-scatter this rank's slice
        goes back to the unscaled sum, and the other slices, already counted in their
        owners' results, are zeroed. ``to_final_form`` undoes the scaling before the step.

        Deferred until something is about to add to the buffer (:meth:`before_accumulate`,
        from a hook that runs before autograd accumulates; :meth:`accumulated_grad`; another
        reduction): most often the step comes first, and then there is nothing to undo.

        Args:
            scaling: how gradients are averaged.
        """
        if self.scatter is not None:
            assert self.state is GradState.REDUCED, f"gradients {self.state.name}"
            self._deferred = scaling

    def _settle(self) -> None:
        """Carry out a deferred :meth:`to_accumulation_form`."""
        scaling, self._deferred = self._deferred, None
        if scaling is None:
            return
        self._move(GradState.ACCUMULATION_FORM, GradState.REDUCED)
        lo, hi = self.layout.shard_range(self.rank)
        self.flat[:lo].zero_()
        self.flat[hi:].zero_()
        self.grad_shard.mul_(scaling.pre / scaling.post)

    def to_final_form(self, scaling: GradScaling) -> None:
        """ACCUMULATION_FORM -> REDUCED; in any other state but REDUCING, nothing to undo.

        Args:
            scaling: how gradients are averaged.
        """
        super().to_final_form(scaling)
        self._deferred = None  # never carried out: the gradients are already final
        if self.state is GradState.ACCUMULATION_FORM:
            self._move(GradState.REDUCED, GradState.ACCUMULATION_FORM)
            self.grad_shard.mul_(scaling.post / scaling.pre)

    def take_local_grad(self) -> torch.Tensor:
        """The flat buffer itself."""
        self._fill_holes()
        self._settle()
        self._begin_reducing()
        return self.flat

    def _clear(self) -> None:
        self._deferred = None
        self._written = [False] * len(self.params)  # see the note in _receive
        self._holes = True
        for p in self.params:
            p.grad = None

    def resident_bytes(self) -> int:
        return self.flat.untyped_storage().nbytes()


def sq_norm_of(t: torch.Tensor) -> torch.Tensor:
    norm: torch.Tensor = torch.linalg.vector_norm(t, dtype=torch.float32)
    return norm.double().square()


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
