"""A group of parameters flattened into one padded buffer, sharded across ranks.

One composite serves every stage: a parameter half (``flat_params.py``) and a gradient half
(``flat_grads.py``), each picked when the group is built. What differs by stage is a
``GroupPolicy``:

=========  ==================  =====================  =====================================
stage      parameters          gradients              reduction
=========  ==================  =====================  =====================================
0          full, resident      ``FullGrads``          all-reduce at the accumulation boundary
1          full, resident      ``FullGrads``          reduce-scatter at the boundary
2          full, resident      ``ShardedGrads``       reduce-scatter every backward
3          shard only          ``ShardedGrads``       reduce-scatter every backward
=========  ==================  =====================  =====================================

A frozen group has no gradient half. The rest of the package talks to the composite, which
only hands each call to the half that owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..collectives import Comm, Work
from ..memory import ModelStateMeter
from ..precision.policy import PrecisionPolicy
from .flat_grads import FlatGrads, FullGrads, GradSpec, GradState
from .flat_params import FlatParams, GroupPolicy, ShardState
from .inflight import GradScaling, Reduction
from .layout import FlatLayout
from .sharded_grads import ShardedGrads
from .stores import DeviceStore, GradStore, ShardStore
from .transports import Transport

__all__ = [
    "FlatParamGroup",
    "GradScaling",
    "GradState",
    "GroupMaker",
    "GroupPolicy",
    "ShardState",
]


class FlatParamGroup:
    """Parameters of one dtype flattened into one buffer; this rank owns one contiguous slice.

    Built with everything it will use: ``comm`` (its layout, broadcasts and the post-step
    gathers), ``transport`` (how its gathers and reductions travel, plain over ``comm`` by
    default: see [Note: a group's transport] in transports.py), ``store`` (where its shard
    and master live: see [Note: a group's store] in stores.py) and ``meter`` (where its
    transient buffers are counted; a plan shares one among its groups).

    Args:
        params: the parameters, at least one, of one dtype.
        comm: the shard group.
        policy: what the stage keeps sharded.
        trainable: whether the optimizer steps them (else no gradient half).
        device: where the group computes (the first parameter's device by default).
        precision: the dtype policy.
        transport: how gathers and reductions travel.
        store: where the shard and the master live.
        meter: where transient buffers are counted.
        unfilled: built for values read into the shards later (``bind_unfilled``).
    """

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
        self.device = device or params[0].device
        self.meter = meter or ModelStateMeter()
        self.flat_params = FlatParams(
            params,
            comm,
            policy,
            trainable=trainable,
            device=self.device,
            precision=self.precision,
            transport=self.transport,
            store=self.store,
            meter=self.meter,
            unfilled=unfilled,
        )
        values = self.flat_params
        self.dtype, self.shapes, self.rank = values.dtype, values.shapes, values.rank
        self.layout: FlatLayout = values.layout
        self.shard, self.master = values.shard, values.master
        self.flat_grads = self._pick_grads() if trainable else None
        grads = self.flat_grads
        self.grad_full = grads.grad_full if grads is not None else None
        self.grad_shard = grads.grad_shard if grads is not None else None
        self.grad_seen = (
            grads.grad_seen if grads is not None else torch.zeros(len(params), dtype=torch.float64)
        )

    def _pick_grads(self) -> FlatGrads:
        """The gradient half: full (stages 0/1) or sharded (stages 2/3), chosen once."""
        v = self.flat_params
        spec = GradSpec(
            self.params,
            v.layout,
            v.rank,
            v.dtype,
            self.device,
            self.precision.reduce_dtype,
            self.meter,
            v.step_params,
        )
        if self.policy.shard_grads:
            return ShardedGrads(spec, reduce=self.transport.reduce, store=self.store)
        scatter = self.transport.reduce if self.policy.shard_optimizer else None
        return FullGrads(spec, comm=self.comm, scatter=scatter)

    def _grads(self) -> FlatGrads:
        if self.flat_grads is None:
            raise RuntimeError("a frozen flat group has no gradients")
        return self.flat_grads

    def _full_grads(self) -> FullGrads:
        grads = self._grads()
        assert isinstance(grads, FullGrads), "only stages 0/1 keep a flat gradient buffer"
        return grads

    def _sharded_grads(self) -> ShardedGrads:
        grads = self._grads()
        assert isinstance(grads, ShardedGrads), "only stages 2/3 keep a gradient shard alone"
        return grads

    # -- the parameter half -----------------------------------------------------------------

    @property
    def state(self) -> ShardState:
        return self.flat_params.state

    @property
    def numel(self) -> int:
        return self.layout.padded_total

    @property
    def full_nbytes(self) -> int:
        return self.flat_params.full_nbytes

    @property
    def step_params(self) -> torch.Tensor:
        """The flat tensor the optimizer updates: the fp32 master, else the shard itself."""
        return self.flat_params.step_params

    @property
    def _full(self) -> torch.Tensor:  # the full buffer (read by tests)
        return self.flat_params.full

    @property
    def _secondary(self) -> torch.Tensor | None:  # hpZ's secondary shard (read by tests)
        secondary = self.flat_params.secondary
        return secondary.tensor if secondary is not None else None

    def load_from_params(self) -> None:
        """Copy the parameters' current values into the flat buffer (see ``FlatParams``)."""
        self.flat_params.load_from_params()

    def broadcast_and_bind(self, src: int = 0) -> None:
        """Make rank ``src``'s values everyone's; bind parameters and gradients.

        Args:
            src: the group rank whose values every rank takes.
        """
        self.flat_params.broadcast_and_bind(src)
        if self.flat_grads is not None:
            self.flat_grads.bind()

    def bind_unfilled(self) -> None:
        """Stage 3, values read into the shards right after (see ``FlatParams``)."""
        self.flat_params.bind_unfilled()

    def load_shard(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Stage 3 filled from a weights file (see ``FlatParams.load_shard``).

        Args:
            read: ``read(index, start, stop)``: elements of parameter ``index``, flattened.
        """
        self.flat_params.load_shard(read)

    def gather(self, async_op: bool = True) -> None:
        """Stage 3: start gathering the full parameters.

        Args:
            async_op: leave the gather in flight (``wait_gathered`` completes it).
        """
        self.flat_params.gather(async_op)

    def wait_gathered(self) -> None:
        self.flat_params.wait_gathered()

    def release(self) -> None:
        self.flat_params.release()

    def sync_from_master(self) -> None:
        """After the optimizer step (or a load): the compute-dtype shard from the master."""
        self.flat_params.sync_from_master()

    def consolidated(self, only_rank: int | None = None) -> torch.Tensor | None:
        """The whole flat buffer in fp32 (see ``FlatParams.consolidated``).

        Args:
            only_rank: gather to this group rank alone; the others get None.
        """
        return self.flat_params.consolidated(only_rank)

    def all_gather_after_step(self) -> Work:
        """Stages 1/2: every rank updated its slice; rebuild the full parameters."""
        return self.flat_params.all_gather_after_step()

    def full_tensor(self, index: int) -> torch.Tensor:
        """A view of parameter ``index`` in the full buffer (valid only while gathered).

        Args:
            index: the parameter's position in the group.
        """
        return self.flat_params.full_tensor(index)

    def drop_secondary(self) -> None:
        """The shards changed: the hpZ secondary shard is stale."""
        self.flat_params.drop_secondary()

    # -- the gradient half ------------------------------------------------------------------

    @property
    def grad_store(self) -> GradStore | None:
        """Where the gradient shard lives between reductions, when its store keeps it in a
        file (NVMe optimizer offload, stages 2/3); None while in memory."""
        return self.store.grads

    @property
    def transient_grads(self) -> bool:
        """The gradient shard exists only during a step (``free_grads``)."""
        return self.flat_grads is not None and self.flat_grads.transient

    @property
    def all_ready(self) -> bool:
        return self._grads().all_ready

    def grad_view(self, index: int) -> torch.Tensor:
        """Stages 0/1: parameter ``index``'s view of the flat gradient buffer.

        Args:
            index: the parameter's position in the group.
        """
        return self._full_grads().grad_view(index)

    def begin_backward(self) -> None:
        self._grads().begin_backward()

    def mark_ready(self, index: int) -> bool:
        """Parameter ``index`` got its gradient in this backward; True once all have.

        Args:
            index: the parameter's position in the group.
        """
        return self._grads().mark_ready(index)

    def before_accumulate(self) -> None:
        """Autograd is about to add a gradient to one of the group's parameters (stage 1:
        see ``FullGrads.to_accumulation_form``)."""
        if self.flat_grads is not None:
            self.flat_grads.before_accumulate()

    def launch_reduce(self, scaling: GradScaling) -> Reduction | None:
        """Start this backward's reduction; None for a frozen group or one already launched.

        Args:
            scaling: how gradients are averaged.
        """
        return self.flat_grads.launch_reduce(scaling) if self.flat_grads is not None else None

    def accumulated_grad(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s gradient not reduced yet, as the next reduction reads it.

        Args:
            index: the parameter's position in the group.
        """
        return self._grads().accumulated_grad(index)

    def take_local_grad(self) -> torch.Tensor:
        """This rank's unreduced gradients, for a compressed exchange."""
        return self._grads().take_local_grad()

    def set_reduced_grad(
        self, entries: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None
    ) -> None:
        """This rank's reduced slice from a compressed exchange (``FlatGrads``).

        Args:
            entries: sparse ``(indices, values)``, a dense tensor, or None for NaN.
        """
        self._grads().set_reduced_grad(entries)

    def to_accumulation_form(self, scaling: GradScaling) -> None:
        """Stage 1, right after a reduction: the flat buffer can take more gradients.

        Args:
            scaling: how gradients are averaged.
        """
        self._grads().to_accumulation_form(scaling)

    def to_final_form(self, scaling: GradScaling) -> None:
        """Undo ``to_accumulation_form`` before the step.

        Args:
            scaling: how gradients are averaged.
        """
        self._grads().to_final_form(scaling)

    def holds_grads(self) -> bool:
        """Whether a gradient reached any parameter of the group since :meth:`zero_grad`."""
        return self.flat_grads is not None and self.flat_grads.holds_grads()

    def zero_grad(self) -> None:
        if self.flat_grads is not None:
            self.flat_grads.zero_grad()

    def step_grad(self) -> torch.Tensor:
        """This rank's reduced gradients in the optimizer's dtype."""
        return self._grads().step_grad()

    def scale_grads_by(self, factor: float) -> None:
        """Multiply the step's gradients by ``factor`` (unscaling, clipping).

        Args:
            factor: the multiplier.
        """
        self._grads().scale_grads_by(factor)

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared L2 norm of :meth:`step_grad` (float64)."""
        return self._grads().grad_sq_norm()

    def release_step_grads(self) -> None:
        """The optimizer step is done with this group's gradients (NVMe optimizer offload)."""
        self._grads().release_step_grads()

    def ensure_grad_shard(self) -> torch.Tensor:
        """This rank's gradient shard, in memory (allocated or read back as needed)."""
        return self._grads().ensure_grad_shard()

    def free_grads(self) -> None:
        """Stages 2/3: the gradient shard exists only during a step from now on."""
        self._sharded_grads().free_grads()

    def resident_bytes(self) -> dict[str, int]:
        grads = self.flat_grads.resident_bytes() if self.flat_grads is not None else 0
        return {"params": self.flat_params.resident_bytes(), "grads": grads}


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
