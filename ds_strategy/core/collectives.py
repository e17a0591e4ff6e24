"""Every call into ``torch.distributed`` goes through here.

[Note: byte accounting]
Each collective records the bytes *this rank sends* under the ring model that NCCL and gloo
both approximate: an all-reduce of M bytes sends 2(N-1)/N * M, a reduce-scatter or an
all-gather whose full (unsharded) buffer is M bytes sends (N-1)/N * M, a broadcast sends M
from the root. Counting in one place is what lets ``ZeroEngine.comm_report()`` compare the
stages with DDP honestly: a collective that bypassed this module would be invisible.

Each ``Comm`` also has a ``link``: ``"inter"`` when its group has ranks on more than one
machine, ``"intra"`` when it lies within one (set from ``core/topology.py`` by the engine that
builds it). All the bytes and blocked time of a group's collectives are filed under its link:
a ring over a group that spans machines runs at the pace of its slowest hops, and the
topology-aware collectives split a collective into groups that lie wholly on one side.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from .profiling.comms import CommsLogger, Timing
from .profiling.ranges import ranged
from .shm import Exchange
from .streams import StreamEvent, side_stream

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Comm", "init_process_group_from_env", "Lent", "Work"]

# torch 2.13 renamed the tensor collectives; keep working on older releases too.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Handle(Protocol):
    """What an async torch.distributed call returns: ``wait()`` blocks until it is done."""

    def wait(self) -> object: ...


class Lent:
    """[Note: a collective's buffers outlive its wait]
    Gloo runs a collective on a worker thread that holds the tensors it was given; it marks
    the work done (``wait()`` returns) and only then, when that thread next runs, drops its
    references. A buffer the engine lets go of right after ``wait()`` therefore stays alive
    for as long as the worker thread waits for a core, which on a loaded machine is
    milliseconds: how many full-size gradient buckets are alive when ``backward()`` returns
    then depends on thread scheduling, not on the configuration. For an asynchronous
    collective ``Lent`` takes each CPU tensor's reference count before it is issued and
    :meth:`settle` (run by ``Work.wait``) yields the core until the collective's references
    are gone, so every buffer is free when ``wait()`` returns, whatever the scheduling. A
    synchronous collective's buffers belong to its caller, which keeps them past the call.
    Device tensors are left alone: there the allocator's streams decide when memory is
    reused (``core/streams.py``).
    """

    # a worker thread that has not let go after this long is not waited for again
    PATIENCE = 0.25
    enabled = True

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self._marks = (
            [(t, _holders(t)) for t in tensors if t is not None and t.device.type == "cpu"]
            if Lent.enabled
            else []
        )

    def settle(self) -> None:
        """Return once the collective holds none of the tensors (see the note). Something
        that holds them far longer than a thread waits for a core (a wrapping process group,
        a debugging mode) turns the waiting off for the process, with a warning, rather
        than cost every collective ``PATIENCE``."""
        marks, self._marks = self._marks, []
        deadline = 0.0
        for t, base in marks:
            while _holders(t) > base:
                now = time.perf_counter()
                deadline = deadline or now + self.PATIENCE
                if now > deadline:
                    Lent.enabled = False
                    warnings.warn(
                        f"a collective still held its buffers {self.PATIENCE} s after it "
                        "completed; no longer waiting for them to be freed, so the memory "
                        "held right after backward may now depend on thread scheduling",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    return
                time.sleep(0)


_use_count = getattr(torch.Tensor, "_use_count", None)


def _holders(t: torch.Tensor) -> int:
    """References to the tensor ``t`` (not to other views of its storage: a buffer handed
    to a collective whole is held whole); 0 on a torch that cannot tell."""
    return 0 if _use_count is None else int(_use_count(t))


class Work:
    """A handle on in-flight collectives; ``wait()`` is idempotent. With a ``timer``
    (``wall_clock_breakdown``), the time ``wait()`` blocks is reported as ``timer(kind, s)``.

    ``then`` runs once every handle has completed (the local half of a collective built from
    several, see [Note: gloo's reduce-scatter and all-gather]); ``scratch`` is a buffer the
    collective writes into and ``then`` reads, dropped once ``then`` has run. ``timing``
    (the comms logger's, ``core/profiling/comms.py``) is called once it has all completed."""

    def __init__(
        self,
        handle: _Handle | Sequence[_Handle | None] | None,
        kind: str = "",
        timer: Callable[[str, float], None] | None = None,
        *,
        then: Callable[[], None] | None = None,
        scratch: torch.Tensor | None = None,
        timing: Timing | None = None,
        lent: Lent | None = None,
        event: StreamEvent | None = None,
    ) -> None:
        handles = list(handle) if isinstance(handle, Sequence) else [handle]
        self._handles = [h for h in handles if h is not None]
        self._kind = kind
        self._timer = timer if self._handles else None
        self._then = then
        self.scratch = scratch
        self._timing = timing
        self._lent = lent
        self._event = event

    @property
    def scratch_nbytes(self) -> int:
        return 0 if self.scratch is None else self.scratch.untyped_storage().nbytes()

    def wait(self) -> None:
        if self._handles:
            start = time.perf_counter()
            while self._handles:  # each dropped once done (it holds the collective's buffers)
                self._handles[0].wait()
                del self._handles[0]
            if self._lent is not None:
                self._lent.settle()
            if self._event is not None:  # the current stream reads the result after this
                self._event.wait()
                self._event = None
            if self._timer is not None:
                self._timer(self._kind, time.perf_counter() - start)
        if self._then is not None:
            then, self._then = self._then, None
            then()
        self.scratch = None
        if self._timing is not None:
            timing, self._timing = self._timing, None
            timing()

    @property
    def done(self) -> bool:
        return not self._handles and self._then is None and self._timing is None


@dataclass
class Comm:
    """A process group plus per-kind byte counters.

    ``group=None`` means the default group. With no initialised process group, ``Comm`` acts
    as a world of one: every collective is the identity, so single-process runs and unit
    tests use the same code path as distributed ones.
    """

    group: dist.ProcessGroup | None = None
    sent_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    sent_total: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # never reset
    # see core/timers.py: (kind, seconds blocked, link)
    wait_timer: Callable[[str, float, str], None] | None = None
    link: str = "intra"  # "inter" for a group spanning machines (see the module note)
    # bytes per link: since the last take_links(), and never reset
    link_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    link_total: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # a level of a hierarchical collective (core/hierarchical.py): its counts and blocked
    # time are the parent's too, under this level's link
    parent: Comm | None = field(default=None, repr=False)
    # told the bytes of scratch a composed collective allocates (> 0) and frees (< 0): the
    # engine's memory meter, for memory_report()["peak"]; a level without one tells its parent
    on_scratch: Callable[[int], None] | None = field(default=None, repr=False)
    # the config's comms_logger (core/profiling/comms.py), on the engine's group; a level or
    # sub-group logs into its parent's
    comms_logger: CommsLogger | None = field(default=None, repr=False)
    # reduce-scatters and all-gathers of CPU tensors through shared memory where every rank
    # of the group can map the others' files (core/shm.py); set by the engine from
    # topology.shared_memory for a group on one machine
    shared_memory: bool = False
    _backend: str | None = field(default=None, repr=False)
    _exchange: Exchange | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if self.active else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.active else 0

    @property
    def agreement(self) -> Comm:
        """The group whose ranks agree on a failure (``faults.agree``): this one, or, for a
        group that is part of a larger one it must not leave waiting (MiCS's shard group,
        ``core/mics.py``), that larger one."""
        return self

    def global_ranks(self) -> list[int]:
        """The global ranks of this group's members, in group-rank order."""
        if not self.active:
            return [0]
        return list(dist.get_process_group_ranks(self.group or dist.group.WORLD))

    def record(self, kind: str, nbytes: float) -> None:
        """Count bytes a collective made outside this class sent on this group (torch's
        tensor-parallel layers exchange activations through DTensor's own collectives). A
        comms logger counts it with its bytes but cannot time it: something else waits on it."""
        self._count(kind, nbytes)
        if self.comms_logger is not None:
            self.comms_logger.issue(kind, kind, int(nbytes), int(nbytes), self.world_size)

    def _count(self, kind: str, nbytes: float, link: str | None = None) -> None:
        link = link or self.link
        self.sent_bytes[kind] += int(nbytes)
        self.sent_total[kind] += int(nbytes)
        self.calls[kind] += 1
        self.link_bytes[link] += int(nbytes)
        self.link_total[link] += int(nbytes)
        if self.parent is not None:
            self.parent._count(kind, nbytes, link)

    def _issue(self, kind: str, op: str, msg: int, sent: float | None) -> Timing | None:
        """A collective of ``kind`` (torch's ``op``, ``msg`` bytes of message) is issued: its
        ``sent`` bytes are counted (None: this rank sends none, a broadcast's receiver) and,
        under the comms logger here or up the parents, the same bytes logged; the logger's
        timing comes back (see [Note: what the comms logger measures]), else None at the cost
        of an attribute test per group."""
        if sent is not None:
            self._count(kind, sent)
        comm: Comm | None = self
        while comm is not None:
            if comm.comms_logger is not None:
                n = self.world_size
                return comm.comms_logger.issue(kind, op, msg, int(sent or 0), n)
            comm = comm.parent
        return None

    @contextlib.contextmanager
    def holding(self, *buffers: torch.Tensor) -> Iterator[None]:
        """A collective built from several holds ``buffers`` (its own scratch, not its input
        or output) inside this block: their bytes are reported to ``on_scratch`` (here or up
        the parents) as allocated on entry and freed on exit."""
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        self._scratch(nbytes)
        try:
            yield
        finally:
            self._scratch(-nbytes)

    def _scratch(self, nbytes: int) -> None:
        if self.on_scratch is not None:
            self.on_scratch(nbytes)
        elif self.parent is not None:
            self.parent._scratch(nbytes)

    def receive_buffer(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a synchronous ``reduce_scatter`` of ``tensor`` holds besides it: gloo's
        receive buffer (see ``_composed``), as a stand-in of its size; nothing elsewhere."""
        return (tensor,) if self.world_size > 1 and self._composed(tensor) else ()

    def _work(
        self,
        handle: _Handle | None,
        kind: str,
        async_op: bool,
        start: float,
        timing: Timing | None = None,
        lent: Lent | None = None,
        event: list[StreamEvent | None] | None = None,
    ) -> Work:
        """Wrap a collective's handle; a synchronous one under a timer reports its time, and
        under the comms logger its ``timing`` now (an asynchronous one's: at completion).
        ``lent``: the buffers it was given, free when it is done (see ``Lent``); ``event``:
        where its side stream ends (``core/streams.py``), waited for with it."""
        if not async_op:
            if self.timed:
                self._timed(kind, time.perf_counter() - start)
            if timing is not None:
                timing()
            return Work(None)
        done = None if event is None else event[0]
        if not self.timed:
            return Work(handle, timing=timing, lent=lent, event=done)
        return Work(handle, kind, self._timed, timing=timing, lent=lent, event=done)

    def _timed(self, kind: str, seconds: float, link: str | None = None) -> None:
        if self.parent is not None:
            self.parent._timed(kind, seconds, link or self.link)
        elif self.wait_timer is not None:
            self.wait_timer(kind, seconds, link or self.link)

    @property
    def timed(self) -> bool:
        """Whether blocked time is recorded (here or by the parent)."""
        return self.wait_timer is not None or (self.parent is not None and self.parent.timed)

    def take_report(self) -> dict[str, int]:
        """Bytes sent per collective kind since the previous call, then reset."""
        report = dict(self.sent_bytes)
        report["total"] = sum(self.sent_bytes.values())
        self.sent_bytes.clear()
        self.calls.clear()
        return report

    def take_into(self, report: dict[str, int], prefix: str) -> None:
        """Add this group's report to another group's ``comm_report()``-style ``report``:
        its kinds under ``prefix``, its bytes to ``total`` and to their link's total."""
        own = self.take_report()
        report["total"] += own.pop("total")
        for link, n in self.take_links().items():
            report[link] += n
        report.update({f"{prefix}{k}": v for k, v in own.items()})

    def take_links(self) -> dict[str, int]:
        """``intra_machine`` / ``inter_machine``: bytes sent since the previous call by the
        link of the group they went on, then reset."""
        links = {f"{k}_machine": self.link_bytes.get(k, 0) for k in ("intra", "inter")}
        self.link_bytes.clear()
        return links

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: str = "sum",
        async_op: bool = False,
        kind: str = "all_reduce",
    ) -> Work:
        """``kind`` files the bytes under another name (``"control"`` for the small
        bookkeeping reductions, so they are not mistaken for gradient traffic)."""
        n = self.world_size
        if n == 1:
            return Work(None)
        msg = tensor.numel() * tensor.element_size()
        timing = self._issue(kind, "all_reduce", msg, 2 * (n - 1) / n * msg)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        start = time.perf_counter()
        lent = Lent(tensor) if async_op else None
        with side_stream("all_reduce", tensor, when=async_op) as event:
            handle = dist.all_reduce(tensor, op=red, group=self.group, async_op=async_op)
        return self._work(handle, kind, async_op, start, timing, lent, event)

    @ranged("reduce_scatter")
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Work:
        """Sum ``full`` across ranks; this rank receives chunk ``rank`` of it in ``out``.
        On gloo the work holds a receive buffer as large as ``full`` until it completes
        (``Work.scratch_nbytes``)."""
        n = self.world_size
        if n == 1:
            out.copy_(full)
            return Work(None)
        msg = full.numel() * full.element_size()
        timing = self._issue("reduce_scatter", "reduce_scatter", msg, (n - 1) / n * msg)
        start = time.perf_counter()
        if not self._composed(full):
            lent = Lent(out, full) if async_op else None
            with side_stream("reduce_scatter", out, full, when=async_op) as event:
                handle = _reduce_scatter(out, full, group=self.group, async_op=async_op)
            return self._work(handle, "reduce_scatter", async_op, start, timing, lent, event)
        exchange = self._shared((n - 1) * out.numel() * out.element_size())
        if exchange is not None:
            call = exchange.reduce_scatter(out, full)
            return self._settle(self._work(call, "reduce_scatter", True, start, timing), async_op)
        # every rank sends chunk r of its input to rank r; rank r sums what it received
        recv = torch.empty_like(full)
        lent = Lent(recv, full) if async_op else None
        handle = dist.all_to_all_single(recv, full, group=self.group, async_op=True)

        def add_up() -> None:
            torch.sum(recv.view(n, -1), 0, out=out)

        timer = self._timed if self.timed else None
        return self._settle(
            Work(
                handle,
                "reduce_scatter",
                timer,
                then=add_up,
                scratch=recv,
                timing=timing,
                lent=lent,
            ),
            async_op,
        )

    @ranged("all_gather")
    def all_gather(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        async_op: bool = False,
        kind: str = "all_gather",
    ) -> Work:
        """Fill ``full`` with every rank's ``shard``, in rank order (bytes filed under
        ``kind``)."""
        n = self.world_size
        if n == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return Work(None)
        msg = full.numel() * full.element_size()
        timing = self._issue(kind, "all_gather", msg, (n - 1) / n * msg)
        start = time.perf_counter()
        if not self._composed(full):
            lent = Lent(full, shard) if async_op else None
            with side_stream("all_gather", full, shard, when=async_op) as event:
                handle = _all_gather(full, shard, group=self.group, async_op=async_op)
            return self._work(handle, kind, async_op, start, timing, lent, event)
        exchange = self._shared(shard.numel() * shard.element_size())
        if exchange is not None:
            call = exchange.all_gather(full, shard)
            return self._settle(self._work(call, kind, True, start, timing), async_op)
        # each rank broadcasts its own chunk of the output
        lent = Lent(full, shard) if async_op else None
        chunks = full.view(n, -1)
        mine = chunks[self.rank]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        handles = [
            dist.broadcast(chunks[r], src=self._global(r), group=self.group, async_op=True)
            for r in range(n)
        ]
        timer = self._timed if self.timed else None
        return self._settle(Work(handles, kind, timer, timing=timing, lent=lent), async_op)

    def all_to_all(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        kind: str = "all_to_all",
        *,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
    ) -> None:
        """Chunk ``r`` of ``tensor`` to rank ``r``; ``out``'s chunk ``r`` from rank ``r``.

        Args:
            out: where the received chunks land, in rank order.
            tensor: the chunks to send, in rank order.
            kind: the name its bytes are filed under.
            out_splits: rows of ``out`` from each rank (default: equal chunks).
            in_splits: rows of ``tensor`` to each rank (default: equal chunks).
        """
        n = self.world_size
        if n == 1:
            out.copy_(tensor)
            return
        msg = tensor.numel() * tensor.element_size()
        sent = (n - 1) / n * msg
        if in_splits is not None:  # every row but those kept here
            row = msg // max(1, tensor.shape[0]) if tensor.shape[0] else 0
            sent = float((sum(in_splits) - in_splits[self.rank]) * row)
        timing = self._issue(kind, "all_to_all", msg, sent)
        start = time.perf_counter()
        dist.all_to_all_single(
            out,
            tensor,
            output_split_sizes=None if out_splits is None else list(out_splits),
            input_split_sizes=None if in_splits is None else list(in_splits),
            group=self.group,
        )
        self._work(None, kind, False, start, timing)

    def reduces_into_input(self, full: torch.Tensor) -> bool:
        """Whether :meth:`reduce_scatter` may be given, as ``out``, this rank's chunk of
        ``full`` itself: true where the collective has read all of ``full`` (into its receive
        buffer, the other ranks' files, a two-level copy) before it writes ``out``."""
        return self.world_size > 1 and self._composed(full)

    def _shared(self, nbytes: int) -> Exchange | None:
        """The group's shared-memory exchange, its areas at least ``nbytes`` (see [Note:
        collectives through shared memory]); None where the group keeps gloo. Collective the
        first time and whenever the areas grow: every rank asks at the same call."""
        if not self.shared_memory:
            return None
        ex = self._exchange
        if ex is not None and ex.fits(nbytes):
            return ex
        if ex is None:
            ex = Exchange.open(self, nbytes, _timeout_s(self.group))
        elif not ex.grow(nbytes):
            ex = None
        self._exchange, self.shared_memory = ex, ex is not None
        return ex

    @property
    def shared_memory_nbytes(self) -> int:
        """Bytes of this rank's shared-memory exchange (0 without one)."""
        return 0 if self._exchange is None else self._exchange.nbytes

    @staticmethod
    def _settle(work: Work, async_op: bool) -> Work:
        """A composed collective is always issued asynchronously; a synchronous call waits."""
        if not async_op:
            work.wait()
        return work

    def _composed(self, tensor: torch.Tensor) -> bool:
        """[Note: gloo's reduce-scatter and all-gather]
        Gloo's tensor reduce-scatter and all-gather are slow on CPU: measured on two ranks
        over loopback with 25 MB, ``reduce_scatter_single`` takes 43-49 ms and
        ``all_gather_single`` 15-37 ms, against 20-24 ms for an all-reduce that moves twice
        the bytes. The same results built from gloo's fast primitives take 12-18 ms (an
        all-to-all, then a local sum over ranks) and 8-9 ms (one broadcast per rank of its
        own chunk); with three ranks 18 vs 97 ms and 14 vs 26 ms. Each rank sends exactly
        the bytes of the ring algorithms, so the byte accounting is unchanged. The
        all-to-all needs a receive buffer as large as its input, which is why flat groups
        hold half a reduce bucket on gloo (``reduce_needs_scratch``). NCCL (and gloo with
        CUDA tensors) keep the native collectives."""
        return self.reduce_needs_scratch and tensor.device.type == "cpu"

    @property
    def reduce_needs_scratch(self) -> bool:
        """True where ``reduce_scatter`` allocates a receive buffer the size of its input."""
        if self._backend is None:
            self._backend = dist.get_backend(self.group) if self.active else ""
        return self._backend == "gloo"

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order (small Python objects between this job's own
        ranks: diagnostics, never checkpoint content)."""
        if self.world_size == 1:
            return [obj]
        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, full: torch.Tensor | None, shard: torch.Tensor, dst: int = 0) -> None:
        """Group rank ``dst`` receives every rank's ``shard`` into ``full``, in rank order
        (``full`` is ignored elsewhere, and may be None there)."""
        n = self.world_size
        if n == 1:
            assert full is not None
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return
        global_dst = self._global(dst)
        parts = None
        if self.rank == dst:
            assert full is not None
            parts = list(full.view(n, -1).unbind(0))
        msg = shard.numel() * shard.element_size()
        timing = self._issue("gather", "gather", n * msg, None if self.rank == dst else msg)
        start = time.perf_counter()
        dist.gather(shard, parts, dst=global_dst, group=self.group)
        self._work(None, "gather", False, start, timing)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast from group rank ``src`` (counted on the sender only)."""
        if self.world_size == 1:
            return
        msg = tensor.numel() * tensor.element_size()
        timing = self._issue("broadcast", "broadcast", msg, msg if self.rank == src else None)
        global_src = self._global(src)
        start = time.perf_counter()
        dist.broadcast(tensor, src=global_src, group=self.group)
        self._work(None, "broadcast", False, start, timing)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def _timeout_s(group: dist.ProcessGroup | None) -> float:
    """The process group's timeout in seconds (torch's default where it cannot tell)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        backend = pg._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.default_pg_timeout.total_seconds())


# -- creating groups: only core/layout.py calls these (see [Note: one rank layout] there) --------


def _create_group(ranks: list[int], backend: str | None = None) -> dist.ProcessGroup | None:
    """A process group over the global ``ranks``, created by its members only.

    Each rank builds just the groups it belongs to, in any order. ``backend``: another
    backend than the default group's (``"gloo"`` for a group of background threads).
    ``None`` (a world of one) when no process group exists.
    """
    if not dist.is_initialized():
        return None
    return dist.new_group(ranks, backend=backend, use_local_synchronization=True)


def _create_device_mesh(
    device_type: str,
    groups: list[dist.ProcessGroup],
    ranks: torch.Tensor,
    names: tuple[str, ...],
) -> DeviceMesh:
    """torch's ``DeviceMesh`` over groups already made, one per dimension.

    ``ranks`` holds the mesh's global ranks in its shape. The mesh creates no group of its
    own, so DTensor's collectives run on ``groups``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


def init_process_group_from_env(timeout_s: float | None = None) -> bool:
    """Initialise the default process group from ``torchrun`` / ``accelerate launch`` / SLURM
    variables when none exists. Returns True if this call created it.

    Backend: NCCL when CUDA is available, else gloo.
    """
    if not dist.is_available() or dist.is_initialized():
        return False
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        # SLURM launches one task per rank but sets only its own names.
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_PORT", "29500")
        if "MASTER_ADDR" not in env:
            raise RuntimeError(
                "SLURM job detected but MASTER_ADDR is not set: export MASTER_ADDR to the "
                "hostname of the first node (e.g. from `scontrol show hostnames`) before starting."
            )
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return False  # a plain single process: run as a world of one
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    restart = _restart_store(env, timeout)
    if restart is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        store, rank, world = restart
        dist.init_process_group(
            backend=backend, timeout=timeout, store=store, rank=rank, world_size=world
        )
    atexit.unregister(_destroy_at_exit)  # once, however many groups a process creates
    atexit.register(_destroy_at_exit)
    return True


def _destroy_at_exit() -> None:
    """Destroy the default group this package created, at interpreter exit, while Python is
    still whole, unless the program did. Left to exit-time destructors, gloo's worker threads can
    still hold work whose tensors then need the interpreter being torn down, and the process
    aborts ("terminate called without an active exception"), failing a run that had finished
    its work. Destroying a group is local to the process (no collective)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting: a failure here must not mask the exit
            dist.destroy_process_group()


def _restart_store(
    env: os._Environ[str], timeout: datetime.timedelta | None
) -> tuple[dist.Store, int, int] | None:
    """After a torchrun restart, a store namespace of this attempt's own.

    [Note: stale rendezvous keys]
    torchrun's agent keeps one store for the whole job and its workers join it with the
    same key prefix on every attempt, so the workers of a restarted group can read the
    addresses the failed attempt's workers published; a gloo group then tries to connect to
    a dead process (connection refused, or a hang). Prefixing the keys with the restart
    count gives each attempt a clean namespace on the same store.
    """
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    world = int(env["WORLD_SIZE"])
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=10),
    )
    prefixed = dist.PrefixStore(f"ds_strategy/attempt_{attempt}/", store)
    return prefixed, int(env["RANK"]), world


def distributed_available() -> bool:
    """Whether this torch build has ``torch.distributed`` at all."""
    return dist.is_available()


def backend_available(name: str) -> bool:
    """Whether this torch build has the backend ``name`` (``gloo``, ``nccl``, ``mpi``).

    Args:
        name: the backend, as ``init_process_group`` names it.
    """
    probe = getattr(dist, f"is_{name}_available", None)
    return bool(dist.is_available() and probe is not None and probe())


def is_distributed() -> bool:
    """Whether a default process group exists (without one, a world of one)."""
    return dist.is_available() and dist.is_initialized()


def world_rank() -> int:
    """This process's rank in the default group; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def destroy_default_group() -> None:
    """Destroy the default process group, if one exists. Local: no collective."""
    if is_distributed():
        dist.destroy_process_group()
