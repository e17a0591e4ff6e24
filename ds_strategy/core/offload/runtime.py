"""``Offload``: the engine's one handle on the CPU and NVMe tiers.

Built from ``zero_optimization.offload_optimizer`` / ``offload_param``:

- ``cpu``: fp32 masters (and, for ``offload_param``, partitioned shards) in host memory; on a
  CPU-only machine nothing moves (``cpu.py``).
- ``nvme``: the same host tensors, plus swapping to files under ``nvme_path``: Adam's moments
  and the fp32 master shards (``offload_optimizer``), the partitioned parameter shards
  (``offload_param``, stage 3). The optimizer step then runs bucket by bucket (``stepper.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, cast

import torch

from ...config import OffloadConfig, UnsupportedConfigWarning, ZeroConfig
from ..memory import ModelStateMeter
from ..progress import Progress
from .cpu import HostStore
from .stepper import BucketedStep, StateSwaps
from .streaming import SwapFiles
from .swap import SwapDir, SwappedTensor, SwapState, check_nvme_path, drive_of

if TYPE_CHECKING:  # the offload tier works on zero's groups without importing zero
    from ..zero.flat_group import FlatParamGroup
    from ..zero.optimizer import ShardedOptimizer

__all__ = ["Offload"]


class Ranks(Protocol):
    """What the tier asks of the engine's ranks (a ``Comm``): how many, and an exchange."""

    @property
    def world_size(self) -> int: ...

    def all_gather_object(self, obj: object) -> list[object]: ...


# a rank's drive (drive_of) and the swap bytes it needs there
_DriveNeed = tuple[tuple[str, int] | None, int]

_STATE_PER_ELEMENT = {"SGD": 1, "Adagrad": 1, "RMSprop": 2, "Adadelta": 2, "Rprop": 2}


def _state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    n = _STATE_PER_ELEMENT.get(type(optimizer).__name__, 2)
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        n += 1
    return n


class _GatherOrder:
    """[Note: reading parameter shards ahead]
    Stage 3 gathers the units in the same order every step (forward, then backward in
    reverse). Each gather records which group followed the last two gathered; the next time
    the same two are gathered in a row, the read of the group that followed them starts on
    the I/O threads, so that shard is (mostly) in memory by the time its own gather asks for
    it. Two, not one: a group is followed by the next unit's in forward and by the previous
    unit's in backward, and the pair tells the directions apart. At most one shard is read
    ahead: one that its gather never asked for is freed when the next is read."""

    def __init__(self) -> None:
        self.prev: _SwappedParams | None = None
        self.last: _SwappedParams | None = None
        self.next_of: dict[tuple[int, int], _SwappedParams] = {}
        self.ahead: _SwappedParams | None = None  # read ahead, its gather not yet here

    def saw(self, store: _SwappedParams) -> None:
        if self.ahead is store:
            self.ahead = None
        if store is self.last:
            return
        if self.last is not None:
            self.next_of[(id(self.prev), id(self.last))] = store
        self.prev, self.last = self.last, store
        following = self.next_of.get((id(self.prev), id(store)))
        if following is None or following is store or following is self.ahead:
            return
        if self.ahead is not None:
            self.ahead.swap.unread()
        following.swap.prefetch()
        self.ahead = following


