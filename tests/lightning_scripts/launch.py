"""Run one of the scripts in this folder as ``python SCRIPT OUT`` on a free port, with a timeout
that kills the whole process group (Lightning's launcher starts rank 1 as a child, which would
otherwise wait in a collective after rank 0 died)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(script: str, out: Path, timeout: float = 240) -> str:
    """Run ``script`` with ``out`` as its argument; return its output, or fail with its tail."""
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",  # two ranks on two cores: one thread each
        PYTHONWARNINGS="ignore",
    )
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / script), str(out)],
        cwd=HERE,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{script} timed out after {timeout}s:\n{output[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{script} exited with {proc.returncode}:\n{output[-6000:]}")
    return output
