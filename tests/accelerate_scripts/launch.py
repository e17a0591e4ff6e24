"""Run one of the scripts in this folder under ``accelerate launch`` with the shipped
``configs/accelerate/cpu_2proc.yaml`` on a free port, with a timeout that kills the whole
process tree (so a hang fails fast)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.distributed import free_port, run_command

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "accelerate_scripts"
CPU_CONFIG = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"


def launch(
    script: str,
    *args: str,
    num_processes: int | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    config: Path = CPU_CONFIG,
) -> None:
    """``accelerate launch --config_file cpu_2proc.yaml [--num_processes N]
    --main_process_port <free> script args`` (``config``: another accelerate config file)."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        "--config_file",
        str(config),
        *(["--num_processes", str(num_processes)] if num_processes is not None else []),
        "--main_process_port",
        str(free_port()),
        str(SCRIPTS / script),
        *args,
    ]
    # the launch under test decides these, not whatever the calling shell had set
    full_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DS_STRATEGY_", "ACCELERATE_"))
    }
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    run_command(cmd, ROOT, full_env, timeout, script)
