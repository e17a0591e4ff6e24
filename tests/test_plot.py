"""The memory timeline and ``ds-strategy plot``: a real 2-rank ZeRO-3 run with every weight
sharded writes the CSV monitor's files and each rank's timeline; the command draws them into
PNGs that are the expected size and not blank; the timeline's peak is the engine's."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.cli import main as cli_main
from ds_strategy.core.memory import ModelStateMeter
from ds_strategy.core.memory_timeline import MemoryTimeline, zero_formula_bytes
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss

from .distributed import run_ranks

STEPS, WORLD, MICRO = 10, 2, 2
CFG = GPTConfig(vocab=64, d=64, layers=3, heads=4, seq=16)
FIGURES = ("loss_lr.png", "phase_times.png", "memory_timeline.png", "sent_bytes.png")


def _config(out: Path) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,  # every weight sharded
            "reduce_bucket_size": 20_000,  # several buckets: the timeline rises and falls
        },
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "job"},
        "memory_timeline": {"enabled": True},
    }


def _train(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ds_strategy.initialize(model, opt, _config(Path(out)))
    engine.timers.printer = lambda line: None
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        if step == STEPS - 1:
            engine.reset_peak_memory()  # the peak of the last step: the timeline's step
        tokens = torch.randint(0, CFG.vocab, (MICRO * world, CFG.seq + 1), generator=gen)
        loss = gpt_loss(engine, tokens[rank * MICRO : (rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
    events = engine.memory_timeline()
    report = engine.memory_report()
    formula = zero_formula_bytes(engine.plan.groups, mixed=False)
    engine.destroy()
    return {"events": events, "report": report, "formula": formula}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("plot_run")
    return out, run_ranks(_train, WORLD, str(out), timeout=240)


def test_timeline_is_the_meters_step(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = run
    psi = sum(p.numel() for p in GPT(CFG).parameters())
    for rank, r in enumerate(results):
        events = r["events"]
        assert events and {e["step"] for e in events} == {STEPS}  # one step only
        assert {"forward", "backward", "step"} <= {e["phase"] for e in events}
        # the step's high-water mark is the engine's peak since the reset before it
        assert max(e["total"] for e in events) == r["report"]["peak"]
        assert events[-1]["peak"] == r["report"]["peak"]
        # gathered parameters and buckets come and go: the timeline is not flat
        assert max(e["total"] for e in events) > events[-1]["total"]
        assert events[-1]["resident"] == r["report"]["total"]
        # ZeRO-3 fp32 with Adam, every weight sharded: 16 psi / N (flat groups pad a little)
        assert r["formula"] == pytest.approx(16 * psi / WORLD, rel=1e-9)
        assert r["report"]["total"] == pytest.approx(r["formula"], rel=0.02)
        with (out / "job" / f"memory_timeline_{rank}.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert [int(row["total"]) for row in rows] == [e["total"] for e in events]
        assert {int(row["formula"]) for row in rows} == {int(r["formula"])}


def _check_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.stat().st_size > 10_000, path
    pixels = imread(path)
    assert pixels.shape[:2] == (360, 640), path  # 8 x 4.5 inches at 80 dpi
    colours = {tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}
    assert len(colours) > 20, path  # axes, text, lines: not a blank canvas
    assert (pixels[..., :3] < 0.5).mean() > 0.005, path  # some dark ink


def test_plot_draws_every_figure(
    run: tuple[Path, list[dict[str, Any]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out, _ = run
    assert cli_main(["plot", str(out), "--out", str(tmp_path)]) == 0
    for name in FIGURES:
        _check_png(tmp_path / name)
    assert "skipped" not in capsys.readouterr().out


def test_a_figure_without_its_data_is_skipped_with_a_line(
    run: tuple[Path, list[dict[str, Any]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out, _ = run
    job = tmp_path / "job"
    job.mkdir()
    for name in ("Train_Samples_train_loss.csv", "Train_Samples_lr.csv"):
        (job / name).write_bytes((out / "job" / name).read_bytes())
    assert cli_main(["plot", str(job), "--out", str(tmp_path / "png")]) == 0
    said = capsys.readouterr().out
    assert [p.name for p in (tmp_path / "png").iterdir()] == ["loss_lr.png"]
    for name in FIGURES[1:]:
        assert f"skipped {name}" in said


def test_missing_matplotlib_names_the_extra(
    run: tuple[Path, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    out, _ = run
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli_main(["plot", str(out), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ds_strategy[plot]" in err and "matplotlib" in err
    assert not list(tmp_path.iterdir())


def test_import_ds_strategy_does_not_import_the_plot_module() -> None:
    import subprocess

    code = "import sys, ds_strategy; print('matplotlib' in sys.modules, 'ds_strategy.cli.plot' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_timeline_is_bounded() -> None:
    meter = ModelStateMeter()
    meter.timeline = MemoryTimeline(max_events=5)
    for step in range(1, 4):
        for _ in range(10):
            meter.alloc(8)
            meter.free(8)
        meter.timeline.end_step(step)
    assert len(meter.timeline.events()) == 5 and meter.timeline.dropped == 3 * 15
    assert [e["event"] for e in meter.timeline.events()][:2] == ["alloc", "free"]
    meter.touch(100)
    assert meter.timeline._current[-1]["transient"] == 100  # the instant a gradient exists
