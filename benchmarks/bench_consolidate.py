"""Peak memory of consolidating a sharded checkpoint into one file.

    python benchmarks/bench_consolidate.py [--layers 8] [--width 2048] [--ranks 2]

Saves a checkpoint of an MLP whose weights are several hundred MB (``--ranks`` gloo ranks,
ZeRO-3, SGD without state so the checkpoint is the weights), then consolidates it in fresh
subprocesses and prints each one's peak RSS (``VmHWM``) above the RSS of a process that
only imports torch and ds_strategy, next to the checkpoint's size and its largest tensor:

- ``ds_strategy.consolidate(..., "*.safetensors")``: streamed tensor by tensor;
- ``ds_strategy.consolidate(..., "*.pt")``: one pickle, built in memory;
- torch's ``dcp_to_torch_save``: the naive reference, loads the whole checkpoint.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

MB = 2**20

_PROBE = """
import sys, torch, ds_strategy
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
kind, src, out = sys.argv[1:4]
if kind == "ours":
    ds_strategy.consolidate(src, out)
elif kind == "naive":
    dcp_to_torch_save(src, out)
# VmHWM: this process's own peak RSS. (ru_maxrss survives exec on Linux, so a child of a
# large parent would report at least the parent's peak.)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(int(hwm.split()[1]) * 1024)
"""


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, 4 * width) for _ in range(layers)])


def _save(rank: int, world: int, port: int, layers: int, width: int, path: str) -> None:
    import torch.distributed as dist

    import ds_strategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = make_model(layers, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ds_strategy.initialize(model, opt, {"zero_optimization": {"stage": 3}})
    engine.save_checkpoint(path)
    engine.destroy()
    dist.destroy_process_group()


def peak_rss(kind: str, src: Path, out: Path) -> int:
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, kind, str(src), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    from tests.distributed import free_port  # the repository's free-port helper

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        mp.spawn(
            _save,
            args=(args.ranks, free_port(), args.layers, args.width, str(ckpt)),
            nprocs=args.ranks,
        )
        total = sum(f.stat().st_size for f in ckpt.iterdir())
        model = make_model(args.layers, args.width)
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        del model
        base = peak_rss("import", ckpt, Path(tmp) / "none")
        print(
            f"checkpoint: {total / MB:.0f} MB on disk ({args.ranks} ranks), weights "
            f"{weights / MB:.0f} MB, largest tensor {largest / MB:.0f} MB; "
            f"import-only RSS {base / MB:.0f} MB (subtracted below)"
        )
        print(
            f"{'consolidation':<34}{'peak RSS - import':>18}{'/ checkpoint':>14}{'/ largest':>11}"
        )
        runs = [
            ("ds_strategy -> .safetensors", "ours", "model.safetensors"),
            ("ds_strategy -> .pt", "ours", "model.pt"),
            ("torch dcp_to_torch_save (naive)", "naive", "naive.pt"),
        ]
        for label, kind, name in runs:
            out = Path(tmp) / name
            extra = peak_rss(kind, ckpt, out) - base
            out.unlink()
            print(
                f"{label:<34}{extra / MB:>15.0f} MB{extra / total:>14.2f}{extra / largest:>11.2f}"
            )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
