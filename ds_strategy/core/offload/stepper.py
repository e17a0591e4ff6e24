"""The optimizer step with state on disk: bucket by bucket, read ahead and written behind.

[Note: why the step runs in buckets]
With NVMe offload the whole optimizer state never sits in memory at once. The pieces that
got a gradient are cut into buckets of at most ``buffer_size`` elements; for each bucket the
state tensors (and the group's fp32 master, when it is swapped) are read in, the user's
optimizer steps over just those pieces (every other piece has ``.grad = None``, so torch's
optimizers skip it, exactly as for a parameter without a gradient), and the state is
written back and freed. Bucket ``i + 1`` is read while bucket ``i`` steps, and bucket
``i - 1`` is written meanwhile; reads wait for writes so that at most ``buffer_count`` buckets
worth of elements are in memory at once (a piece larger than a bucket steps alone). Each
piece's hyper-parameters, step counter and update are those of a single full step, so the
weights are the same as without offload.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..memory import ModelStateMeter
from ..optim.state import per_element
from .swap import SwapDir, SwappedTensor

if TYPE_CHECKING:  # the offload tier works on zero's groups without importing zero
    from ..zero.flat_group import FlatParamGroup
    from ..zero.optimizer import ShardedOptimizer

__all__ = ["BucketedStep", "StateSwaps"]


class StateSwaps:
    """The optimizer's per-element state tensors (Adam's moments) of every piece, in files."""

    def __init__(self, sharded_opt: ShardedOptimizer, swap_dir: SwapDir) -> None:
        self.optimizer: torch.optim.Optimizer = sharded_opt.optimizer
        self.pieces = sharded_opt.pieces
        self.swap_dir = swap_dir
        self.swaps: dict[int, dict[str, SwappedTensor]] = {}
        self.meter: ModelStateMeter | None = None  # the engine's meter (Offload.set_meter)

    def _per_element(self, i: int) -> dict[str, torch.Tensor]:
        t = self.pieces[i].tensor
        return per_element(self.optimizer.state.get(t, {}), t)

    def all(self) -> list[SwappedTensor]:
        return [s for d in self.swaps.values() for s in d.values()]

    def prefetch(self, idxs: list[int]) -> None:
        for i in idxs:
            for s in self.swaps.get(i, {}).values():
                s.prefetch()

    def acquire(self, idxs: list[int]) -> None:
        for i in idxs:
            for s in self.swaps.get(i, {}).values():
                s.acquire()

    def release(self, idxs: list[int], dirty: bool) -> list[SwappedTensor]:
        """Write back (when ``dirty``) and free; state the optimizer created meanwhile (its
        first step, or a checkpoint load) is adopted here. Returns the tensors released."""
        out: list[SwappedTensor] = []
        for i in idxs:
            mine = self.swaps.setdefault(i, {})
            for k, v in self._per_element(i).items():
                s = mine.get(k)
                if s is None or s.tensor is not v:
                    s = mine[k] = SwappedTensor(v, self._file(i, k), self.swap_dir.pool)
                    s.meter = self.meter
                    if self.meter is not None:  # made by the optimizer just now: count it
                        self.meter.touch(s.nbytes)
                s.release(dirty)
                out.append(s)
        return out

    def _file(self, i: int, key: str) -> Path:
        return self.swap_dir.file(f"state_{i}_{re.sub(r'[^A-Za-z0-9_]', '_', str(key))}")

    def new_in_file(
        self, i: int, key: str, like: torch.Tensor, dtype: torch.dtype
    ) -> SwappedTensor:
        """State ``key`` of piece ``i`` that is not there yet (a load into a new engine): zeros
        in a new sparse file, nothing in memory; the load writes it in place."""
        t = torch.empty_like(like, dtype=dtype, device="cpu")  # (untouched: no memory used)
        s = SwappedTensor.zeros_in_file(t, self._file(i, key), self.swap_dir.pool)
        self.swaps.setdefault(i, {})[key] = s
        s.meter = self.meter
        return s

    def acquire_all(self) -> None:
        idxs = list(self.swaps)
        self.prefetch(idxs)
        self.acquire(idxs)

    def release_all(self, dirty: bool) -> None:
        self.release(list(range(len(self.pieces))), dirty)

    def wait(self) -> None:
        for s in self.all():
            s.wait()


class BucketedStep:
    """Replaces ``optimizer.step()`` for a ``ShardedOptimizer`` whose state is swapped."""

    what = "NVMe offload (zero_optimization.offload_optimizer / offload_param)"
    instead = "offload to 'cpu' instead, or use another optimizer with NVMe"

    def __init__(
        self,
        sharded_opt: ShardedOptimizer,
        state: StateSwaps | None,
        group_swaps: dict[int, list[SwappedTensor]],
        bucket_numel: int,
        in_flight: int,
    ) -> None:
        self.sharded_opt = sharded_opt
        self.state = state
        self.group_swaps = group_swaps
        self.bucket_numel = max(1, bucket_numel)
        self.budget = self.bucket_numel * max(1, in_flight)  # elements resident at once

    def buckets(self) -> list[list[int]]:
        """Indices of the pieces with a gradient, cut into runs of <= ``bucket_numel`` elements
        (a larger piece is a bucket of its own)."""
        return self.sharded_opt.live_runs(self.bucket_numel)

    def _groups(self, bucket: list[int]) -> list[FlatParamGroup]:
        seen: dict[int, FlatParamGroup] = {}
        for i in bucket:
            g = self.sharded_opt.pieces[i].group
            seen.setdefault(id(g), g)
        return list(seen.values())

    def _prefetch(self, bucket: list[int]) -> None:
        for g in self._groups(bucket):
            for s in self.group_swaps.get(id(g), []):
                s.prefetch()
            if g.grad_store is not None:
                g.grad_store.prefetch()
        if self.state is not None:
            self.state.prefetch(bucket)

    def _numel(self, bucket: list[int]) -> int:
        return sum(self.sharded_opt.pieces[i].tensor.numel() for i in bucket)

    def step(self) -> None:
        pieces = self.sharded_opt.pieces
        buckets = self.buckets()
        sizes = [self._numel(b) for b in buckets]
        last_use = {id(g): b for b, bucket in enumerate(buckets) for g in self._groups(bucket)}
        held: set[int] = set()
        # buckets written behind and not yet freed: (elements, tensors)
        pending: collections.deque[tuple[int, list[SwappedTensor]]] = collections.deque()

        def drain(room: int) -> None:
            """Wait for the oldest writes until ``room`` more elements fit in the budget."""
            while pending and sum(n for n, _ in pending) + room > self.budget:
                for s in pending.popleft()[1]:
                    s.wait()

        fetched = -1  # the last bucket whose read has started
        for b, bucket in enumerate(buckets):
            if fetched < b:
                drain(sizes[b])
                self._prefetch(bucket)
            if b + 1 < len(buckets):  # read ahead while this bucket steps, if it fits
                drain(sizes[b] + sizes[b + 1])
                if sum(n for n, _ in pending) + sizes[b] + sizes[b + 1] <= self.budget:
                    self._prefetch(buckets[b + 1])
                    fetched = b + 1
            groups = self._groups(bucket)
            for g in groups:
                if id(g) not in held:
                    held.add(id(g))
                    for s in self.group_swaps.get(id(g), []):
                        s.acquire()
            if self.state is not None:
                self.state.acquire(bucket)
            for i in bucket:
                pieces[i].tensor.grad = pieces[i].grad()
            self.sharded_opt.optimizer.step()
            for i in bucket:
                pieces[i].tensor.grad = None
            written = self.state.release(bucket, dirty=True) if self.state is not None else []
            for g in groups:
                if last_use[id(g)] == b:
                    g.release_step_grads()  # (gradient shards in files: see runtime.py)
                    g.sync_from_master()
                    for s in self.group_swaps.get(id(g), []):
                        s.release(dirty=True)
                        written.append(s)
            pending.append((sizes[b], written))
        drain(self.budget + 1)
