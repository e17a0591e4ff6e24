"""NVMe offload at 1B parameters: the same weights as without offload, and a save and resume
that ends where the uninterrupted run ends.

    python benchmarks/bench_scale_parity.py --nvme-path /local_nvme

The demo GPT of ``bench_scale.py``'s 1B size (width 2048, 20 layers), built on the meta device
with the same seed, ZeRO-3 on 2 gloo ranks, fp32 AdamW, persistence threshold 0:

1. ``plain``: 3 steps without offload;
2. ``nvme``: 3 steps with parameters and optimizer state on NVMe (``bench_scale``'s config);
3. ``resumed``: with NVMe, 2 steps, ``save_checkpoint``, a new engine, ``load_checkpoint``, the
   third step.

It prints the largest absolute difference of the consolidated weights (``nvme`` against
``plain``, ``resumed`` against ``nvme``; rank 0 writes them to ``--work`` and compares them
from there) and each rank's peak RSS while training (build included), saving and loading,
each above the RSS when that phase began.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from benchmarks.bench_offload import PeakRSS, _status_kb  # noqa: E402
from benchmarks.bench_scale import SEQ, SIZES, VOCAB, _config  # noqa: E402
from ds_strategy.core.memory import human_bytes  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss, init_weights  # noqa: E402

STEPS = 3


def _engine(nvme_path: str | None, buffer_size: int) -> ds_strategy.ZeroEngine:
    width, layers = SIZES["1B"]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=VOCAB, d=width, layers=layers, heads=16, seq=SEQ))
    config = _config(nvme_path or "", buffer_size)
    if nvme_path is None:
        zo = config["zero_optimization"]
        del zo["offload_param"], zo["offload_optimizer"]
    return ds_strategy.initialize(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        config,
        param_init_fn=init_weights,
    )


def _steps(engine: ds_strategy.ZeroEngine, rank: int, first: int, last: int) -> None:
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + rank)  # the same batch in every run
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        engine.backward(gpt_loss(engine, tokens))
        engine.step()


def _max_diff(a: str, b: str) -> float:
    x = torch.load(a, mmap=True, weights_only=True)
    y = torch.load(b, mmap=True, weights_only=True)
    return max((x[k] - y[k]).abs().max().item() for k in x)


def _rank(rank: int, world: int, nvme_path: str, work: str, buffer_size: int) -> dict:
    out: dict = {}
    ckpt = str(Path(work) / "ckpt")

    class Phase:
        """Peak RSS above the RSS at the start of the block."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            self.start = _status_kb("VmRSS") * 1024
            self.peak = PeakRSS()

        def __exit__(self, *exc: object) -> None:
            out[self.name] = self.peak.stop() - self.start

    def keep(engine: ds_strategy.ZeroEngine, name: str) -> None:
        state = engine.full_state_dict(rank0_only=True)
        if rank == 0:
            torch.save(state, Path(work) / f"{name}.pt")

    with Phase("nvme train"):
        nvme = _engine(nvme_path, buffer_size)
        _steps(nvme, rank, 0, STEPS)
    keep(nvme, "nvme")
    nvme.destroy()
    del nvme

    first = _engine(nvme_path, buffer_size)
    _steps(first, rank, 0, STEPS - 1)
    with Phase("nvme save"):
        first.save_checkpoint(ckpt)
    first.destroy()
    del first
    second = _engine(nvme_path, buffer_size)
    with Phase("nvme load"):
        second.load_checkpoint(ckpt)
    _steps(second, rank, STEPS - 1, STEPS)
    keep(second, "resumed")
    second.destroy()
    del second

    with Phase("plain train"):
        plain = _engine(None, buffer_size)
        _steps(plain, rank, 0, STEPS)
    keep(plain, "plain")
    plain.destroy()
    if rank == 0:
        out["nvme vs plain"] = _max_diff(f"{work}/nvme.pt", f"{work}/plain.pt")
        out["resumed vs nvme"] = _max_diff(f"{work}/resumed.pt", f"{work}/nvme.pt")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-path", default=None, help="default: a temporary directory")
    ap.add_argument(
        "--work", default=None, help="checkpoint and weights (default: a temporary directory)"
    )
    ap.add_argument("--buffer-size", type=int, default=100_000_000)
    args = ap.parse_args()
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="bench_scale_")
    work = args.work or tempfile.mkdtemp(prefix="bench_parity_")
    results = run(_rank, 2, nvme_path, work, args.buffer_size, timeout=4 * 3600)
    print(f"demo GPT 1B, ZeRO-3, 2 ranks, fp32 AdamW, {STEPS} steps; NVMe at {nvme_path}")
    print(f"max |nvme - plain|   = {results[0]['nvme vs plain']:.3g}")
    print(f"max |resumed - nvme| = {results[0]['resumed vs nvme']:.3g}")
    print(
        f"{'rank':>4} "
        + " ".join(f"{k:>12}" for k in ("plain train", "nvme train", "nvme save", "nvme load"))
    )
    for rank, r in sorted(results.items()):
        cells = " ".join(
            f"{human_bytes(r[k]):>12}"
            for k in ("plain train", "nvme train", "nvme save", "nvme load")
        )
        print(f"{rank:>4} {cells}")
    print("peak RSS above the process's RSS when each phase began (train: before the build)")


if __name__ == "__main__":
    main()
