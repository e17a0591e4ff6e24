"""Elastic training that survives a dead rank: run it under torchrun with restarts.

    torchrun --nnodes=1 --nproc-per-node=4 --max-restarts=3 examples/elastic_train.py \
        --root ckpt --steps 100

Every ``--save-interval`` optimizer steps the engine saves ``ckpt/global_step<N>`` and points
``ckpt/latest`` at it (the config's ``checkpoint`` section). When a rank dies, torchrun stops
the others and starts the whole group again; each start resumes from ``latest``. The global
batch stays ``--global-batch`` whatever the number of ranks (gradient accumulation makes up
the difference), so a restart with fewer ranks (``--nproc-per-node=2``) continues the same
run. ``--fail-once RANK:STEP`` makes that rank kill itself (SIGKILL) once, after that step,
to try it out; a marker file in the root makes it happen only once.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn

import ds_strategy

IN, HIDDEN, OUT = 16, 32, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of optimizer step ``step``: the same whatever the world size or restarts."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 3)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="checkpoint root directory")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--micro-batch", type=int, default=None, help="default: one micro-step")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--save-interval", type=int, default=2)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--fail-once", default=None, help="RANK:STEP, e.g. 1:3")
    ap.add_argument("--out", default=None, help="write the final weights here (rank 0)")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    micro = args.micro_batch or args.global_batch // world
    if args.global_batch % (micro * world):
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {micro * world}")
    accumulation = args.global_batch // (micro * world)
    config = {
        "zero_optimization": {"stage": args.stage},
        "gradient_accumulation_steps": accumulation,
        "checkpoint": {
            "save_dir": args.root,
            "save_interval": args.save_interval,
            "keep_last": args.keep_last,
        },
    }
    model = make_model()
    engine = ds_strategy.initialize(model, make_optimizer(model), config)
    root = Path(args.root)
    if (root / "latest").is_file():
        engine.load_checkpoint(root)
        if rank == 0:
            print(f"resumed from {(root / 'latest').read_text()} on {world} rank(s)", flush=True)

    while engine.global_steps < args.steps:
        x, y = global_batch(engine.global_steps, args.global_batch)
        for m in range(accumulation):
            lo = (m * world + rank) * micro
            engine.backward(loss_fn(engine, x[lo : lo + micro], y[lo : lo + micro]))
            engine.step()
        _maybe_fail(args.fail_once, rank, engine.global_steps, root)

    state = engine.full_state_dict()
    if rank == 0:
        print(f"finished {engine.global_steps} steps on {world} rank(s)", flush=True)
        if args.out:
            torch.save(state, args.out)
    engine.destroy()
    # the process group ds_strategy started from torchrun's variables: closed before exit, so
    # no rank's communication threads are torn down by interpreter shutdown
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _maybe_fail(spec: str | None, rank: int, step: int, root: Path) -> None:
    """``--fail-once``: simulate a crashed rank, once per checkpoint root."""
    if spec is None:
        return
    fail_rank, fail_step = (int(v) for v in spec.split(":"))
    marker = root / f".failed-once-{fail_rank}-{fail_step}"
    root.mkdir(parents=True, exist_ok=True)
    if rank == fail_rank and step == fail_step and not marker.exists():
        marker.touch()
        print(f"rank {rank}: killing myself after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
