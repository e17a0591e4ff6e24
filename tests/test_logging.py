"""Logging, progress and warning categories: the ``ds_strategy`` logger tree (one handler of
its own, which steps aside for the application's; one child per module), warnings and the
reports a config asks for shown without any logging set up, the summary an engine logs once
built, the ``wall_clock_breakdown`` line as a log record, DeepSpeed's ``steps_per_print``
progress line, the progress switches, and the warning kinds."""

from __future__ import annotations

import contextlib
import doctest
import importlib
import io
import logging
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ds_strategy
from ds_strategy._logging import OwnHandler, package_logger
from ds_strategy.config import (
    DeprecatedConfigWarning,
    UnknownConfigKeyWarning,
    UnsupportedConfigWarning,
    load_config,
)
from ds_strategy.core import step_line
from ds_strategy.core.checkpoint import swap
from ds_strategy.core.schedulers import build_scheduler
from ds_strategy.core.timers import format_report
from ds_strategy.core.warnings import (
    CheckpointWarning,
    DsStrategyDeprecationWarning,
    DsStrategyWarning,
    FrontEndWarning,
    PerformanceWarning,
)
from tests.distributed import run_ranks

ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
IN, HIDDEN, OUT = 16, 32, 4
NUMEL = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 676 parameters: KiB figures


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)
    )


def _engine(config: dict) -> ds_strategy.ZeroEngine:
    model = _model()
    engine = ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    assert isinstance(engine, ds_strategy.ZeroEngine)
    return engine


def _messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def _progress(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The progress lines without their elapsed time (``..., 3 s``)."""
    lines = _messages(caplog, "ds_strategy.core.progress")
    assert all(re.search(r", \d+ s$", line) for line in lines), lines
    return [line.rpartition(", ")[0] for line in lines]


# -- the logger tree -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [
        "ds_strategy.core.engine",
        "ds_strategy.core.progress",
        "ds_strategy.core.timers",
        "ds_strategy.core.optimizers",
        "ds_strategy.core.optim.zeroone",
        "ds_strategy.core.monitor.events",
    ],
)
def test_each_module_logs_as_a_child_of_the_package_logger(module: str) -> None:
    assert package_logger is logging.getLogger("ds_strategy")
    assert package_logger.level == logging.NOTSET
    (own,) = package_logger.handlers  # the package's own, which steps aside for the application's
    assert isinstance(own, OwnHandler)
    log = importlib.import_module(module).log
    assert log.name == module
    assert log.parent is package_logger  # no logger configured in between


_REPORTS = {  # what a config can ask to be shown, and how each report starts
    "wall_clock_breakdown": "[wall_clock_breakdown] step ",
    "steps_per_print": "step=",
    "flops_profiler": "-------------------------- DeepSpeed Flops Profiler",
    "comms_logger": "Comm. Op            Message Size",
}
_ASKING = {
    **ZERO3,
    "wall_clock_breakdown": True,
    "steps_per_print": 1,
    "flops_profiler": {"enabled": True, "profile_step": 1},
    "comms_logger": {"enabled": True},
}


def _lines_starting(text: str) -> dict[str, int]:
    """How many lines of ``text`` start each report."""
    lines = text.splitlines()
    return {key: sum(line.startswith(p) for line in lines) for key, p in _REPORTS.items()}


def test_without_logging_warnings_and_asked_for_reports_show_once_then_the_application_decides(
    tmp_path: Path,
) -> None:
    """A plain script that configures no logging sees the package's warnings on stderr (a
    monitor without a batch size for its x axis) and the reports its config asked for on
    stdout (the breakdown and the progress line at each of two steps, the flops profile, the
    comms summary), as DeepSpeed prints them, and not the INFO summary. Once the application
    configures logging (a plain basicConfig: WARNING on the root logger) its handler prints
    each of them once and the package's prints nothing; a level on the package logger
    silences them."""
    code = textwrap.dedent(
        f"""
        import logging, sys, torch, ds_strategy
        asking = {_ASKING!r}
        config = {{**asking, "csv_monitor": {{"enabled": True, "output_path": {str(tmp_path)!r}}}}}

        def run():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine = ds_strategy.initialize(model, opt, config)
            for _ in range(2):
                engine.backward(engine(torch.randn(2, 16)).square().mean())
                engine.step()
            engine.log_summary()
            engine.destroy()

        run()
        for phase in ("application", "quiet"):
            for stream in (sys.stdout, sys.stderr):
                print(f"-- {{phase}} --", file=stream, flush=True)
            if phase == "application":
                logging.basicConfig(stream=sys.stdout, format="APP %(message)s")
            else:
                logging.getLogger("ds_strategy").setLevel(logging.ERROR)
            run()
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out, app_out, quiet_out = re.split(r"-- (?:application|quiet) --\n", run.stdout)
    err, app_err, quiet_err = re.split(r"-- (?:application|quiet) --\n", run.stderr)
    once = {"wall_clock_breakdown": 2, "steps_per_print": 2, "flops_profiler": 1, "comms_logger": 1}
    assert _lines_starting(out) == once, out
    assert "monitor: the config gives no batch size" in err
    assert "ds_strategy: ZeRO-" not in out + err  # the INFO summary stays quiet
    # the application's handler: every line once, through its format; ours silent
    prefixed = "\n".join(line.removeprefix("APP ") for line in app_out.splitlines())
    assert _lines_starting(prefixed) == once, app_out
    assert _lines_starting(app_out) == dict.fromkeys(once, 0)  # nothing printed unformatted
    assert "APP monitor: the config gives no batch size" in app_out and app_err == ""
    assert quiet_out == "" and "no batch size" not in quiet_err, (quiet_out, quiet_err)


