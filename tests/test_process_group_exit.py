"""A process group the package created is destroyed at interpreter exit, while Python is still
whole: left to exit-time destructors, gloo aborted a rank that had finished its work about one
run in three ("terminate called without an active exception", examples/first_steps.py on 2
ranks: 2 of 6 runs before, 0 of 5 after)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.distributed import free_port


@pytest.mark.launcher
def test_the_group_the_package_created_is_destroyed_before_the_interpreter_goes() -> None:
    code = textwrap.dedent(
        """
        import atexit, os
        import torch.distributed as dist
        from ds_strategy.core.collectives import init_process_group_from_env

        # registered first, so it runs after the package's own exit handler (LIFO)
        atexit.register(lambda: print("at exit, initialized:", dist.is_initialized()))
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        assert init_process_group_from_env()
        print("initialized:", dist.is_initialized())
        """
    )
    env = {"MASTER_PORT": str(free_port()), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["initialized: True", "at exit, initialized: False"]


@pytest.mark.launcher
def test_a_group_the_program_created_is_left_to_the_program() -> None:
    code = textwrap.dedent(
        """
        import atexit
        import torch.distributed as dist
        from ds_strategy.core.collectives import init_process_group_from_env

        atexit.register(lambda: print("at exit, initialized:", dist.is_initialized()))
        dist.init_process_group("gloo", rank=0, world_size=1)  # MASTER_ADDR / _PORT: env
        assert not init_process_group_from_env()  # one exists: not the package's to destroy
        """
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "at exit, initialized: True"
