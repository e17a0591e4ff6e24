"""Run one of the scripts in this folder as ``python SCRIPT OUT`` on a free port, with a timeout
that kills the whole process group (Lightning's launcher starts rank 1 as a child, which would
otherwise wait in a collective after rank 0 died)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.distributed import free_port, run_command

HERE = Path(__file__).resolve().parent


def run_script(script: str, out: Path, timeout: float = 240, args: tuple[str, ...] = ()) -> str:
    """Run ``script`` with ``out`` (then ``args``) as its arguments; return its output, or
    fail with its tail."""
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",  # two ranks on two cores: one thread each
        PYTHONWARNINGS="ignore",
    )
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(var, None)
    cmd = [sys.executable, str(HERE / script), str(out), *args]
    return run_command(cmd, HERE, env, timeout, script)


def run_for_results(script: str, out: Path, args: tuple[str, ...] = ()) -> dict:
    """Run ``script`` (with ``args`` after ``out``) and load the ``results.pt`` it wrote into
    ``out`` (kept as ``out``)."""
    run_script(script, out, args=args)
    results = torch.load(out / "results.pt", weights_only=False)
    results["out"] = out
    return results


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