class NvmeStore(HostStore):
    """The ``ShardStore`` of a group under NVMe offload: in host memory as under CPU offload
    (``HostStore``) until the tier, once its swap directory is open, attaches the group's
    files here (``Offload._swap_out``): the partitioned shard's (read for each gather), the
    master's (brought in for ``sync_from_master``) and the gradient shard's."""

    kind = "nvme"

    def __init__(self, *, pin: bool, params: bool) -> None:
        super().__init__(pin=pin, params=params)
        self.params_file: _SwappedParams | None = None
        self.master_file: functools.partial[None] | None = None
        self.grads_file: _SwappedGrads | None = None

    @property
    def grads(self) -> _SwappedGrads | None:
        return self.grads_file

    @property
    def master_in_file(self) -> bool:
        return self.master_file is not None

    def for_gather(self, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.params_file is None:
            return super().for_gather(shard, device)
        return self.params_file.for_gather()

    def after_gather(self) -> None:
        if self.params_file is not None:
            self.params_file.after_gather()

    def sync_master(self) -> None:
        if self.master_file is not None:
            self.master_file()


class _SwappedParams:
    """A partitioned group's shard in a file between gathers (its ``NvmeStore``'s)."""

    def __init__(self, group: FlatParamGroup, swap: SwappedTensor, order: _GatherOrder) -> None:
        self.group, self.swap, self.order = group, swap, order

    def for_gather(self) -> torch.Tensor:
        shard = self.swap.acquire()
        self.order.saw(self)
        if self.group.device.type == "cpu":
            return shard  # released once the gather has landed
        out = shard.to(self.group.device)
        self.swap.release(dirty=False)
        return out

    def after_gather(self) -> None:
        if self.group.device.type == "cpu":
            self.swap.release(dirty=False)


class _SwappedGrads:
    """``GradStore`` of a group whose gradient shard lives in a file between reductions.

    [Note: gradient shards in files]
    With the optimizer state on NVMe (stages 2/3, host memory), a rank's gradient shard, 4
    bytes per element of its shard in fp32, would be the last per-rank state still growing
    with the model. Each group's shard is therefore in memory only while a reduction lands in
    it or the optimizer steps over it:

    - the first reduction of a step writes into a zeroed shard, the later ones (gradient
      accumulation) read the sum so far back (started when the reduction is launched) and add
      to it; either way the shard is written behind as soon as the reduction has landed, and
      its squared norm (the same fp32 pass as without offload) is kept;
    - the global norm sums those kept norms, so clipping and the overflow check read nothing;
    - unscaling and clipping factors wait on the group (``FlatParamGroup.scale_grads_by``)
      and are applied when the bucketed step reads the shard in, the same multiplications as
      without offload, so the weights are the same bit for bit;
    - the step frees each group's gradients after its last bucket (``release_step_grads``).

    Writes are behind: one group's write may run while the next group's reduction lands;
    putting a group away waits for the write before it, so at most two shards are in memory.
    A shard read back for anything else (a checkpoint of gradients, MiCS, a compressed
    exchange) stays in memory until the step: correct, only not bounded."""

    def __init__(self, swap: SwappedTensor, writes: list[SwappedTensor]) -> None:
        self.swap = swap
        self.writes = writes  # shared by the groups of one engine: the write in flight
        self.held = False
        self.has_data = False  # the file holds this step's sum so far
        self.sq = torch.zeros((), dtype=torch.float64)

    def fill(self) -> torch.Tensor:
        if not self.held:
            self.swap.acquire(read=self.has_data)
            if not self.has_data:
                self.swap.tensor.zero_()
            self.held = True
        return self.swap.tensor

    def prefetch(self) -> None:
        if not self.held and self.has_data:
            self.swap.prefetch()

    def put_away(self, sq: torch.Tensor) -> None:
        assert self.held
        self.sq = sq
        self.held, self.has_data = False, True
        for w in self.writes:
            w.wait()
        self.writes[:] = [self.swap]
        self.swap.release(dirty=True)

    def discard(self) -> None:
        self.swap.drop()
        self.held = self.has_data = False
        self.sq = torch.zeros((), dtype=torch.float64)


_OUT = (SwapState.ON_DISK, SwapState.WRITING)  # in their files, or on their way there


class Offload:
    """The offload tiers of one engine. ``place`` runs before the optimizer is built over the
    shards, ``attach`` after; ``None`` from :meth:`build` when nothing is offloaded."""

    def __init__(
        self,
        config: ZeroConfig,
        groups: list[FlatParamGroup],
        rank: int,
        comm: Ranks | None = None,
    ) -> None:
        zc = config.zero_optimization
        self.opt_cfg, self.param_cfg = zc.offload_optimizer, zc.offload_param
        self.groups: list[FlatParamGroup] = []
        self._index: dict[int, int] = {}  # id(group) -> its number in the swap files' names
        self.rank = rank
        self.swap_dir: SwapDir | None = None
        self.group_swaps: dict[int, list[SwappedTensor]] = {}
        self.grad_swaps: list[SwappedTensor] = []  # see [Note: gradient shards in files]
        self._grad_writes: list[SwappedTensor] = []
        self._order = _GatherOrder()
        self._writing: list[SwappedTensor] = []  # the latest groups' writes (streaming build)
        self.state: StateSwaps | None = None
        self.stepper: BucketedStep | None = None
        self.meter: ModelStateMeter | None = None  # see set_meter
        self.comm = comm  # see build and _sharing
        self._files: SwapFiles | None = None  # inside streamed()
        self._stale: set[int] = set()  # groups whose master a streamed load rewrote
        self.adopt(groups)

    @staticmethod
    def build(
        config: ZeroConfig, groups: list[FlatParamGroup], rank: int, comm: Ranks | None = None
    ) -> Offload | None:
        """The offload tier of ``config`` (None when nothing is offloaded). ``comm``: the
        engine's ranks, asked for their swap space when the directory's room is checked
        (ranks of one machine may share its drive); collective then."""
        zc = config.zero_optimization
        if zc.offload_optimizer.device == "none" and zc.offload_param.device == "none":
            return None
        if zc.offload_optimizer.ratio < 1.0:
            warnings.warn(
                f"zero_optimization.offload_optimizer.ratio={zc.offload_optimizer.ratio}: partial "
                "offload is not implemented, the whole optimizer state is offloaded; set ratio "
                "to 1.0 to silence this",
                UnsupportedConfigWarning,
                stacklevel=4,
            )
        return Offload(config, groups, rank, comm)

    @property
    def nvme_optimizer(self) -> bool:
        return self.opt_cfg.device == "nvme"

    @property
    def nvme_params(self) -> bool:
        return self.param_cfg.device == "nvme"

    def store(self) -> HostStore:
        """The store of a group about to be built (``FlatParamGroup(store=...)``): its master
        (and partitioned shard) are allocated in host memory from the start."""
        # Swapped tensors are resized as they come and go: plain host memory, never pinned.
        swapped = self.nvme_optimizer or self.nvme_params
        pin = (self.opt_cfg.pin_memory or self.param_cfg.pin_memory) and not swapped
        params = self.param_cfg.device != "none"
        if swapped:
            return NvmeStore(pin=pin, params=params)
        return HostStore(pin=pin, params=params)

    def adopt(self, groups: list[FlatParamGroup]) -> None:
        """Take groups as they are built (each with a store of :meth:`store`), and once the
        swap directory is open (:meth:`open_for_build`) write out at once what lives on disk.
        See [Note: the streaming build]."""
        for g in groups:
            if not isinstance(g.store, HostStore):
                raise ValueError("a group given to the offload tier was built without its store")
            self._index[id(g)] = len(self.groups)
            self.groups.append(g)
        if self.swap_dir is not None:
            self._swap_out(groups)

    # -- NVMe -------------------------------------------------------------------------------------

    @property
    def streams_build(self) -> bool:
        """[Note: the streaming build]
        With NVMe parameter offload (stage 3) the model is written out unit by unit while it
        is built: the engine opens the swap directory before the first unit
        (:meth:`open_for_build`), and each unit's parameter shards (and fp32 masters) go to
        their files as soon as the unit is sharded, before the next unit is materialised.
        The writes of one unit run while the next is built; a unit's writes must finish
        before the one after it starts its own, so a rank holds at most two units' shards
        whatever the model's size. Gradient shards hold no storage outside a step
        (``FlatParamGroup.free_grads``)."""
        return self.nvme_params

    def open_for_build(
        self,
        shard_bytes: int,
        trainable_numel: int,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None,
        checkpoint_marker: str,
    ) -> None:
        """Open the swap directory before the model is built, checking there is room for its
        ``shard_bytes`` of parameter shards and masters and, with the optimizer offloaded,
        for the state and gradients of this rank's ``trainable_numel`` elements: the optimizer's own count
        when it is built (Adam's two moments when it is a callable; :meth:`attach` checks the
        exact figure again), so a disk too small fails before gigabytes are written."""
        if self.nvme_optimizer:
            per = (
                _state_bytes_per_element(optimizer)
                if isinstance(optimizer, torch.optim.Optimizer)
                else 2
            )
            shard_bytes += (per + 1) * 4 * trainable_numel  # the state, and gradients (<= fp32)
        self._open(shard_bytes, checkpoint_marker)

    def _swapped_group_tensors(
        self, groups: list[FlatParamGroup]
    ) -> list[tuple[FlatParamGroup, str, torch.Tensor]]:
        out = []
        for g in groups:
            i = self._index[id(g)]
            if g.master is not None and (self.nvme_optimizer or self.nvme_params) and g.trainable:
                out.append((g, f"master_{i}", g.master))
            if self.nvme_params and g.policy.shard_params:
                out.append((g, f"param_{i}", g.shard))
        return out

    def _swap_out(self, groups: list[FlatParamGroup], progress: Progress | None = None) -> None:
        """Write the groups' swapped tensors behind, once the previous writes are done."""
        assert self.swap_dir is not None
        for s in self._writing:
            s.wait()
        self._writing = []
        for g, name, t in self._swapped_group_tensors(groups):
            if progress is not None:
                progress.advance()
            swap = SwappedTensor(t, self.swap_dir.file(name), self.swap_dir.pool)
            swap.meter = self.meter
            self.group_swaps.setdefault(id(g), []).append(swap)
            store = g.store
            assert isinstance(store, NvmeStore)
            if name.startswith("param_"):
                store.params_file = _SwappedParams(g, swap, self._order)
            else:
                store.master_file = functools.partial(self._sync_master, g)
            swap.release(dirty=True)
            self._writing.append(swap)
        for g in groups:
            if not (g.trainable and g.policy.shard_grads):
                continue
            if self._swaps_grads(g):
                g.free_grads()
                assert g.grad_shard is not None  # (a trainable group with sharded gradients)
                swap = SwappedTensor(
                    g.grad_shard,
                    self.swap_dir.file(f"grad_{self._index[id(g)]}"),
                    self.swap_dir.pool,
                )
                swap.drop()  # nothing to write: it starts empty
                swap.meter = self.meter
                self.grad_swaps.append(swap)
                assert isinstance(g.store, NvmeStore)
                g.store.grads_file = _SwappedGrads(swap, self._grad_writes)
            elif self.nvme_params and not g.transient_grads:
                g.free_grads()

    def _swaps_grads(self, g: FlatParamGroup) -> bool:
        """Gradient shards go to files with the optimizer state on NVMe, for groups whose
        shard is in host memory (a GPU's stays on the device)."""
        return (
            self.nvme_optimizer
            and g.trainable
            and g.policy.shard_grads
            and g.device.type == "cpu"
            and g.grad_store is None
        )

    def _key(self) -> tuple[OffloadConfig, str]:
        if self.nvme_optimizer:
            return self.opt_cfg, "zero_optimization.offload_optimizer.nvme_path"
        return self.param_cfg, "zero_optimization.offload_param.nvme_path"

    def _open(self, needed: int, checkpoint_marker: str) -> None:
        # one directory for both tiers: a rule of config/rules.py
        cfg, key = self._key()
        path = _nvme_path(cfg)
        sharing = self._sharing(path, needed)
        self.swap_dir = SwapDir(
            path, self.rank, needed, checkpoint_marker, key=key, sharing=sharing
        )

    def _sharing(self, path: str, needed: int) -> tuple[int, int] | None:
        """(bytes, ranks) of every rank of ``comm`` that swaps to the same drive as this one:
        each checking only its own need would pass while together they overfill the drive.
        Collective over ``comm``."""
        if self.comm is None or self.comm.world_size == 1:
            return None
        mine = drive_of(path)
        # each rank gives the pair below: all_gather_object returns them as objects
        everyone = cast("list[_DriveNeed]", self.comm.all_gather_object((mine, int(needed))))
        same = [n for drive, n in everyone if drive is not None and drive == mine]
        return sum(same), len(same)

    def _needed_bytes(
        self, optimizer: torch.optim.Optimizer | None, groups: list[FlatParamGroup]
    ) -> int:
        """Swap space for ``groups``' shards, masters and gradients, and the optimizer's
        state."""
        total = sum(t.numel() * t.element_size() for _, _, t in self._swapped_group_tensors(groups))
        total += sum(_nbytes(g.grad_shard) for g in groups if self._swaps_grads(g))
        if self.nvme_optimizer and optimizer is not None:
            per = _state_bytes_per_element(optimizer)
            total += sum(per * g.step_params.numel() * 4 for g in self.groups if g.trainable)
        return total

    def attach(self, sharded_opt: ShardedOptimizer | None, checkpoint_marker: str) -> None:
        """Open the swap directory (checking it first), swap out what lives on disk and is
        not out yet, and give the optimizer its bucketed step (``None``: no optimizer, as in
        inference). After a streaming build the directory is open: the room left is checked
        for what comes now (the optimizer state)."""
        if not (self.nvme_optimizer or self.nvme_params):
            return
        optimizer = sharded_opt.optimizer if sharded_opt is not None else None
        rest = [g for g in self.groups if id(g) not in self.group_swaps]
        if self.swap_dir is None:
            self._open(self._needed_bytes(optimizer, rest), checkpoint_marker)
        else:
            cfg, key = self._key()
            needed = self._needed_bytes(optimizer, rest)
            sharing = self._sharing(_nvme_path(cfg), needed)
            mine = self.swap_dir.path
            check_nvme_path(_nvme_path(cfg), needed, checkpoint_marker, key, sharing, mine)
        out = len(self._swapped_group_tensors(rest))
        progress = Progress("writing the model to nvme_path", out, self.rank, "tensors")
        self._swap_out(rest, progress)
        progress.done()
        if sharded_opt is None:
            self.wait()
            return
        cfg = self._key()[0]
        assert self.swap_dir is not None  # (opened above)
        self.state = StateSwaps(sharded_opt, self.swap_dir) if self.nvme_optimizer else None
        if self.state is not None:
            self.state.meter = self.meter
        self.stepper = BucketedStep(
            sharded_opt,
            self.state,
            self.group_swaps,
            bucket_numel=cfg.buffer_size,
            in_flight=cfg.buffer_count,
        )
        sharded_opt.stepper = self.stepper
        self.wait()

    def wait(self) -> None:
        for swaps in [*self.group_swaps.values(), self.grad_swaps]:
            for s in swaps:
                s.wait()
        if self.state is not None:
            self.state.wait()

    @contextlib.contextmanager
    def resident(self, dirty: bool, optimizer_state: bool = True) -> Iterator[None]:
        """Everything swapped is resident inside the block (an asynchronous checkpoint save,
        a consolidation); ``dirty``: it may have changed and is written back after.
        ``optimizer_state=False`` leaves the optimizer's state in its files (a consolidation
        of the weights needs only the parameter shards and masters)."""
        swaps = [s for ss in self.group_swaps.values() for s in ss]
        state = self.state if optimizer_state else None
        if self.swap_dir is None:
            yield
            return
        for s in swaps:
            s.prefetch()
        if state is not None:
            state.acquire_all()
        for s in swaps:
            s.acquire()
        try:
            yield
        finally:
            for s in swaps:
                s.release(dirty)
            if state is not None:
                state.release_all(dirty)
            self.wait()

    @contextlib.contextmanager
    def streamed(self, load: bool) -> Iterator[SwapFiles | None]:
        """A checkpoint save or load that reads and writes the swap files a piece at a time
        (see core/checkpoint/streamed.py, [Note: checkpoints that stream through the swap
        files]); yields what the checkpoint needs of the files, or None when nothing is swapped."""
        if self.swap_dir is None:
            yield None
            return
        self.wait()  # every file holds its tensor's bytes
        if load:  # masters in files are rewritten: their shards follow at sync_from_master
            self._stale = {id(g) for g in self.groups if g.store.master_in_file}
        swaps = [s for ss in self.group_swaps.values() for s in ss]
        swaps += self.state.all() if self.state is not None else []
        files = SwapFiles(swaps, self._new_state)
        self._files = files
        try:
            yield files
        finally:
            self._files = None
            self._stale = set()
            self.wait()

    def _new_state(
        self, index: int, key: str, like: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        if self.state is None:  # the optimizer state is in memory
            return torch.zeros_like(like, dtype=dtype)
        swap = self.state.new_in_file(index, key, like, dtype)
        assert self._files is not None
        self._files.add(swap)
        return swap.tensor

    def _sync_master(self, group: FlatParamGroup) -> None:
        """``FlatParamGroup.sync_from_master`` of a group whose master is in its file (after a
        streamed load rewrote it): master and shard in, copied, shard written back."""
        if id(group) not in self._stale:
            return  # the shard was copied from this master before it went out
        self._stale.discard(id(group))
        swaps = self.group_swaps.get(id(group), [])
        for s in swaps:
            s.prefetch()
        for s in swaps:
            s.acquire()
        try:
            group.sync_from_master()
        finally:
            for s in swaps:
                s.release(dirty=s.tensor is not group.master)

    def set_meter(self, meter: ModelStateMeter | None) -> None:
        """Count swapped bytes in ``meter`` (``alloc``/``free``) whenever they are back in
        memory: a shard read for its gather, a bucket of the step, a checkpoint's state."""
        self.meter = meter
        for swaps in [*self.group_swaps.values(), self.grad_swaps]:
            for s in swaps:
                s.meter = meter
        if self.state is not None:
            self.state.meter = meter
            for s in self.state.all():
                s.meter = meter

    @contextlib.contextmanager
    def viewable(self) -> Iterator[None]:
        """Inside the block, tensors that are out in their files have storage of their full
        size again, unread, so that views can be cut from them (the optimizer's pieces are
        views of the masters, built after a streaming build wrote them out); nothing in the
        block may read or write them. Untouched pages of a fresh allocation take no memory."""
        out = [s for ss in self.group_swaps.values() for s in ss if s.state is SwapState.ON_DISK]
        for s in out:
            s.tensor.untyped_storage().resize_(s.nbytes)
        try:
            yield
        finally:
            for s in out:
                s.tensor.untyped_storage().resize_(0)

    def is_swap_path(self, path: str | os.PathLike[str]) -> bool:
        return self.swap_dir is not None and self.swap_dir.contains(path)

    def report(self) -> dict[str, int]:
        """Bytes of this rank's state held in files (``offloaded_nvme``) and of swapped
        tensors back in host memory now (``swap_buffers``: a step's buckets, shards read for
        their gathers or read ahead, gradient shards being reduced into); an empty report
        without NVMe."""
        if self.swap_dir is None:
            return {}
        swaps = [s for ss in self.group_swaps.values() for s in ss] + list(self.grad_swaps)
        if self.state is not None:
            swaps += self.state.all()
        return {
            "offloaded_nvme": sum(s.nbytes for s in swaps if s.state in _OUT),
            "swap_buffers": sum(s.nbytes for s in swaps if s.state not in _OUT),
        }

    def close(self) -> None:
        """Finish the reads and writes under way, then remove the swap directory, even when
        one of them failed (its error is raised after)."""
        if self.swap_dir is not None:
            try:
                self.wait()
            finally:
                self.swap_dir.close()


def _nvme_path(cfg: OffloadConfig) -> str:
    # config/rules.py refuses device 'nvme' without nvme_path before any engine is built
    assert cfg.nvme_path is not None
    return cfg.nvme_path


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
