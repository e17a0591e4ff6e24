"""Counting memory: the engine's own high-water mark of model state (``ModelStateMeter``),
and, independent of any bookkeeping, the bytes of the tensors a process really holds
(``live_tensor_bytes``) at every point of a training step (``StepMemoryProbe``).

[Note: measuring where it hurts]
Model state is not constant through a step. Under ZeRO-2/3 full-size gradients exist only
between the moment autograd produces them and the moment their reduce-scatter completes;
ZeRO-3's parameters exist only while gathered; mixed precision adds an fp32 copy of the
gradient shard during the optimizer step. A figure taken once, after the step, sees none of
it. The meter is told of every such buffer by the object that holds it (a ``Held``, or a
``CountedBuffer`` for one tensor): its bytes are counted when taken and uncounted when
dropped, never paired by hand. The probe counts live tensors after forward, inside
backward (at every parameter's gradient hook), after backward, inside the optimizer step
and after it, so the two can be checked against each other and against the ZeRO formulas.
"""

from __future__ import annotations

import gc
import shutil
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from .memory_timeline import MemoryTimeline

__all__ = [
    "CountedBuffer",
    "Held",
    "ModelStateMeter",
    "StepMemoryProbe",
    "file_size_limit",
    "free_bytes",
    "human_bytes",
    "live_tensor_bytes",
]


class ModelStateMeter:
    """Model-state bytes of one rank: ``resident`` (parameters, gradient buffers, fp32
    masters and optimizer state, as ``memory_report`` counts them) plus ``transient``
    buffers (gathered ZeRO-3 parameters, full-size gradient buckets, reductions in flight,
    the step's fp32 gradient copies), with the high-water mark of their sum.

    >>> m = ModelStateMeter()
    >>> m.set_resident(100); m.alloc(40); m.free(40); m.peak
    140
    >>> m.reset_peak(); m.peak
    100
    """

    def __init__(self) -> None:
        self.resident = 0
        self.transient = 0
        self.peak = 0
        # the config's memory_timeline: told of every event below (core/memory_timeline.py)
        self.timeline: MemoryTimeline | None = None

    @property
    def current(self) -> int:
        return self.resident + self.transient

    def set_resident(self, nbytes: int) -> None:
        self.resident = int(nbytes)
        self.peak = max(self.peak, self.current)
        if self.timeline is not None:
            self._record("resident", nbytes)

    def alloc(self, nbytes: int) -> None:
        self.transient += int(nbytes)
        self.peak = max(self.peak, self.current)
        if self.timeline is not None:
            self._record("alloc", nbytes)

    def free(self, nbytes: int) -> None:
        self.transient -= int(nbytes)
        if self.timeline is not None:
            self._record("free", nbytes)

    def scratch(self, nbytes: int) -> None:
        """A composed collective's scratch (``Comm.holding``): allocated when ``nbytes`` > 0,
        freed when < 0."""
        if nbytes > 0:
            self.alloc(nbytes)
        else:
            self.free(-nbytes)

    def touch(self, nbytes: int) -> None:
        """A buffer the engine did not allocate but is about to free (a gradient autograd
        just produced): counted at this instant only."""
        self.peak = max(self.peak, self.current + int(nbytes))
        if self.timeline is not None:
            self._record("touch", nbytes, self.transient + int(nbytes))

    def reset_peak(self) -> None:
        self.peak = self.current

    def held(self) -> Held:
        """A new owner of transient bytes in this meter, holding none yet."""
        return Held(self)

    def counted(self, tensor: torch.Tensor) -> CountedBuffer:
        """``tensor`` as a transient buffer, counted from now until it is dropped.

        Args:
            tensor: the buffer just allocated.
        """
        return CountedBuffer(tensor, self)

    def _record(self, event: str, nbytes: int, transient: int | None = None) -> None:
        assert self.timeline is not None
        held = self.transient if transient is None else transient
        self.timeline.record(event, nbytes, resident=self.resident, transient=held, peak=self.peak)


