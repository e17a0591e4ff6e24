"""DeepSpeed's monitor sections: the engine's training events, written on rank 0 every
``steps_per_print`` steps with DeepSpeed's names, x axis and file layout (``core/monitor``)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_strategy
from ds_strategy.config import load_config
from ds_strategy.core.monitor import (
    CometMonitor,
    CSVMonitor,
    Event,
    Monitor,
    TensorBoardMonitor,
    WandbMonitor,
)
from ds_strategy.core.monitor.csv_monitor import csv_file_name

from .distributed import run_ranks
from .models import ToyLM, batches, lm_loss

STEPS, PRINT_EVERY, MICRO, ACCUMULATION, WORLD = 20, 5, 2, 2, 2
TRAIN_BATCH = MICRO * ACCUMULATION * WORLD
TIMINGS = [
    f"Train/Samples/elapsed_time_ms_{p}"
    for p in ("forward", "backward", "backward_inner", "backward_allreduce", "step")
]
OURS = ["Train/Samples/model_state_bytes", "Train/Samples/peak_model_state_bytes"]
TAGS = {
    "Train/Samples/train_loss",
    "Train/Samples/lr",
    "Train/Samples/sent_bytes",
    "Train/Samples/sent_bytes_intra_machine",
    "Train/Samples/sent_bytes_inter_machine",
    *TIMINGS,
    *OURS,
}


def _deepspeed_json(out: Path, stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "steps_per_print": PRINT_EVERY,
        "wall_clock_breakdown": True,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 30},
        },
        "tensorboard": {"enabled": True, "output_path": str(out / "tb"), "job_name": "job"},
        "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "job"},
    }


def _train(rank: int, world: int, root: str, stage: int) -> dict[str, Any]:
    path = Path(root) / f"ds_config_rank{rank}.json"
    path.write_text(json.dumps(_deepspeed_json(Path(root), stage)))
    torch.manual_seed(0)
    model = ToyLM()
    engine = ds_strategy.initialize(model, None, str(path))
    engine.timers.printer = lambda line: None
    data = batches(STEPS, ACCUMULATION, MICRO * WORLD, seed=1)
    losses, lrs, sent, memory = [], [], [], []
    for i, tokens in enumerate(data):
        loss = lm_loss(engine, tokens[rank * MICRO : (rank + 1) * MICRO])
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
        if (i + 1) % ACCUMULATION == 0:
            lrs.append(engine.get_lr()[0])
            sent.append(sum(engine.comm.sent_total.values()))
            memory.append(engine.memory_report())
    writers = len(engine.monitor.monitors)
    engine.destroy()
    return {"losses": losses, "lrs": lrs, "sent": sent, "memory": memory, "writers": writers}


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _csv_rows(log_dir: Path, name: str) -> tuple[list[str], list[tuple[int, float]]]:
    with (log_dir / csv_file_name(name)).open() as f:
        header, *rows = list(csv.reader(f))
    return header, [(int(s), float(v)) for s, v in rows]


@pytest.mark.parametrize("stage", [1, 3])
def test_two_ranks_write_deepspeeds_events_on_rank_0(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("tensorboard")
    results = run_ranks(_train, WORLD, str(tmp_path), stage, timeout=240)
    # rank 1 writes nothing: it holds no writer, the directory holds one event file, and
    # every CSV row below appears once
    assert [r["writers"] for r in results] == [2, 0]
    assert len(list((tmp_path / "tb" / "job").glob("events.out.tfevents.*"))) == 1
    printed = range(PRINT_EVERY, STEPS + 1, PRINT_EVERY)  # steps_per_print honoured
    samples = [s * TRAIN_BATCH for s in printed]
    # the loss: mean over the step's micro-batches and both ranks
    expected: dict[str, list[float]] = {"Train/Samples/train_loss": [], "Train/Samples/lr": []}
    for s in printed:
        micro = slice((s - 1) * ACCUMULATION, s * ACCUMULATION)
        per_rank = [sum(r["losses"][micro]) / ACCUMULATION for r in results]
        expected["Train/Samples/train_loss"].append(sum(per_rank) / WORLD)
        expected["Train/Samples/lr"].append(results[0]["lrs"][s - 1])
    sent = [0, *(results[0]["sent"][s - 1] for s in printed)]
    expected["Train/Samples/sent_bytes"] = [
        (b - a) / PRINT_EVERY for a, b in zip(sent, sent[1:], strict=False)
    ]
    # both ranks on one machine: every byte went over the intra-machine link
    expected["Train/Samples/sent_bytes_intra_machine"] = expected["Train/Samples/sent_bytes"]
    expected["Train/Samples/sent_bytes_inter_machine"] = [0.0] * len(printed)
    expected[OURS[0]] = [results[0]["memory"][s - 1]["total"] for s in printed]
    expected[OURS[1]] = [results[0]["memory"][s - 1]["peak"] for s in printed]
    assert len(set(expected["Train/Samples/lr"])) == len(printed)  # WarmupLR: lr changes

    scalars = _tensorboard_scalars(tmp_path / "tb" / "job")
    assert set(scalars) == TAGS
    for tag, values in expected.items():
        assert [s for s, _ in scalars[tag]] == samples, tag
        assert [v for _, v in scalars[tag]] == pytest.approx(values, rel=1e-6), tag
    for tag in TIMINGS:
        assert all(v >= 0 for _, v in scalars[tag]) and [s for s, _ in scalars[tag]] == samples
    forward, backward = (sum(v for _, v in scalars[TIMINGS[i]]) for i in (0, 1))
    assert forward > 0 and backward > 0

    csv_dir = tmp_path / "csv" / "job"
    assert {p.name for p in csv_dir.iterdir()} == {csv_file_name(t) for t in TAGS}
    for tag in TAGS:
        header, rows = _csv_rows(csv_dir, tag)
        assert header == ["step", tag.rsplit("/", 1)[-1]]
        assert [s for s, _ in rows] == samples
        # the same values as the event file (which holds them as float32)
        assert [v for _, v in rows] == pytest.approx([v for _, v in scalars[tag]], rel=1e-6)
        if tag in expected:
            assert [v for _, v in rows] == pytest.approx(expected[tag], rel=1e-6), tag


# ----------------------------------------------------------------------- one process, fp16


def _steps(engine: Any, n: int, accumulation: int = 1) -> list[float]:
    losses = []
    torch.manual_seed(3)
    for _ in range(n * accumulation):
        loss = engine(torch.randn(4, 8)).square().mean()
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def test_fp16_writes_the_loss_scale_and_no_timings_without_the_breakdown(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 2)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 2,
        "fp16": {"enabled": True, "initial_scale_power": 5, "loss_scale_window": 2},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "fp16"},
    }
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    losses = _steps(engine, 2)
    scale = engine.loss_scale  # the scale after step 2, which the event holds
    _steps(engine, 1)
    assert engine.loss_scale != scale  # it changed at step 3, after the write
    log_dir = tmp_path / "fp16"
    assert not (log_dir / csv_file_name(TIMINGS[0])).exists()
    header, rows = _csv_rows(log_dir, "Train/Samples/loss_scale")
    assert header == ["step", "loss_scale"] and rows == [(8, scale)]
    _, rows = _csv_rows(log_dir, "Train/Samples/train_loss")
    assert rows == [(8, pytest.approx(losses[1]))]  # the step's loss, before any scaling


def test_a_monitor_without_its_package_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    missing = {"tensorboard", "wandb", "comet_ml"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    model = torch.nn.Linear(8, 2)
    for section, install in (
        ("tensorboard", r"pip install 'ds_strategy\[monitor\]' \(or tensorboard\)"),
        ("wandb", "pip install wandb"),
        ("comet", "pip install comet_ml"),
    ):
        config = {section: {"enabled": True}, "train_micro_batch_size_per_gpu": 1}
        with pytest.raises(ImportError, match=rf"^{section}.enabled is true .*{install}"):
            ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


class _Recorder(Monitor):
    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.events: list[Event] = []

    def write_events(self, events: Any) -> None:
        self.events += events


def test_a_shared_run_gets_no_timings_that_a_front_end_sink_logs_already() -> None:
    model = torch.nn.Linear(8, 2)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": "unused"},
    }
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    engine.timers.printer = lambda line: None
    own, shared = _Recorder(False), _Recorder(True)
    engine.monitor.monitors = [own, shared]
    _steps(engine, 1)
    assert {e.name for e in own.events} == {e.name for e in shared.events} | set(TIMINGS)
    engine.timers.add_sink(lambda report, step: None)  # as a front end's timing sink
    own.events.clear(), shared.events.clear()
    _steps(engine, 1)
    assert set(TIMINGS) <= {e.name for e in own.events}
    assert not set(TIMINGS) & {e.name for e in shared.events}
    assert {e.step for e in own.events} == {8}


def test_monitor_sections_are_deepspeeds_keys_and_no_longer_warn() -> None:
    data = {
        "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "run1"},
        "csv_monitor": {"enabled": False},
        "wandb": {"enabled": False, "group": "g", "team": "t", "project": "p"},
        "comet": {"enabled": False, "samples_log_interval": 50, "mode": "get_or_create"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(data, strict=True)
    assert (cfg.tensorboard.output_path, cfg.tensorboard.job_name) == ("logs/", "run1")
    assert cfg.csv_monitor.job_name == "DeepSpeedJobName" and cfg.wandb.team == "t"
    assert cfg.comet.samples_log_interval == 50 and cfg.comet.online is None
    with pytest.raises(ValueError, match=r"comet.mode: got 'fetch'"):
        load_config({"comet": {"mode": "fetch"}})


# ----------------------------------------------------------------------------- the writers


def test_csv_monitor_appends_under_deepspeeds_names(tmp_path: Path) -> None:
    m = CSVMonitor(tmp_path, "job")
    m.write_events([Event("Train/Samples/train_loss", 1.5, 8), Event("Train/Samples/lr", 0.1, 8)])
    m.write_events([Event("Train/Samples/train_loss", 1.25, 16)])
    assert sorted(p.name for p in m.log_dir.iterdir()) == [
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
    assert _csv_rows(m.log_dir, "Train/Samples/train_loss") == (
        ["step", "train_loss"],
        [(8, 1.5), (16, 1.25)],
    )
    # a resumed run appends to the same files without a second header
    CSVMonitor(tmp_path, "job").write_events([Event("Train/Samples/train_loss", 1.0, 24)])
    _, rows = _csv_rows(m.log_dir, "Train/Samples/train_loss")
    assert rows == [(8, 1.5), (16, 1.25), (24, 1.0)]
    assert csv_file_name("a b/c") == "a_b_c.csv"


def test_tensorboard_monitor_creates_its_file_at_the_first_write(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    m = TensorBoardMonitor(tmp_path, "job")
    assert not (tmp_path / "job").exists()
    m.write_events([Event("Train/Samples/train_loss", 2.0, 8), Event("Train/Samples/lr", 0.5, 8)])
    m.write_events([Event("Train/Samples/train_loss", 1.0, 16)])
    m.close()
    assert _tensorboard_scalars(tmp_path / "job") == {
        "Train/Samples/train_loss": [(8, 2.0), (16, 1.0)],
        "Train/Samples/lr": [(8, 0.5)],
    }


class _FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int | None]] = []
        self.metrics: list[tuple[str, str | None]] = []
        self.finished = False

    def log(self, values: dict, step: int | None = None) -> None:
        self.logged.append((values, step))

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.metrics.append((name, step_metric))

    def finish(self) -> None:
        self.finished = True


def _fake_wandb(monkeypatch: pytest.MonkeyPatch, active: _FakeRun | None) -> list[dict]:
    inits: list[dict] = []
    module = types.ModuleType("wandb")
    module.run = active  # type: ignore[attr-defined]
    module.init = lambda **kw: inits.append(kw) or _FakeRun()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real(name)
    )
    return inits


EVENTS = [Event("Train/Samples/train_loss", 1.5, 8), Event("Train/Samples/lr", 0.1, 8)]


def test_wandb_monitor_own_run_logs_at_global_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    inits = _fake_wandb(monkeypatch, None)
    m = WandbMonitor("proj", "grp", "team")
    assert inits == [{"project": "proj", "group": "grp", "entity": "team"}] and not m.shared
    m.write_events([*EVENTS, Event("Train/Samples/train_loss", 1.0, 16)])
    assert m.run.logged == [
        ({"Train/Samples/train_loss": 1.5, "Train/Samples/lr": 0.1}, 8),
        ({"Train/Samples/train_loss": 1.0}, 16),
    ]
    m.close()
    assert m.run.finished


def test_wandb_monitor_joins_a_framework_run_without_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    active = _FakeRun()
    inits = _fake_wandb(monkeypatch, active)
    m = WandbMonitor("proj")
    assert m.shared and m.run is active and inits == []
    m.write_events(EVENTS)
    x = "Train/Samples/global_samples"
    assert active.logged == [
        ({"Train/Samples/train_loss": 1.5, "Train/Samples/lr": 0.1, x: 8}, None)
    ]
    assert ("Train/Samples/*", x) in active.metrics
    m.close()
    assert not active.finished  # the framework's run is the framework's to finish


def test_comet_monitor_logs_each_event_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[str, float, int]] = []
    started: list[dict] = []
    experiment = types.SimpleNamespace(
        log_metric=lambda name, value, step: logged.append((name, value, step)),
        set_name=lambda name: started.append({"name": name}),
        end=lambda: None,
    )
    module = types.ModuleType("comet_ml")
    module.start = lambda **kw: started.append(kw) or experiment  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "comet_ml", module)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "comet_ml" else real(n)
    )
    m = CometMonitor(samples_log_interval=16, experiment_name="exp", project="p", mode="create")
    assert started == [{"project": "p", "mode": "create"}, {"name": "exp"}]
    for step in (8, 16, 24, 32):
        m.write_events([Event("Train/Samples/train_loss", step / 8, step)])
    assert logged == [("Train/Samples/train_loss", 1.0, 8), ("Train/Samples/train_loss", 3.0, 24)]


def _engine_run(config: dict[str, Any], steps: int = 4) -> list[tuple[int, float]]:
    """``steps`` optimizer steps of a one-process engine with ``config``'s monitors; returns
    the ``(samples, loss)`` a monitor should hold (``steps_per_print`` 2, batch 4)."""
    model = torch.nn.Linear(8, 2)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2, **config}
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    losses = _steps(engine, steps)
    engine.destroy()
    return [(step * 4, losses[step - 1]) for step in range(2, steps + 1, 2)]


def _wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run file: its records (LevelDB's log format after
    a 7-byte W&B header: 32 KiB blocks of chunks with a 7-byte header each) parsed with
    wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    records, partial = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 or pos + 7 + n > len(data):  # the end, or a chunk not written whole yet
            break
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            records.append(partial)
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_wandb_offline_run_holds_the_losses_at_global_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    expected = _engine_run({"wandb": {"enabled": True, "project": "ds-strategy-test"}})
    (run_file,) = tmp_path.rglob("run-*.wandb")
    # W&B's service writes the file after run.finish() returns, on a busy machine a moment
    # later: read it until the rows are there (or the deadline passes and the assert says so)
    deadline = time.monotonic() + 60
    while True:
        rows = [r for r in _wandb_history(run_file) if "Train/Samples/train_loss" in r]
        if len(rows) >= len(expected) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["_step"], r["Train/Samples/train_loss"]) for r in rows] == [
        (x, pytest.approx(v)) for x, v in expected
    ]
    assert all(r["Train/Samples/lr"] == pytest.approx(0.1) for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("comet_ml") is None, reason="comet_ml not installed")
def test_comet_offline_experiment_holds_the_losses_at_global_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zipfile

    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    comet = {
        "enabled": True,
        "online": False,
        "project": "ds-strategy-test",
        "experiment_name": "offline",
        "samples_log_interval": 1,
    }
    expected = _engine_run({"comet": comet})
    (archive,) = tmp_path.glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
    metrics = [m["payload"]["metric"] for m in messages if m["type"] == "metric_msg"]
    losses = [m for m in metrics if m["metricName"] == "Train/Samples/train_loss"]
    assert [(m["step"], m["metricValue"]) for m in losses] == [
        (x, pytest.approx(v)) for x, v in expected
    ]


def test_non_finite_loss_is_not_hidden() -> None:
    # a step with no backward on any rank has no loss: written as nan, not as 0
    from ds_strategy.core.collectives import Comm
    from ds_strategy.core.monitor import TrainingMonitor

    m = TrainingMonitor(
        [], Comm(), torch.device("cpu"), steps_per_print=1, train_batch_size=1, fp16=False
    )
    assert math.isnan(m._reduced_loss())
    m.add_loss(torch.tensor([1.0, 3.0]))
    m.add_loss(torch.tensor(4.0))
    assert m._reduced_loss() == 3.0


# --------------------------------------------------------------------- under a front end


def _lightning_fit(rank: int, world: int, root: str) -> list[float]:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from ds_strategy.lightning import ZeroStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 2)
            self.losses: list[float] = []

        def training_step(self, batch: torch.Tensor, i: int) -> torch.Tensor:
            loss = self.net(batch).square().mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monitor = {"enabled": True, "output_path": str(Path(root, "monitor")), "job_name": "job"}
    config = {"steps_per_print": 2, "wall_clock_breakdown": True, "csv_monitor": monitor}
    torch.manual_seed(0)
    module = Module()
    trainer = L.Trainer(
        strategy=ZeroStrategy(config=config),
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=CSVLogger(root, name="lightning"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4))
    return module.losses


def test_under_lightning_the_monitor_and_the_trainers_logger_both_get_their_numbers(
    tmp_path: Path,
) -> None:
    [losses] = run_ranks(_lightning_fit, 1, str(tmp_path), timeout=120)
    # the monitor's files: the steps' losses (x: steps, as the config gives no batch size)
    _, rows = _csv_rows(tmp_path / "monitor" / "job", "Train/Samples/train_loss")
    assert rows == [(2, pytest.approx(losses[1])), (4, pytest.approx(losses[3]))]
    # the Trainer's logger still gets the timings as before, and none of the monitor's events
    [metrics] = tmp_path.glob("lightning/version_*/metrics.csv")
    with metrics.open() as f:
        columns = next(csv.reader(f))
    assert "wall_clock/backward_ms" in columns
    assert not [c for c in columns if c.startswith("Train/")]


def test_a_comet_api_key_stays_out_of_checkpoints(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 2)
    config = {"train_micro_batch_size_per_gpu": 4, "comet": {"api_key": "sEcReT-kEy-123"}}
    engine = ds_strategy.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    assert engine.config.comet.api_key == "sEcReT-kEy-123"
    _steps(engine, 1)
    saved = engine.save_checkpoint(tmp_path / "ckpt")
    files = [p for p in saved.rglob("*") if p.is_file()]
    assert files and not any(b"sEcReT-kEy-123" in p.read_bytes() for p in files)


def _train_across_machines(rank: int, world: int, root: str) -> None:
    config = _deepspeed_json(Path(root), 3)
    config["topology"] = {"ranks_per_machine": 1}  # each rank a machine of its own
    config["steps_per_print"] = 1
    del config["tensorboard"]
    torch.manual_seed(0)
    engine = ds_strategy.initialize(ToyLM(), None, config)
    for tokens in batches(2, ACCUMULATION, MICRO * WORLD, seed=1):
        engine.backward(lm_loss(engine, tokens[rank * MICRO : (rank + 1) * MICRO]))
        engine.step()
    engine.destroy()


def test_bytes_sent_are_split_by_the_link_they_crossed(tmp_path: Path) -> None:
    """Two ranks on two machines: every byte of the step crossed the inter-machine link."""
    run_ranks(_train_across_machines, WORLD, str(tmp_path))
    job = tmp_path / "csv" / "job"
    _, total = _csv_rows(job, "Train/Samples/sent_bytes")
    _, inter = _csv_rows(job, "Train/Samples/sent_bytes_inter_machine")
    _, intra = _csv_rows(job, "Train/Samples/sent_bytes_intra_machine")
    assert total and all(v > 0 for _, v in total)
    assert inter == total
    assert all(v == 0 for _, v in intra)