def _reports_worker(rank: int, world: int) -> dict[str, str]:
    assert not logging.getLogger().handlers  # a new process: no logging set up
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        torch.manual_seed(0)
        engine = _engine(_ASKING)
        for _ in range(2):
            engine.backward(engine(torch.randn(2, IN)).square().mean())
            engine.step()
        engine.log_summary()
        engine.destroy()
    return {"out": out.getvalue(), "err": err.getvalue()}


def test_asked_for_reports_show_on_rank_0_only() -> None:
    first, second = run_ranks(_reports_worker, 2)
    assert _lines_starting(first["out"]) == {
        "wall_clock_breakdown": 2,
        "steps_per_print": 2,
        "flops_profiler": 1,
        "comms_logger": 1,
    }, first["out"]
    assert "step=1, skipped=0, lr=[0.001], mom=[(0.9, 0.999)]" in first["out"].splitlines()
    assert second["out"] == "" and first["err"] == second["err"] == ""


def test_the_progress_line_is_deepspeeds_and_needs_steps_per_print(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert doctest.testmod(step_line).attempted > 0 and doctest.testmod(step_line).failed == 0
    caplog.set_level(logging.INFO, logger="ds_strategy")
    for config, steps in (({**ZERO3, "steps_per_print": 2}, [2, 4]), (ZERO3, [])):
        caplog.clear()
        engine = _engine({**config, "fp16": {"enabled": True, "initial_scale_power": 60}})
        for _ in range(4):  # the first steps overflow at 2**60 and are skipped
            engine.backward(engine(torch.randn(2, IN)).square().mean())
            engine.step()
        lines = [m for m in _messages(caplog, "ds_strategy.core.engine") if m.startswith("step=")]
        skipped = engine.skipped_steps
        engine.destroy()
        assert skipped >= 1
        assert lines == [
            step_line.progress_line(s, min(s, skipped), [{"lr": 1e-3, "betas": (0.9, 0.999)}])
            for s in steps
        ], lines


# -- the start summary ---------------------------------------------------------------------------


def test_an_engine_logs_one_summary_with_its_memory(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ds_strategy")
    engine = _engine(ZERO3)
    built = engine.memory_report()
    engine.backward(engine(torch.randn(2, IN)).square().mean())
    engine.step()  # no second summary later
    stepped = engine.memory_report()
    engine.destroy()
    summaries = [m for m in _messages(caplog, "ds_strategy.core.engine") if "ZeRO-" in m]
    assert len(summaries) == 1, summaries
    (line,) = summaries
    assert line.startswith("ds_strategy: ZeRO-3 on 1 rank, fp32, no offload; "), line
    found = re.search(
        r"model state per rank ([\d.]+) KiB now \(params ([\d.]+) KiB, grads 0 bytes until "
        r"the first backward, optimizer 0 bytes until the first step\), ([\d.]+) KiB by the "
        r"ZeRO-3 formula",
        line,
    )
    assert found, line
    total, params, formula = (float(x) for x in found.groups())
    # the figures are memory_report()'s as the engine was built: one rank's fp32 parameters
    # of the whole model; the gradient shard comes with the first backward, the optimizer
    # state with the first step
    assert (built["params"], built["grads"], built["optimizer_state"]) == (4 * NUMEL, 0, 0)
    assert params == round(built["params"] / 1024, 1)
    assert total == round(built["total"] / 1024, 1) == round(4 * NUMEL / 1024, 1)
    # the formula: P + G + K = 4 + 4 + 8 bytes an element with Adam, what the first step
    # allocates (Adam's two moments, plus its step count, one fp32 scalar per tensor)
    assert formula == round(16 * NUMEL / 1024, 1)
    assert stepped["optimizer_state"] == 8 * NUMEL + 4 * 4
    assert stepped["grads"] == 4 * NUMEL


def test_the_summary_names_mixed_precision_and_offload(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ds_strategy")
    config = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
    }
    engine = _engine(config)
    report = engine.memory_report()
    engine.backward(engine(torch.randn(2, IN)).square().mean())
    trained = engine.memory_report()
    engine.destroy()
    (line,) = [m for m in _messages(caplog, "ds_strategy.core.engine") if "ZeRO-" in m]
    assert (
        "ZeRO-2 on 1 rank, fp16 with dynamic loss scaling (scale 256), optimizer offload cpu;"
        in line
    )
    # fp16 parameters and their fp32 master (6 bytes each); fp16 gradients from the backward
    assert report["params"] == 6 * NUMEL and report["grads"] == 0
    assert trained["grads"] == 2 * NUMEL
    assert f"(params {6 * NUMEL / 1024:.1f} KiB, grads 0 bytes until the first backward" in line


def test_no_summary_below_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ds_strategy")
    _engine(ZERO3).destroy()
    assert not [r for r in caplog.records if r.name.startswith("ds_strategy")]


# -- the timing line -----------------------------------------------------------------------------


def test_the_timing_line_is_a_log_record(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO, logger="ds_strategy")
    engine = _engine({**ZERO3, "wall_clock_breakdown": True, "steps_per_print": 1})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, IN)).square().mean())
        engine.step()
    lines = _messages(caplog, "ds_strategy.core.timers")
    assert len(lines) == 2, lines
    assert lines[1] == format_report(engine.timing_report(), 2, 1)
    assert lines[0].startswith("[wall_clock_breakdown] step 1 (mean of 1): ms/step: forward ")
    assert "wall_clock_breakdown" not in capsys.readouterr().out
    # a printer set by the caller (tqdm.write in examples/train_gpt.py) replaces the record
    printed: list[str] = []
    engine.timers.printer = printed.append
    caplog.clear()
    engine.backward(engine(torch.randn(2, IN)).square().mean())
    engine.step()
    engine.destroy()
    assert printed == [format_report(engine.timing_report(), 3, 1)]
    assert _messages(caplog, "ds_strategy.core.timers") == []