class Held:
    """Transient bytes of one owner: counted when taken, uncounted together when dropped.

    The object that holds a buffer takes its bytes, so frees are never paired by hand.
    A collective in flight takes its input, output and receive buffer one by one and drops
    them at once when it completes.

    >>> meter = ModelStateMeter()
    >>> held = meter.held()
    >>> _ = held.take(torch.zeros(4)); held.take_bytes(8); meter.transient
    24
    >>> held.drop(); meter.transient, held.nbytes
    (0, 0)
    """

    def __init__(self, meter: ModelStateMeter) -> None:
        self.meter = meter
        self.nbytes = 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor``'s bytes as this owner's; returns ``tensor``.

        Args:
            tensor: a buffer this owner keeps alive from now on.
        """
        self.take_bytes(tensor.numel() * tensor.element_size())
        return tensor

    def take_bytes(self, nbytes: int) -> None:
        """Count ``nbytes`` more (a storage grown in place, a collective's scratch).

        Args:
            nbytes: how many bytes; 0 is recorded too.
        """
        self.nbytes += int(nbytes)
        self.meter.alloc(nbytes)

    def drop(self) -> None:
        """Uncount every byte taken, in one event, and hold none."""
        self.meter.free(self.nbytes)
        self.nbytes = 0


class CountedBuffer:
    """One transient tensor and the bytes it holds in a meter (``ModelStateMeter.counted``).

    Args:
        tensor: the buffer, counted from construction.
        meter: where it is counted.
    """

    def __init__(self, tensor: torch.Tensor, meter: ModelStateMeter) -> None:
        self.held = meter.held()
        self.tensor = self.held.take(tensor)

    def drop(self) -> None:
        """Uncount the buffer; its owner lets go of it too."""
        self.held.drop()


def live_tensor_bytes(device_type: str | None = None, exclude: set[int] | None = None) -> int:
    """Bytes of every distinct storage reachable from a live tensor, its ``.grad``, or the
    local shard of a ``DTensor``; optionally only storages on ``device_type``, and without
    the storages whose ``data_ptr()`` is in ``exclude``.

    Used by the memory tests and benchmarks to check the engine's own report against what is
    actually allocated.
    """
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .grad of non-leaf tensors warns
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor):
                continue
            for t in (obj, obj.grad if obj.is_leaf else None):
                if t is None:
                    continue
                t = getattr(t, "_local_tensor", t)
                if t.device.type == "meta" or (device_type and t.device.type != device_type):
                    continue
                try:
                    st = t.untyped_storage()
                    if st.nbytes() > 0:
                        storages[st.data_ptr()] = st.nbytes()
                except RuntimeError:  # a wrapper holding no storage of its own (FlatPiece)
                    continue
    for ptr in exclude or ():
        storages.pop(ptr, None)
    return sum(storages.values())


class StepMemoryProbe:
    """Live-tensor bytes above a baseline at the points of a training step, activations
    excluded; the worst reading per point is kept in ``readings``.

    Points: ``after_forward`` / ``after_backward`` / ``after_step`` (call :meth:`mark`),
    ``in_backward`` (every trainable parameter's gradient hook, and the backward of every
    module in ``modules``), ``in_step`` (the optimizer's step pre-hook, see
    :meth:`watch_optimizer`). Activations are the tensors autograd saves for backward
    during :meth:`forward` (recorded through saved-tensor hooks); a saved tensor that is a
    parameter's storage (ZeRO-3's gathered weights) stays counted as model state.

    Register it *before* building the engine: gradient hooks run in registration order, so
    the probe then reads each gradient while it still exists, before the engine moves it
    into a bucket and frees it. Call :meth:`exclude_existing` before building the model:
    what existed then is left out of every count (the baseline is then 0), and counting
    gets cheap enough to run at every gradient hook.

    >>> StepMemoryProbe.exclude_existing()
    >>> model = nn.Linear(4, 4)
    >>> probe = StepMemoryProbe(model, baseline=0)
    >>> with probe.forward():
    ...     loss = model(torch.randn(2, 4)).sum()
    >>> loss.backward(); probe.readings["in_backward"] > 0
    True
    >>> probe.close()
    """

    POINTS = ("after_forward", "in_backward", "after_backward", "in_step", "after_step")

    def __init__(
        self,
        model: nn.Module,
        modules: list[nn.Module] | None = None,
        baseline: int | None = None,
        device_type: str | None = None,
    ) -> None:
        self.model = model
        self.device_type = device_type
        self.baseline = live_tensor_bytes(device_type) if baseline is None else baseline
        self.readings: dict[str, int] = {}
        self.armed = True
        self._saved: list[weakref.ref[torch.Tensor]] = []
        self._handles: list[RemovableHandle] = []
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._in_backward))
        for m in modules or []:
            self._handles.append(m.register_full_backward_pre_hook(self._in_backward))

    @staticmethod
    def exclude_existing() -> None:
        """Leave every object alive now out of later counts (``gc.freeze``: the collector
        then neither scans nor lists them), until :meth:`close`."""
        gc.collect()
        gc.freeze()

    def _in_backward(self, *_: object) -> None:
        self.mark("in_backward")

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Read ``in_step`` right before every ``optimizer.step()``."""
        self._handles.append(optimizer.register_step_pre_hook(self._in_step))

    def _in_step(self, *_: object) -> None:
        self.mark("in_step")

    def mark(self, point: str) -> int:
        """Read now and keep the worst reading of ``point``; returns this reading."""
        if not self.armed:
            return 0
        # One reading, never retried: the engine frees a collective's buffers before its
        # wait returns (``collectives.Lent``), so what is alive now does not depend on how
        # soon a communication thread got a core.
        nbytes = self._read()
        self.readings[point] = max(self.readings.get(point, nbytes), nbytes)
        return nbytes

    def _read(self) -> int:
        alive = [t for t in (r() for r in self._saved) if t is not None]
        exclude = {t.untyped_storage().data_ptr() for t in alive}
        return live_tensor_bytes(self.device_type, exclude) - self.baseline

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Run the forward inside this to tell activations from model state."""
        self._saved = [r for r in self._saved if r() is not None]
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if not isinstance(t, nn.Parameter) and ptr not in self._param_storages():
            self._saved.append(weakref.ref(t))
        return t

    def _param_storages(self) -> set[int]:
        # FSDP2 swaps its unsharded parameters in during forward; DTensors hold a local shard
        params = (getattr(p, "_local_tensor", p) for p in self.model.parameters())
        return {p.untyped_storage().data_ptr() for p in params}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        gc.unfreeze()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def file_size_limit() -> int | None:
    """The largest file this process may write (``RLIMIT_FSIZE``, ``ulimit -f``), or None
    where there is no such limit; what a write refused with ``EFBIG`` ran into."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def free_bytes(where: Path) -> int | None:
    """Bytes free on the drive of ``where`` (a directory), or None where that cannot be
    told: what an error for a full drive reports beside the bytes it needed."""
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def human_bytes(nbytes: int) -> str:
    """1536 -> '1.5 KiB': the unit that keeps the figure readable (never '0.00 GiB')."""
    size = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
