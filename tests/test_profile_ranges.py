"""Every phase of a training step runs in a named ``torch.profiler`` range
(``ds_strategy::forward`` ... ``::checkpoint_load``), and with no profiler a range is a
shared no-op (its cost is measured by ``benchmarks/bench_profile_ranges.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.profiler import profile

import ds_strategy
from ds_strategy.core import timers
from ds_strategy.core.profiling import PREFIX, RANGES, profile_range, ranges

from .distributed import run_ranks

OFFLOAD = ("offload_read", "offload_write")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.ModuleList([nn.Linear(32, 4)])[0])


def _profiled(rank: int, root: str, nvme: bool) -> dict[str, Any]:
    """Two ZeRO-3 steps (every weight sharded), a save and a load, under a profiler."""
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if nvme:
        place = {"device": "nvme", "nvme_path": f"{root}/swap"}
        zero.update(offload_param=place, offload_optimizer=place)
    m = _model()
    engine = ds_strategy.initialize(
        m, torch.optim.AdamW(m.parameters(), lr=1e-3), {"zero_optimization": zero}
    )
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ckpt = f"{root}/ck_nvme" if nvme else f"{root}/ck"
    with profile() as prof:
        for _ in range(2):
            engine.backward(engine(x).square().mean())
            engine.step()
        engine.save_checkpoint(ckpt)
        engine.load_checkpoint(ckpt)
    engine.destroy()  # the swap threads
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in prof.events():
        if e.name.startswith(PREFIX):
            spans.setdefault(e.name[len(PREFIX) :], []).append(
                (e.time_range.start, e.time_range.end)
            )
    return spans


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"plain": _profiled(rank, root, False), "nvme": _profiled(rank, root, True)}


def _inside(inner: list[tuple[float, float]], outer: list[tuple[float, float]]) -> bool:
    return any(o[0] <= i[0] and i[1] <= o[1] for i in inner for o in outer)


def test_every_phase_is_a_named_range_under_zero3_and_nvme(tmp_path) -> None:
    (tmp_path / "swap").mkdir()
    results = run_ranks(_worker, 2, str(tmp_path), timeout=180)
    for rank, result in enumerate(results):
        plain, nvme = result["plain"], result["nvme"]
        assert set(plain) == set(RANGES) - set(OFFLOAD), (rank, sorted(plain))
        assert set(nvme) == set(RANGES), (rank, sorted(nvme))
        for spans in (plain, nvme):
            assert len(spans["forward"]) == len(spans["backward"]) == 2
            assert len(spans["optimizer_step"]) == 2
            # sharded weights are gathered inside the forward; gradients are reduce-scattered
            # inside the backward (bucket by bucket) or at the latest in the step
            assert _inside(spans["all_gather"], spans["forward"]), rank
            assert _inside(spans["reduce_scatter"], spans["backward"] + spans["optimizer_step"])
        assert _inside(nvme["offload_read"], nvme["forward"] + nvme["optimizer_step"])


def test_no_profiler_no_range() -> None:
    # the shared nullcontexts: nothing is entered while no profiler records
    assert profile_range("all_gather") is ranges._NULL
    assert timers.phase(None, "forward") is timers._NULL
    with profile():
        assert profile_range("all_gather") is not ranges._NULL
        assert timers.phase(None, "step") is not timers._NULL
