"""Run one of the scripts in this folder as ``python SCRIPT OUT``, one process per rank started
at once with the launcher's environment (as torchrun or SLURM start a Lightning job: the
Trainer and Fabric see processes created externally), on a free port, with a timeout that
kills every rank. ``tests/test_examples.py`` runs a Lightning script as ``python script.py``,
Lightning's own launcher starting rank 1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.distributed import run_rank_processes

HERE = Path(__file__).resolve().parent


def run_script(
    script: str, out: Path, timeout: float = 240, args: tuple[str, ...] = (), ranks: int = 2
) -> str:
    """Run ``script`` with ``out`` (then ``args``) as its arguments on ``ranks`` processes
    (the ``devices`` its Trainer or Fabric asks for); return their output, or fail with each
    rank's tail."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",  # two ranks on two cores: one thread each
        PYTHONWARNINGS="ignore",
    )
    cmd = [sys.executable, str(HERE / script), str(out), *args]
    return run_rank_processes(cmd, ranks, HERE, env, timeout, script)


def run_for_results(script: str, out: Path, args: tuple[str, ...] = (), ranks: int = 2) -> dict:
    """Run ``script`` (with ``args`` after ``out``) on ``ranks`` processes and load the
    ``results.pt`` it wrote into ``out`` (kept as ``out``)."""
    run_script(script, out, args=args, ranks=ranks)
    results = torch.load(out / "results.pt", weights_only=False)
    results["out"] = out
    return results


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
