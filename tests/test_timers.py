"""``wall_clock_breakdown``: per-step phase times and bytes, reported every
``steps_per_print`` steps, on rank 0's stdout, to sinks and by ``engine.timing_report()``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.timers import PHASES

from .distributed import run_ranks


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def worker(rank: int, world: int) -> dict:
    return {stage: train(rank, stage) for stage in (1, 3)}


def train(rank: int, stage: int) -> dict:
    m = model()
    config = {
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "wall_clock_breakdown": True,
        "steps_per_print": 2,
        "gradient_accumulation_steps": 2,
        "train_micro_batch_size_per_gpu": 4,
    }
    engine = ds_strategy.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-3), config)
    printed: list[str] = []
    engine.timers.printer = printed.append
    sunk: list[tuple[int, dict]] = []
    engine.timers.add_sink(lambda report, step: sunk.append((step, report)))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for i in range(8):  # 4 optimizer steps of 2 micro-steps
        if i == 4:
            engine.comm_report()  # count the bytes of the last report's window (steps 3, 4)
        engine.backward(engine(x).square().mean())
        engine.step()
    return {
        "printed": printed,
        "sunk": sunk,
        "report": engine.timing_report(),
        "comm": engine.comm_report(),
    }


def test_breakdown_reports_every_steps_per_print() -> None:
    results = run_ranks(worker, 2, timeout=120)
    for rank, stage in ((0, 1), (1, 1), (0, 3), (1, 3)):
        r = results[rank][stage]
        assert [step for step, _ in r["sunk"]] == [2, 4]
        report = r["report"]
        assert report == r["sunk"][-1][1]
        for name in ("forward", "backward", "step", "iteration"):
            assert report[f"{name}_ms"] > 0, (rank, stage, name)
        # Blocked time on communication happens inside the other phases.
        assert 0 < report["reduce_ms"] < report["backward_ms"] + report["step_ms"]
        inside = report["forward_ms"] + report["backward_ms"] + report["step_ms"]
        assert 0 < report["gather_ms"] < inside
        assert inside <= report["iteration_ms"] * 1.01
        # Bytes per step: the window mean is half of what comm_report counted over the
        # window's two steps (not the first step: stage 3 records its order there and
        # gathers its last unit once more than later steps do).
        assert report["sent_bytes"] == pytest.approx(r["comm"]["total"] / 2, rel=1e-6)
        assert report["all_gather_bytes"] == pytest.approx(r["comm"]["all_gather"] / 2)
        assert report["reduce_scatter_bytes"] > 0
        # Printed on rank 0 only, once per report, naming every phase.
        if rank == 0:
            assert len(r["printed"]) == 2
            assert all(p in r["printed"][0] for p in PHASES)
            assert "step 4" in r["printed"][1]
        else:
            assert r["printed"] == []


def test_disabled_by_default_costs_nothing() -> None:
    m = model()
    engine = ds_strategy.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), {})
    assert engine.timers is None and engine.comm.wait_timer is None
    engine.backward(engine(torch.randn(2, 16)).sum())
    engine.step()
    assert engine.timing_report() == {}


def test_accelerate_trackers_receive_the_breakdown() -> None:
    from accelerate.tracking import GeneralTracker

    from ds_strategy.accelerate import ZeroAccelerator

    class ListTracker(GeneralTracker):
        name = "list"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int | None, dict]] = []

        @property
        def tracker(self) -> ListTracker:
            return self

        def log(self, values: dict, step: int | None = None, **kwargs: object) -> None:
            self.logged.append((step, values))

    tracker = ListTracker()
    config = {"zero_optimization": {"stage": 2}, "wall_clock_breakdown": True, "steps_per_print": 2}
    accelerator = ZeroAccelerator(config=config, log_with=[tracker], cpu=True)
    accelerator.init_trackers("breakdown")
    m = model()
    m, opt = accelerator.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    for _ in range(4):
        accelerator.backward(m(torch.randn(2, 16)).square().mean())
        opt.step()
        opt.zero_grad()
    assert [step for step, _ in tracker.logged] == [2, 4]
    for _, values in tracker.logged:
        assert values["wall_clock/forward_ms"] > 0 and values["wall_clock/step_ms"] > 0
    accelerator.end_training()
