"""DeepSpeed's flops profiler (``flops_profiler`` in the config) for the training engine.

At optimizer step ``profile_step`` (the steps finished before it, as DeepSpeed counts) the
forward of the last micro-batch is measured module by module (``counting.py``), its
backward and the optimizer step are timed, and at the step's end the report is built,
printed on rank 0 in DeepSpeed's layout (a report of this module's logger, see
``ds_strategy/_logging.py``; to ``output_file`` when set) and kept for
``engine.flops_report()``.

[Note: training FLOPs and MFU]
The backward is not counted but taken as ``2 + recompute_fwd_factor`` forwards (two matmuls
per forward matmul: the input's gradient and the weight's; plus what activation
checkpointing recomputes), as DeepSpeed's profiler does, so a step is ``3 + factor``
forwards. ``achieved_tflops`` is that over the iteration (forward, backward and step); the
MFU counts the model's FLOPs only (``3 x forward``, no recomputation, as in the PaLM paper)
over the iteration and the peak. Every rank measures its own step (no collective is added);
under ZeRO-3 the counts are the full model's, as the parameters are gathered in forward.

[Note: latencies from the step before]
Counting runs every operator of the profiled forward through a Python dispatch mode, which
slows a small model's forward several times over. So the forward, backward and step are
also timed (and nothing else) at the step before ``profile_step``, and the summary's
latencies, FLOPS, MFU and samples/second come from that step (``latency_step`` in the
report); with ``profile_step`` 0 there is none, and the profiled step's own times are used.
The per-module latencies are the profiled forward's, counting overhead included: read them
as shares of that forward, as DeepSpeed's (measured under its own hooks) are.

[Note: a pipeline stage's profile]
Under a pipeline (``PipelineEngine``) each stage profiles its own layers (DeepSpeed's
pipeline engine prints no profile). The schedule interleaves the forwards and backwards of
all micro-batches with the transfers between stages, so they cannot be timed apart: the
first forward of each of the stage's chunks at ``profile_step`` is counted (one
micro-batch: ``fwd_flops``, the modules, ``batch_size``), the whole schedule is timed
(``fwd_bwd_latency_s``) and the step after it, and the rates count the step's
``micro_batches`` forwards: ``achieved_tflops`` = (3 + factor) x fwd_flops x micro_batches /
iter latency. ``fwd_latency_s``, ``bwd_latency_s``, ``fwd_tflops`` and ``bwd_tflops`` are
None there. Each stage's first data-parallel rank prints its profile (stage k > 0 to
``output_file`` with ``_stage<k>`` before its suffix); ``mp_size`` counts the stages.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..._logging import report
from ...config._schema import FlopsProfilerConfig
from .counting import ForwardCount
from .peak import peak_tflops
from .summary import (
    FlopsReport,
    ModuleProfile,
    ProfileBase,
    ProfileRates,
    StageInfo,
    format_profile,
)

log = logging.getLogger(__name__)

__all__ = ["FlopsProfiler"]

_NULL = contextlib.nullcontext()


class FlopsProfiler:
    """Measures one optimizer step of an engine; see the module docstring.

    ``config`` is the resolved ``flops_profiler`` section; the engine calls :meth:`forward`,
    :meth:`backward` and :meth:`step` around its phases with its ``global_steps``.
    """

    def __init__(
        self,
        config: FlopsProfilerConfig,
        model: nn.Module,
        *,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        world_size: int,
        mp_size: int = 1,
        stage: int | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.config = config
        self.model = model
        self.device, self.dtype = device, dtype
        self.rank, self.world_size, self.mp_size = rank, world_size, mp_size
        self.stage, self.micro_batches = stage, micro_batches  # a pipeline stage's (see note)
        self._chunks: set[int] | None = None  # the chunks counted so far in a schedule
        self.report: FlopsReport | dict[str, object] = {}  # empty until the profiled step
        self.printed: str | None = None
        self._count: ForwardCount | None = None
        self._times: dict[str, float] = {}  # the profiled step's phases
        self._plain: dict[str, float] = {}  # the step before's
        self._batch = 0

    def _active(self, step: int) -> bool:
        return step == self.config.profile_step and not self.report

    def _before(self, step: int) -> bool:
        """The step before the profiled one, timed without counting (see the note)."""
        return step == self.config.profile_step - 1 and not self.report

    def forward(self, step: int, args: object) -> contextlib.AbstractContextManager[None]:
        """Around the module's forward; at the profile step it is measured (each micro-step
        starts over, so the last micro-batch of the step is the one reported)."""
        if self._before(step):
            return self._timed(self._plain, "fwd")
        if not self._active(step):
            return _NULL
        return self._forward(args)

    @contextlib.contextmanager
    def _forward(self, args: object) -> Iterator[None]:
        self._times.clear()
        self._batch = next((a.shape[0] for a in _tensors(args) if a.dim() > 0), 0)
        self._count = ForwardCount(self.model, sync=self.device.type == "cuda")
        with self._count, self._timed(self._times, "fwd"):
            yield

    def schedule(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Around a pipeline stage's schedule (see [Note: a pipeline stage's profile])."""
        if self._before(step):
            return self._timed(self._plain, "schedule")
        return self._schedule() if self._active(step) else _NULL

    @contextlib.contextmanager
    def _schedule(self) -> Iterator[None]:
        self._times.clear()
        self._count = ForwardCount(self.model, sync=self.device.type == "cuda")
        self._chunks = set()
        try:
            with self._timed(self._times, "schedule"):
                yield
        finally:
            self._chunks = None

    def chunk_forward(
        self, chunk: int, args: object
    ) -> contextlib.AbstractContextManager[ForwardCount | None]:
        """Around one forward of a pipeline stage's ``chunk`` (the stage module's call):
        inside a profiled :meth:`schedule`, each chunk's first forward is counted."""
        if self._chunks is None or chunk in self._chunks or self._count is None:
            return _NULL
        if not self._chunks:
            self._batch = next((a.shape[0] for a in _tensors(args) if a.dim() > 0), 0)
        self._chunks.add(chunk)
        return self._count

    def backward(self, step: int) -> contextlib.AbstractContextManager[None]:
        if self._before(step):
            return self._timed(self._plain, "bwd")
        return self._timed(self._times, "bwd") if self._active(step) and self._count else _NULL

    def step(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Around the optimizer step; at the profile step's end the report is made."""
        if self._before(step):
            return self._timed(self._plain, "step")
        return self._step() if self._active(step) and self._count else _NULL

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        count = self._count
        with self._timed(self._times, "step"):
            yield
        if count is not None:
            self._finish(count)

    @contextlib.contextmanager
    def _timed(self, into: dict[str, float], name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        into[name] = time.perf_counter() - start

    def _finish(self, count: ForwardCount) -> None:
        built = self.report = self._build(count)
        self._count = None
        text = format_profile(
            built, self.config.module_depth, self.config.top_modules, self.config.detailed
        )
        if self.rank == 0:
            self.printed = text
            if self.config.output_file:
                path = Path(self.config.output_file)
                if self.stage:  # stage 0 writes the file named, as a global rank 0 would
                    path = path.with_name(f"{path.stem}_stage{self.stage}{path.suffix}")
                path.write_text(text + "\n")
            else:  # stdout without logging set up, else the application's handlers
                report(log, text)

    def _build(self, count: ForwardCount) -> FlopsReport:
        modules: dict[str, ModuleProfile] = {
            name: {
                "type": s.type,
                "depth": s.depth,
                "params": s.params,
                "flops": s.flops,
                "macs": s.macs,
                "latency_s": s.latency_s,
            }
            for name, s in count.stats().items()
        }
        fwd_flops = count.total_flops
        peak, source = peak_tflops(self.config.peak_tflops, self.device, self.dtype)
        base: ProfileBase = {
            "step": self.config.profile_step,
            "world_size": self.world_size,
            "dp_size": self.world_size // self.mp_size,
            "mp_size": self.mp_size,
            "batch_size": self._batch,
            "params": modules[""]["params"],
            "fwd_flops": fwd_flops,
            "fwd_macs": fwd_flops // 2,
            "recompute_fwd_factor": self.config.recompute_fwd_factor,
            "peak_tflops": peak,
            "peak_source": source,
            "modules": modules,
        }
        stage: StageInfo = {}
        if self.stage is not None:
            stage = {"pipeline_stage": self.stage, "micro_batches": self.micro_batches}
        return {**base, **stage, **self._rates(fwd_flops, peak)}

    def _rates(self, fwd_flops: int, peak: float) -> ProfileRates:
        """Latencies, FLOPS and MFU from the phase times (see [Note: training FLOPs and MFU]);
        a pipeline stage's from its schedule and step (see [Note: a pipeline stage's
        profile]), over its ``micro_batches`` forwards (1 outside a pipeline)."""
        factor = 2 + self.config.recompute_fwd_factor
        split = self.stage is None  # forward and backward timed apart
        phases = ("fwd", "bwd", "step") if split else ("schedule", "step")
        plain = set(phases) <= set(self._plain)
        t = {k: (self._plain if plain else self._times).get(k, 0.0) for k in phases}
        fwd_bwd = t["fwd"] + t["bwd"] if split else t["schedule"]
        it = fwd_bwd + t["step"]
        m = self.micro_batches
        tf = lambda flops, s: flops / s / 1e12 if s > 0 else 0.0  # noqa: E731
        return {
            "bwd_flops": factor * fwd_flops,
            "train_flops": (1 + factor) * fwd_flops,
            "fwd_latency_s": t["fwd"] if split else None,
            "bwd_latency_s": t["bwd"] if split else None,
            "fwd_bwd_latency_s": fwd_bwd,
            "step_latency_s": t["step"],
            "iter_latency_s": it,
            "fwd_tflops": tf(fwd_flops, t["fwd"]) if split else None,
            "bwd_tflops": tf(factor * fwd_flops, t["bwd"]) if split else None,
            "fwd_bwd_tflops": tf((1 + factor) * fwd_flops * m, fwd_bwd),
            "achieved_tflops": tf((1 + factor) * fwd_flops * m, it),
            "mfu": tf(3 * fwd_flops * m, it) / peak if peak > 0 else 0.0,
            "samples_per_second": self._batch * m / it if it > 0 else 0.0,
            "latency_step": self.config.profile_step - 1 if plain else self.config.profile_step,
        }


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _tensors(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _tensors(t)
