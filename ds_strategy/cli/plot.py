"""``ds-strategy plot RUN_DIR``: PNG figures of a run from the CSV monitor's files and the
memory timeline, with matplotlib (the optional ``plot`` extra).

[Note: what is read, what is drawn]
The CSV monitor writes one file per event in ``output_path/job_name/``
(``Train_Samples_train_loss.csv``: columns ``step`` = global samples and the value), and with
``memory_timeline`` on every rank writes ``memory_timeline_<rank>.csv`` beside them
(``core/memory_timeline.py``). RUN_DIR is that job directory, or the ``output_path`` above
it (each job directory in it is drawn). Figures, each skipped with a line saying so when its
files are absent:

- ``loss_lr.png``: ``train_loss`` and ``lr`` against samples;
- ``phase_times.png``: per step, forward, backward (its compute, then the time blocked on
  gradient reductions inside it) and the optimizer step stacked (``wall_clock_breakdown``'s
  ``elapsed_time_ms_*`` family; the step's own wait for reductions is inside ``step``);
  under a pipeline, the schedule (every micro-batch's forward and backward) and the step;
- ``memory_timeline.png``: each rank's model-state bytes through one optimizer step, with
  its ZeRO formula line and its peak marked;
- ``sent_bytes.png``: bytes rank 0 sent per step, split intra/inter-machine where the files
  hold that split.

Nothing here is imported by ``import ds_strategy``; matplotlib is imported when a figure is
drawn, and its absence is an error naming the extra.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["INSTALL", "add_cli_parser", "new_figure", "plot_run", "run_cli", "save_figure"]

INSTALL = "pip install 'ds_strategy[plot]' (or matplotlib)"
DPI = 80
SIZE = (8.0, 4.5)  # inches: 640 x 360 pixels at DPI
PREFIX = "Train_Samples_"
PHASES = (  # (label, how to get the ms from the step's timings)
    ("forward + backward (pipeline schedule)", lambda t: t.get("schedule")),
    ("forward", lambda t: t.get("forward")),
    ("backward compute", lambda t: t.get("backward_inner")),
    ("backward blocked on reductions", lambda t: _blocked(t)),
    ("optimizer step", lambda t: t.get("step")),
)


def _blocked(timings: dict[str, float]) -> float | None:
    if "backward" not in timings or "backward_inner" not in timings:
        return None
    return max(0.0, timings["backward"] - timings["backward_inner"])


def new_figure() -> Any:
    """A matplotlib Figure drawn off-screen (no pyplot, no global state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"ds-strategy plot needs matplotlib: {INSTALL}") from e
    fig = Figure(figsize=SIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def read_series(job_dir: Path, name: str) -> tuple[list[float], list[float]]:
    """The ``(samples, values)`` of ``Train_Samples_<name>.csv``; empty when absent."""
    path = job_dir / f"{PREFIX}{name}.csv"
    if not path.exists():
        return [], []
    xs: list[float] = []
    ys: list[float] = []
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if not row or row[0] == "step":
                continue  # DeepSpeed's header (once per file; again after a resume's append)
            xs.append(float(row[0]))
            ys.append(float(row[1]))
    return xs, ys


def read_timelines(job_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's ``memory_timeline_<rank>.csv``, by rank (numbers as numbers)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(job_dir.glob("memory_timeline_*.csv")):
        rank = path.stem.rsplit("_", 1)[-1]
        if not rank.isdigit():
            continue
        with path.open(newline="") as f:
            rows = [
                {k: v if k in ("phase", "event") else float(v) for k, v in row.items()}
                for row in csv.DictReader(f)
            ]
        if rows:
            out[int(rank)] = rows
    return out


def plot_loss_lr(job_dir: Path, out: Path) -> str | None:
    """``loss_lr.png``; the reason it was skipped, or None."""
    xs, loss = read_series(job_dir, "train_loss")
    if not xs:
        return f"no {PREFIX}train_loss.csv"
    fig = new_figure()
    ax = fig.add_subplot()
    ax.plot(xs, loss, color="tab:blue", marker=".", label="train_loss")
    ax.set_xlabel("samples")
    ax.set_ylabel("train loss", color="tab:blue")
    lr_x, lr = read_series(job_dir, "lr")
    if lr_x:
        ax2 = ax.twinx()
        ax2.plot(lr_x, lr, color="tab:orange", label="lr")
        ax2.set_ylabel("learning rate", color="tab:orange")
    ax.set_title("Training loss and learning rate")
    ax.grid(alpha=0.3)
    save_figure(fig, out / "loss_lr.png")
    return None


def plot_phase_times(job_dir: Path, out: Path) -> str | None:
    """``phase_times.png``: the step's phases stacked, per logged step."""
    series = {
        n: dict(zip(*read_series(job_dir, f"elapsed_time_ms_{n}"), strict=True))
        for n in ("schedule", "forward", "backward", "backward_inner", "step")
    }
    samples = sorted(set().union(*(s.keys() for s in series.values())))
    if not samples:
        return f"no {PREFIX}elapsed_time_ms_*.csv (wall_clock_breakdown off?)"
    fig = new_figure()
    ax = fig.add_subplot()
    width = _bar_width(samples)
    bottom = [0.0] * len(samples)
    for label, get in PHASES:
        values = [get({n: s[x] for n, s in series.items() if x in s}) for x in samples]
        if all(v is None for v in values):
            continue
        heights = [v or 0.0 for v in values]
        ax.bar(samples, heights, width, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xlabel("samples")
    ax.set_ylabel("ms per step")
    ax.set_ylim(top=max(bottom) * 1.3)  # room for the legend above the bars
    ax.set_title("Time per step by phase (rank 0)")
    ax.legend(loc="upper center", fontsize="small", ncol=len(PHASES))
    save_figure(fig, out / "phase_times.png")
    return None


def plot_memory(job_dir: Path, out: Path) -> str | None:
    """``memory_timeline.png``: every rank's model state through one step."""
    timelines = read_timelines(job_dir)
    if not timelines:
        return "no memory_timeline_<rank>.csv (memory_timeline off?)"
    fig = new_figure()
    ax = fig.add_subplot()
    mib = 2.0**20
    for rank, rows in timelines.items():
        t0 = rows[0]["time_s"]
        xs = [(r["time_s"] - t0) * 1e3 for r in rows]
        ys = [r["total"] / mib for r in rows]
        top = max(range(len(ys)), key=ys.__getitem__)
        label = f"rank {rank} (peak {ys[top]:.2f} MiB)"
        (line,) = ax.step(xs, ys, where="post", label=label, linewidth=1)
        color = line.get_color()
        formula = rows[0]["formula"] / mib
        ax.axhline(formula, color=color, linestyle="--", linewidth=1, label=f"rank {rank} formula")
        ax.plot([xs[top]], [ys[top]], marker="v", color=color, markersize=8)
    _shade_phases(ax, timelines[min(timelines)])
    step = int(timelines[min(timelines)][0]["step"])
    ax.set_xlabel(f"ms into optimizer step {step}")
    ax.set_ylabel("model-state MiB")
    ax.set_title("Model state through one step: held, ZeRO formula (dashed), peak (v)", pad=14)
    ax.legend(loc="lower right", fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
    save_figure(fig, out / "memory_timeline.png")
    return None


def _shade_phases(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Background bands for the phases of one rank's events (forward, backward, step)."""
    colors = {"forward": "tab:green", "backward": "tab:red", "step": "tab:purple"}
    t0 = rows[0]["time_s"]
    start = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and rows[i]["phase"] == rows[start]["phase"]:
            continue
        phase = rows[start]["phase"]
        if phase in colors:
            a = (rows[start]["time_s"] - t0) * 1e3
            b = (rows[i - 1]["time_s"] - t0) * 1e3
            ax.axvspan(a, b, color=colors[phase], alpha=0.08, linewidth=0)
            ax.text(
                (a + b) / 2,
                1.0,
                phase,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize="x-small",
                color=colors[phase],
            )
        start = i


def plot_sent_bytes(job_dir: Path, out: Path) -> str | None:
    """``sent_bytes.png``: bytes sent per step, by link where recorded."""
    parts = [
        (lab, *read_series(job_dir, f"sent_bytes_{k}"))
        for lab, k in (("intra-machine", "intra_machine"), ("inter-machine", "inter_machine"))
    ]
    parts = [p for p in parts if p[1]]
    if not parts:
        xs, ys = read_series(job_dir, "sent_bytes")
        parts = [("all links", xs, ys)] if xs else []
    if not parts:
        return f"no {PREFIX}sent_bytes.csv"
    fig = new_figure()
    ax = fig.add_subplot()
    xs = parts[0][1]
    width = _bar_width(xs)
    bottom = [0.0] * len(xs)
    for label, px, py in parts:
        mb = [v / 1e6 for v in py]
        ax.bar(px, mb, width, bottom=bottom[: len(px)], label=label)
        bottom = [b + h for b, h in zip(bottom, mb, strict=False)]
    ax.set_xlabel("samples")
    ax.set_ylabel("MB sent per step (rank 0)")
    ax.set_title("Bytes sent per optimizer step")
    ax.legend(loc="lower right", fontsize="small")
    save_figure(fig, out / "sent_bytes.png")
    return None


FIGURES: tuple[tuple[str, Callable[[Path, Path], str | None]], ...] = (
    ("loss_lr.png", plot_loss_lr),
    ("phase_times.png", plot_phase_times),
    ("memory_timeline.png", plot_memory),
    ("sent_bytes.png", plot_sent_bytes),
)


def _bar_width(xs: list[float]) -> float:
    """Most of the smallest gap between logged steps (1 with a single one)."""
    gaps = [b - a for a, b in zip(xs, xs[1:], strict=False)]
    return 0.8 * (min(gaps) if gaps else 1.0)


def save_figure(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def job_dirs(run_dir: Path) -> list[Path]:
    """RUN_DIR itself when it holds the monitor's files, else its job directories that do."""

    def holds(d: Path) -> bool:
        return any(d.glob(f"{PREFIX}*.csv")) or any(d.glob("memory_timeline_*.csv"))

    if holds(run_dir):
        return [run_dir]
    return sorted(d for d in run_dir.iterdir() if d.is_dir() and holds(d))


def plot_run(
    run_dir: str | Path, out: str | Path | None = None, say: Callable[[str], Any] = print
) -> list[Path]:
    """Draw every figure of the run in ``run_dir`` into ``out`` (default: each job's
    ``plots/``; with several jobs, ``out/<job_name>/``); returns the PNGs written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"ds-strategy plot: {run_dir} is not a directory")
    jobs = job_dirs(run_dir)
    if not jobs:
        raise FileNotFoundError(
            f"ds-strategy plot: no CSV monitor files (Train_Samples_*.csv, "
            f"memory_timeline_<rank>.csv) in {run_dir} or its job directories; enable "
            f"csv_monitor (and memory_timeline) in the config"
        )
    new_figure()  # matplotlib's absence fails here, before anything is written
    written: list[Path] = []
    for job in jobs:
        target = Path(out) if out is not None else job / "plots"
        if out is not None and len(jobs) > 1:
            target = target / job.name
        target.mkdir(parents=True, exist_ok=True)
        for name, draw in FIGURES:
            skipped = draw(job, target)
            if skipped is None:
                written.append(target / name)
                say(f"wrote {target / name}")
            else:
                say(f"skipped {name}: {skipped}")
    return written


def add_cli_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="PNG figures of a run from its CSV monitor files and memory timeline",
        description="Draw loss and lr, time per step by phase, each rank's model state through "
        "one step against the ZeRO formula, and bytes sent per step, from the files csv_monitor "
        f"and memory_timeline write. Needs matplotlib: {INSTALL}.",
    )
    p.add_argument("run_dir", help="csv_monitor's output_path/job_name, or its output_path")
    p.add_argument("--out", default=None, help="where the PNGs go (default: <job dir>/plots)")


def run_cli(args: argparse.Namespace) -> int:
    try:
        plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ImportError) as e:
        print(
            f"ds-strategy plot: {e}" if "ds-strategy plot" not in str(e) else str(e),
            file=sys.stderr,
        )
        return 2
    return 0
