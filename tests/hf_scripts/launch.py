"""Start ``trainer_runs.py`` on two CPU processes with ``torchrun`` or ``accelerate launch`` (the
shipped ``configs/accelerate/cpu_2proc.yaml``), on a free port, with a timeout that kills the
whole process tree."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.distributed import free_port, run_command

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "hf_scripts" / "trainer_runs.py"


def launch(launcher: str, *args: str, timeout: float = 300) -> None:
    port = str(free_port())
    if launcher == "torchrun":
        head = ["-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}"]
    else:
        config = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"
        head = [
            "-m",
            "accelerate.commands.accelerate_cli",
            "launch",
            "--config_file",
            str(config),
            "--main_process_port",
            port,
        ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DS_STRATEGY_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1")
    run_command([sys.executable, *head, str(SCRIPT), *args], ROOT, env, timeout, SCRIPT.name)
