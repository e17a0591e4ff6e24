"""Everything that needs a CUDA device, in one command and one report, in under 8 minutes.

    python benchmarks/gpu_check.py                  # writes gpu_check.md
    python benchmarks/gpu_check.py --out report.md --budget 480

Runs, each in its own process with its share of the time budget:

1. the suite's ``gpu`` tests (``pytest -m gpu``: every stage against plain PyTorch on the
   device, collectives on their own CUDA streams, the engine's device placement);
2. ``bench_zero.py --device cuda`` on every GPU of the machine (NCCL): DDP, FSDP2 and ZeRO
   stages 1-3, model state at every point of a step and step time;
3. ``gpu_offload_check.py`` with a search bounded to fit the budget: ZeRO-3 with the
   optimizer state and parameters offloaded to pinned host memory, the largest GPT that
   trains, its step time and GPU peak.

The report (Markdown) names the device, torch and NCCL versions, and for every part its
command, exit status, seconds and output (its tables as printed). A part that runs past its
share is stopped and reported as such; the others still run. Exits 0 only if every part
passed. Without a CUDA device it says so and exits 2, having run nothing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parts(gpus: int) -> list[tuple[str, list[str], float]]:
    """(name, command, share of the budget) of every part."""
    py = sys.executable
    return [
        (
            "gpu tests",
            [py, "-m", "pytest", "-q", "-m", "gpu", "-n0", "-p", "no:cacheprovider"],
            0.3,
        ),
        (
            "bench_zero on CUDA",
            [
                py,
                str(HERE / "bench_zero.py"),
                "--device",
                "cuda",
                "--world",
                str(gpus),
                "--steps",
                "6",
                "--micro",
                "8",
            ],
            0.35,
        ),  # fmt: skip
        (
            "CPU offload on the GPU",
            [
                py,
                str(HERE / "gpu_offload_check.py"),
                "--d",
                "2048",
                "--heads",
                "16",
                "--seq",
                "512",
                "--max-layers",
                "32",
                "--timeout",
                "60",
            ],
            0.35,
        ),  # fmt: skip
    ]


def run_part(command: list[str], limit: float) -> tuple[str, int | None, float]:
    """Its output, exit status (None: stopped at ``limit`` seconds) and seconds."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=limit,
        )
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        output = _text(e.stdout) + _text(e.stderr) + f"\n(stopped after {limit:.0f} s)"
        code = None
    return output, code, time.perf_counter() - start


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def header() -> list[str]:
    props = torch.cuda.get_device_properties(0)
    nccl = (
        ".".join(map(str, torch.cuda.nccl.version()))
        if torch.distributed.is_nccl_available()
        else "none"
    )
    return [
        "# GPU check",
        "",
        f"- device: {torch.cuda.device_count()} x {props.name}, "
        f"{props.total_memory / 2**30:.0f} GiB each",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("gpu_check.md"), help="the report")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for all parts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was run", file=sys.stderr)
        return 2
    lines = header()
    passed = True
    for name, command, share in parts(torch.cuda.device_count()):
        print(f"gpu_check: {name} ...", flush=True)
        output, code, seconds = run_part(command, share * args.budget)
        status = (
            "passed"
            if code == 0
            else ("stopped: out of time" if code is None else f"failed ({code})")
        )
        passed &= code == 0
        lines += [
            f"## {name}: {status}, {seconds:.0f} s",
            "",
            "`" + " ".join(Path(c).name if c.endswith(".py") else c for c in command) + "`",
            "",
            "```",
            output.strip()[-6000:],
            "```",
            "",
        ]
        print(f"gpu_check: {name}: {status} in {seconds:.0f} s", flush=True)
    args.out.write_text("\n".join(lines))
    print(f"gpu_check: wrote {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
