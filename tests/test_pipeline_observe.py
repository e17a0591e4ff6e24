"""A pipeline's monitors, flops profile and comms log: the config sections a DeepSpeed user
turns on work under ``PipelineEngine`` too (rank 0 writes the events with the loss
``train_batch`` returns; each stage profiles its own layers; the pipeline group's
collectives and sends are logged beside the stage engine's)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.core.monitor.csv_monitor import csv_file_name

from .distributed import run_ranks

STEPS, PRINT_EVERY, MICRO, ACCUM, PROFILE = 6, 2, 3, 4, 2
WIDTHS = [5, 16, 12, 24, 8, 20, 6, 10, 4]  # eight Linear layers of distinct shapes


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers)


def _config(out: Path, schedule: str) -> dict[str, Any]:
    return {
        "pipeline": {"stages": 2, "schedule": schedule},
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "steps_per_print": PRINT_EVERY,
        "wall_clock_breakdown": True,
        "zero_optimization": {"stage": 1},
        "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "pp"},
        "comms_logger": {"enabled": True},
        "flops_profiler": {
            "enabled": True,
            "profile_step": PROFILE,
            "output_file": str(out / "profile.txt"),
        },
    }


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    logger = logging.getLogger("ds_strategy.core.engine")
    for schedule in ("1f1b", "interleaved_1f1b"):
        path = Path(root) / schedule
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        logged = _Lines()
        logger.addHandler(logged)
        logger.setLevel(logging.INFO)
        try:
            engine = ds_strategy.initialize(
                model, opt, _config(path, schedule), loss_fn=nn.MSELoss()
            )
        finally:
            logger.removeHandler(logged)
        engine.engine.timers.printer = lambda line: None
        g = torch.Generator().manual_seed(1)
        losses, sent, lrs = [], [], []
        for _ in range(STEPS):
            x = torch.randn(MICRO * ACCUM, WIDTHS[0], generator=g)
            y = torch.randn(MICRO * ACCUM, WIDTHS[-1], generator=g)
            losses.append(float(engine.train_batch(x, y)))
            sent.append(engine.comm_report())
            lrs.append(engine.engine.get_lr()[0])
        # the Linear layers this rank holds, as (in, out), from its stage module
        linears = [
            (m.in_features, m.out_features)
            for m in engine.module.modules()
            if isinstance(m, nn.Linear)
        ]
        out[schedule] = {
            "losses": losses,
            "sent": sent,
            "lrs": lrs,
            "writers": len(engine.monitor.monitors),
            "flops": engine.flops_report(),
            "comms": engine.comms_report(),
            "linears": linears,
            "stage": engine.stage_id,
            "summaries": [line for line in logged.lines if "ZeRO-" in line],
        }
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("pipeline_observe")
    return root, run_ranks(_worker, 2, str(root), timeout=300)


def _rows(directory: Path, tag: str) -> list[tuple[int, float]]:
    with (directory / csv_file_name(tag)).open() as f:
        _, *rows = list(csv.reader(f))
    return [(int(s), float(v)) for s, v in rows]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_rank_0_writes_the_pipelines_loss_bytes_and_schedule_time(
    runs: tuple[Path, list[dict[str, Any]]], schedule: str
) -> None:
    root, results = runs
    r0 = results[0][schedule]
    assert [r[schedule]["writers"] for r in results] == [1, 0]  # rank 1 holds no writer
    directory = root / schedule / "csv" / "pp"
    printed = range(PRINT_EVERY, STEPS + 1, PRINT_EVERY)
    samples = [s * MICRO * ACCUM for s in printed]  # one data-parallel rank: the batch
    # both ranks got the same loss from train_batch; the monitor wrote that one
    assert results[1][schedule]["losses"] == pytest.approx(r0["losses"])
    loss = _rows(directory, "Train/Samples/train_loss")
    assert [s for s, _ in loss] == samples
    assert [v for _, v in loss] == pytest.approx([r0["losses"][s - 1] for s in printed])
    lr = _rows(directory, "Train/Samples/lr")
    assert [v for _, v in lr] == pytest.approx([r0["lrs"][s - 1] for s in printed])
    # bytes sent per step: what comm_report() counted, activations sent between stages included
    per_step = [r["total"] for r in r0["sent"]]
    expected = [sum(per_step[s - PRINT_EVERY : s]) / PRINT_EVERY for s in printed]
    sent = _rows(directory, "Train/Samples/sent_bytes")
    assert [v for _, v in sent] == pytest.approx(expected)
    assert all(r["pp_send"] > 0 for r in r0["sent"])
    # the schedule interleaves forward and backward: its time, no forward / backward split
    names = {p.name for p in directory.iterdir()}
    for timing in ("schedule", "backward_allreduce", "step"):
        assert csv_file_name(f"Train/Samples/elapsed_time_ms_{timing}") in names
    assert csv_file_name("Train/Samples/elapsed_time_ms_forward") not in names
    assert all(v > 0 for _, v in _rows(directory, "Train/Samples/elapsed_time_ms_schedule"))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_each_stage_logs_its_own_start_summary(
    runs: tuple[Path, list[dict[str, Any]]], schedule: str
) -> None:
    _, results = runs
    for rank in (0, 1):
        r = results[rank][schedule]
        (line,) = r["summaries"]  # one line, on each stage's first (here: only) rank
        assert f"ZeRO-1 on 1 data-parallel rank, pipeline stage {r['stage']} of 2, fp32" in line, (
            line
        )
        assert "model state per rank" in line
    # different layers: each line says its own stage's memory
    lines = [results[k][schedule]["summaries"][0] for k in (0, 1)]
    assert lines[0] != lines[1]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_each_stage_profiles_its_own_layers(
    runs: tuple[Path, list[dict[str, Any]]], schedule: str
) -> None:
    root, results = runs
    stages = []
    for rank in (0, 1):
        r = results[rank][schedule]
        report = r["flops"]
        stages.append(r["stage"])
        # one micro-batch through every chunk this rank holds: 2 * batch * in * out a Linear
        assert report["fwd_flops"] == sum(2 * MICRO * a * b for a, b in r["linears"])
        assert report["params"] == sum(a * b + b for a, b in r["linears"])
        assert report["pipeline_stage"] == r["stage"] and report["micro_batches"] == ACCUM
        assert report["batch_size"] == MICRO and report["step"] == PROFILE
        assert report["mp_size"] == 2 and report["world_size"] == 2
        assert report["fwd_latency_s"] is None and report["fwd_bwd_latency_s"] > 0
        train = (3 + report["recompute_fwd_factor"]) * report["fwd_flops"] * ACCUM
        assert report["achieved_tflops"] == pytest.approx(train / report["iter_latency_s"] / 1e12)
        linear_rows = [m for m in report["modules"].values() if m["type"] == "Linear"]
        assert sorted(m["flops"] for m in linear_rows) == sorted(
            2 * MICRO * a * b for a, b in r["linears"]
        )
    assert sorted(stages) == [0, 1]
    # between them the stages hold the whole model, each its share
    assert sum(results[k][schedule]["flops"]["params"] for k in (0, 1)) == sum(
        a * b + b for a, b in zip(WIDTHS, WIDTHS[1:], strict=False)
    )
    files = root / schedule
    assert "Profile Summary at step 2" in (files / "profile.txt").read_text()
    stage1 = (files / "profile_stage1.txt").read_text()
    assert "pipeline stage:" in stage1 and "micro-batches per step:" in stage1


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_comms_log_has_the_pipeline_groups_sends_and_collectives(
    runs: tuple[Path, list[dict[str, Any]]], schedule: str
) -> None:
    _, results = runs
    for rank in (0, 1):
        r = results[rank][schedule]
        ops = r["comms"]["ops"]
        assert r["comms"]["enabled"]
        # the sends' bytes equal comm_report()'s, count and all; they are not timed
        assert ops["pp_send"]["sent_bytes"] == sum(s["pp_send"] for s in r["sent"])
        assert ops["pp_send"]["total_ms"] == 0.0
        timed = [k for k, v in ops.items() if k.startswith("pp_") and v["total_ms"] > 0]
        assert timed, ops.keys()  # the loss broadcast and the norm exchange


def test_plot_draws_the_pipelines_run(
    runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    from ds_strategy.cli.plot import plot_run

    root, _ = runs
    lines: list[str] = []
    written = plot_run(root / "1f1b" / "csv" / "pp", tmp_path, say=lines.append)
    names = {p.name for p in written}
    # the phase figure stacks the schedule and the step (no forward / backward split here)
    assert {"loss_lr.png", "phase_times.png", "sent_bytes.png"} <= names, lines
    assert all(p.stat().st_size > 5_000 for p in written)
