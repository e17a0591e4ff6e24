"""``ds-strategy env``: what to paste into a bug report, as DeepSpeed's ``ds_report`` and
``accelerate env`` print.

>>> from ds_strategy.cli.env import env_report
>>> report = env_report()
>>> sorted(report)  # doctest: +NORMALIZE_WHITESPACE
['config_defaults', 'cpu', 'ds_strategy', 'front_ends', 'nvme', 'packages', 'python',
 'torch']

[Note: nothing heavy is imported]
The report must work on the broken installs it is meant to describe, and stay quick. Package
versions come from ``importlib.metadata`` and front ends are probed with
``importlib.util.find_spec`` of their framework's top-level package, which finds the package
without running it; importing Lightning or Transformers would take seconds and could fail on the
very problem being reported. The front-end table mirrors the ``require_extra`` call at the top
of each front end's ``__init__.py``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from ..core.collectives import backend_available, distributed_available

__all__ = [
    "NVME_ENV",
    "OPTIONAL_PACKAGES",
    "add_cli_parser",
    "check_path",
    "env_report",
    "format_report",
    "package_version",
    "run_cli",
]

NOT_INSTALLED = "not installed"
NVME_ENV = "DS_STRATEGY_NVME_PATH"
OPTIONAL_PACKAGES = (  # distribution names, as pip knows them
    "lightning",
    "accelerate",
    "transformers",
    "hydra-core",
    "omegaconf",
    "safetensors",
    "torchao",
    "tensorboard",
    "matplotlib",
    "wandb",
    "comet_ml",
    "deepspeed",
    "tqdm",
)
FRONT_ENDS = {  # front end: (the extra that installs it, the packages it imports)
    "ds_strategy.lightning": ("lightning", ("lightning",)),
    "ds_strategy.fabric": ("lightning", ("lightning",)),
    "ds_strategy.accelerate": ("accelerate", ("accelerate",)),
    "ds_strategy.hf": ("hf", ("transformers", "accelerate")),
}
CONFIG_KEYS = (  # dotted keys of load_config(None), as in a DeepSpeed JSON
    "zero_optimization.stage",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device",
    "gradient_clipping",
    "steps_per_print",
)
_PROBE_PREFIX = ".ds_strategy_env_"
_ALIGN = 4096  # O_DIRECT wants the buffer, offset and length aligned to the logical block


def package_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module with no spec
        return False


def _ds_strategy_section() -> dict[str, Any]:
    from .. import __version__

    return {
        "version": __version__,
        "location": str(Path(__file__).resolve().parents[1]),
        "installed_metadata_version": package_version("ds_strategy"),
    }


def _python_section() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
    }


def _torch_section() -> dict[str, Any]:
    has_dist = distributed_available()
    out: dict[str, Any] = {
        "version": torch.__version__,
        "location": str(Path(torch.__file__).parent),
        "cuda_build": torch.version.cuda,
        "rocm_build": getattr(torch.version, "hip", None),
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nccl_version": _nccl_version(),
        "distributed_available": has_dist,
    }
    for backend in ("gloo", "nccl", "mpi"):
        out[f"{backend}_backend"] = backend_available(backend)
    out["devices"] = _devices(out["device_count"]) if out["cuda_available"] else {}
    return out


def _nccl_version() -> str | None:
    """NCCL's version as ``"2.21.5"``; None on a build without NCCL (every CPU build)."""
    if not backend_available("nccl"):
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(version, int):  # old torch: 2.21.5 packed as 22105
        major, rest = divmod(version, 10000 if version >= 10000 else 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    return ".".join(str(v) for v in version)


def _devices(count: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(count):
        try:
            p = torch.cuda.get_device_properties(i)
            gib = p.total_memory / 2**30
            out[f"cuda:{i}"] = f"{p.name} (capability {p.major}.{p.minor}, {gib:.1f} GiB)"
        except RuntimeError as e:  # a device the driver cannot open: say so, keep going
            out[f"cuda:{i}"] = f"error: {e}"
    return out


def _front_ends_section() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for front_end, (extra, needs) in FRONT_ENDS.items():
        missing = [m for m in needs if not _find(m)]
        out[front_end] = {
            "importable": not missing,
            "needs": list(needs),
            "missing": missing,
            "install": f"pip install 'ds_strategy[{extra}]'",
        }
    return out


def _cpu_section() -> dict[str, Any]:
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "usable_cpus": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def check_path(path: str | os.PathLike[str], source: str = "--nvme-path") -> dict[str, Any]:
    """Check ``path`` as an NVMe offload directory; never raises.

    Returns a dict: ``path`` (as resolved), ``source`` (where it came from), ``exists``,
    ``is_dir``, ``writable`` (a temporary file could be created and deleted there),
    ``free_bytes`` (``shutil.disk_usage``; None when the path is not a directory), ``o_direct``
    (a 4 KiB aligned write with ``O_DIRECT`` succeeded; None where the platform has no
    ``O_DIRECT`` or the directory is not writable) and ``problems`` (why a check failed).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     r = check_path(d)
    >>> r["writable"], r["free_bytes"] > 0
    (True, True)
    >>> check_path("/no/such/dir")["exists"]
    False
    """
    p = Path(path).expanduser().absolute()
    out: dict[str, Any] = {
        "path": str(p),
        "source": source,
        "exists": p.exists(),
        "is_dir": p.is_dir(),
        "writable": False,
        "free_bytes": None,
        "o_direct": None,
        "problems": [],
    }
    if not out["is_dir"]:
        out["problems"].append("not a directory" if out["exists"] else "does not exist")
        return out
    try:
        out["free_bytes"] = shutil.disk_usage(p).free
    except OSError as e:
        out["problems"].append(f"disk usage: {e}")
    try:
        fd, name = tempfile.mkstemp(dir=p, prefix=_PROBE_PREFIX)
        os.close(fd)
        os.unlink(name)
        out["writable"] = True
    except OSError as e:
        out["problems"].append(f"not writable: {e}")
        return out
    direct = getattr(os, "O_DIRECT", None)  # Linux only; macOS and Windows have none
    if direct is not None:
        out["o_direct"], problem = _o_direct(p, direct)
        if problem:
            out["problems"].append(problem)
    return out


def _o_direct(directory: Path, o_direct: int) -> tuple[bool, str | None]:
    """Whether an aligned direct write works in ``directory``. Some file systems (tmpfs)
    refuse ``O_DIRECT`` at open, others only at the first write, so both are tried."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=_PROBE_PREFIX)
    os.close(fd)
    buf = mmap.mmap(-1, _ALIGN)  # anonymous maps are page-aligned
    try:
        fd = os.open(name, os.O_WRONLY | o_direct)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True, None
    except OSError as e:
        return False, f"O_DIRECT: {e}"
    finally:
        buf.close()
        os.unlink(name)


def _nvme_section(paths: list[str]) -> list[dict[str, Any]]:
    checks = [check_path(p) for p in paths]
    if os.environ.get(NVME_ENV):
        checks.append(check_path(os.environ[NVME_ENV], source=NVME_ENV))
    return checks


def _config_section() -> dict[str, Any]:
    from ..config import load_config

    cfg = load_config(None)
    out: dict[str, Any] = {}
    for key in CONFIG_KEYS:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        out[key] = value.value if isinstance(value, Enum) else value
    return out


def env_report(nvme_paths: list[str] | None = None) -> dict[str, Any]:
    """The environment a bug report needs, as plain JSON-ready data.

    Returns a dict of sections: ``ds_strategy`` (version, location), ``python``, ``torch``
    (version, CUDA / ROCm build, devices, NCCL, which distributed backends exist), ``packages``
    (each optional dependency's version or ``"not installed"``), ``front_ends`` (whether each
    front end's framework is installed), ``cpu`` (the CPU optimizer's vector capability and
    threads), ``nvme`` (a :func:`check_path` per path in ``nvme_paths`` and in
    ``DS_STRATEGY_NVME_PATH``) and ``config_defaults`` (``load_config(None)``'s main keys).
    """
    return {
        "ds_strategy": _ds_strategy_section(),
        "python": _python_section(),
        "torch": _torch_section(),
        "packages": {name: package_version(name) for name in OPTIONAL_PACKAGES},
        "front_ends": _front_ends_section(),
        "cpu": _cpu_section(),
        "nvme": _nvme_section(list(nvme_paths or [])),
        "config_defaults": _config_section(),
    }


def _show(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "unset" if key.isupper() else "none"  # an environment variable, or a value
    return str(value)


def _rows(section: str, body: Any) -> list[tuple[str, str]]:
    """One section's (name, value) lines of text."""
    if section == "front_ends":
        return [(name, _front_end_status(f)) for name, f in body.items()]
    if section == "nvme":
        if not body:
            return [("path", f"none given (--nvme-path PATH or {NVME_ENV})")]
        rows: list[tuple[str, str]] = []
        for i, check in enumerate(body):
            if i:
                rows.append(("", ""))  # a blank line between two directories
            for key, value in check.items():
                if key == "free_bytes" and value is not None:
                    rows.append((key, f"{value:,} ({_human(value)})"))
                elif key == "problems":
                    rows.extend(("problem", problem) for problem in value)
                else:
                    rows.append((key, _show(key, value)))
        return rows
    rows = []
    for key, value in body.items():
        if isinstance(value, dict):  # torch's devices
            rows.extend((k, _show(k, v)) for k, v in value.items())
        else:
            rows.append((key, _show(key, value)))
    return rows


def _front_end_status(front_end: dict[str, Any]) -> str:
    if front_end["importable"]:
        return "yes"
    return f"no: needs {', '.join(front_end['missing'])} ({front_end['install']})"


def _human(nbytes: int) -> str:
    from ..core.memory import human_bytes

    return human_bytes(nbytes)


def format_report(report: dict[str, Any]) -> str:
    """``report`` (from :func:`env_report`) as text: a titled block per section of
    ``name ..... value`` lines, the values of a section in one column."""
    lines = ["ds_strategy environment report", ""]
    for title, body in report.items():
        rows = _rows(title, body)
        width = max(len(name) for name, _ in rows) + 3
        lines.append(f"[{title}]")
        lines.extend(
            f"  {name} {'.' * (width - len(name))} {value}" if name else "" for name, value in rows
        )
        lines.append("")
    return "\n".join(lines)


def add_cli_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``env`` to the ``ds-strategy`` command's subcommands."""
    p = sub.add_parser(
        "env",
        help="print versions, devices, optional packages and offload checks for a bug report",
        description="Print what a bug report needs: ds_strategy, Python and torch versions, CUDA "
        "and distributed backends, every optional package's version, which front ends can be "
        f"imported, CPU capability, NVMe offload directory checks (--nvme-path, {NVME_ENV}) and "
        "the config defaults. Imports no optional package.",
    )
    p.add_argument(
        "--nvme-path",
        action="append",
        default=[],
        metavar="PATH",
        help="a directory to check for NVMe offload: exists, writable, free space, O_DIRECT "
        "(repeat for several)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_cli(args: argparse.Namespace) -> int:
    """Print the report (text, or JSON with ``--json``); returns 0."""
    report = env_report(args.nvme_path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