# -- progress ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    engine = _engine(ZERO3)
    path = tmp_path_factory.mktemp("progress") / "ckpt"
    engine.save_checkpoint(path)
    engine.destroy()
    return path


@pytest.mark.parametrize("off", [None, ("DS_STRATEGY_PROGRESS", "0"), ("TQDM_DISABLE", "1")])
def test_consolidate_reports_progress_unless_switched_off(
    off: tuple[str, str] | None,
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("DS_STRATEGY_PROGRESS_EVERY", "0")  # a line per tensor
    monkeypatch.delenv("DS_STRATEGY_PROGRESS", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    if off is not None:
        monkeypatch.setenv(*off)
    caplog.set_level(logging.INFO, logger="ds_strategy")
    out = ds_strategy.consolidate(checkpoint, tmp_path / "model.safetensors")
    assert set(load_file(out)) == set(_model().state_dict())  # written either way
    lines = _progress(caplog)
    if off is not None:
        assert lines == []
        return
    n = len(_model().state_dict())  # two weights, two biases
    assert lines == [
        f"consolidating ckpt: {i}/{n} tensors ({100 * i / n:.0f}%)" for i in range(1, n + 1)
    ] + ["consolidating ckpt: done"]


def test_inference_loading_reports_progress(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DS_STRATEGY_PROGRESS_EVERY", "0")
    monkeypatch.delenv("DS_STRATEGY_PROGRESS", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    caplog.set_level(logging.INFO, logger="ds_strategy")
    model = _model()
    expected = model(torch.ones(1, IN))
    engine = ds_strategy.init_inference(model, ZERO3)
    torch.testing.assert_close(engine(torch.ones(1, IN)), expected)
    engine.destroy()
    units = len(engine.units)
    lines = _progress(caplog)
    assert lines == [
        f"loading the weights (ZeRO-3): {i}/{units} units ({100 * i / units:.0f}%)"
        for i in range(1, units + 1)
    ] + ["loading the weights (ZeRO-3): done"]


# -- warning categories --------------------------------------------------------------------------


def test_warning_categories_and_their_bases() -> None:
    assert issubclass(DsStrategyWarning, UserWarning)
    # the config's warnings are kinds of it too: one filter covers every ds_strategy warning
    for kind in (UnsupportedConfigWarning, UnknownConfigKeyWarning, DeprecatedConfigWarning):
        assert issubclass(kind, DsStrategyWarning)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DsStrategyWarning)
        with pytest.raises(UnknownConfigKeyWarning, match="zzz_not_a_key"):
            load_config({"zzz_not_a_key": 1})
    for kind in (PerformanceWarning, CheckpointWarning, FrontEndWarning):
        # filters written for the warnings before they had kinds still match
        assert issubclass(kind, DsStrategyWarning) and issubclass(kind, RuntimeWarning)
        assert not issubclass(kind, DeprecationWarning)
    assert issubclass(DsStrategyDeprecationWarning, DeprecationWarning)
    assert not issubclass(DsStrategyDeprecationWarning, UserWarning)


def test_warnings_are_given_with_their_kind(tmp_path: Path) -> None:
    params = {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_first_step_size": 2}
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0, momentum=0.3)
    with pytest.warns(DsStrategyWarning, match="cycle_momentum: SGD has no betas"):
        build_scheduler("OneCycle", params, sgd)
    final = tmp_path / "step1"
    (tmp_path / "step1.old").mkdir()
    (tmp_path / "step1.old" / swap.META_FILE).write_text("{}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert swap.committed(final) == tmp_path / "step1.old"
    assert [w.category for w in caught] == [CheckpointWarning], caught


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("off", [False, True])
def test_on_a_terminal_progress_is_a_tqdm_bar(off: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_strategy.core.progress import Progress

    monkeypatch.setenv("DS_STRATEGY_PROGRESS", "0" if off else "1")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = Progress("building the ZeRO-3 model", 4, rank=0, unit="units", every=0)
    for _ in range(4):
        progress.advance()
    progress.done()
    shown = terminal.getvalue()
    if off:
        assert progress.bar is None and shown == ""
        return
    assert "building the ZeRO-3 model" in shown and "4/4" in shown and "units" in shown
    assert Progress("x", 4, rank=1, every=0).bar is None  # rank 0 only
