"""``ds-strategy estimate``'s host peak against the measured peak RSS, every offload tier.

    python benchmarks/bench_estimate.py                        # demo GPT 0.11B, fp32 and bf16
    python benchmarks/bench_estimate.py --width 2048 --layers 4 --precisions fp32

Each configuration (every stage and offload tier the estimator ranks: ZeRO 0-3, CPU optimizer
offload at stages 1-3, CPU parameter offload and NVMe offload at stage 3) trains the demo GPT
for 3 steps on 2 gloo ranks in new processes, built on the meta device
(``param_init_fn``), AdamW, persistence threshold 0, micro-batch 1 of 64 tokens. Per rank it
measures the peak RSS (build and training; the process's high-water mark, see
``bench_offload.PeakRSS``) above the RSS before the model was built, and prints it beside
``step_peak(...).host_peak`` of the same configuration on CPU ranks (``Knobs(cpu_only=True)``)
and their ratio. The estimate counts model state and the step's buffers, not the working
memory of the process (the autograd graph, collective buffers), which RSS includes.
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
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss, init_weights  # noqa: E402
from ds_strategy.estimate import CANDIDATES, Knobs, model_facts, step_peak  # noqa: E402

VOCAB, SEQ = 8192, 64


def _config(stage: int, offload: str, precision: str, nvme: str, buffer_size: int) -> dict:
    zo: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    tier = {"device": "nvme" if offload == "nvme" else "cpu"}
    if offload == "nvme":
        tier.update(nvme_path=nvme, buffer_size=buffer_size)
    if offload != "none":
        zo["offload_optimizer"] = dict(tier)
    if offload in ("cpu+params", "nvme"):
        zo["offload_param"] = dict(tier)
    cfg: dict = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zo}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def _gpt(width: int, layers: int) -> GPT:
    return GPT(GPTConfig(vocab=VOCAB, d=width, layers=layers, heads=16, seq=SEQ))


def _rank(rank: int, world: int, width: int, layers: int, case: tuple, nvme: str, buf: int) -> int:
    torch.manual_seed(0)
    before = _status_kb("VmRSS") * 1024
    peak = PeakRSS()
    with torch.device("meta"):
        model = _gpt(width, layers)
    engine = ds_strategy.initialize(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        _config(*case, nvme, buf),
        param_init_fn=init_weights,
    )
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        loss = gpt_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
    measured = peak.stop() - before
    engine.destroy()
    return measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--buffer-size", type=int, default=100_000_000, help="NVMe buffer_size")
    args = ap.parse_args()
    facts = model_facts(lambda: _gpt(args.width, args.layers), persistence_threshold=0)
    knobs = Knobs(buffer_numel=args.buffer_size, reduce_scratch=True, cpu_only=True)
    nvme = tempfile.mkdtemp(prefix="bench_estimate_")
    print(
        f"demo GPT width {args.width}, {args.layers} layers: {facts.params / 1e9:.3f}B "
        f"parameters, 2 ranks, AdamW; NVMe buffer_size {args.buffer_size:,}"
    )
    print(
        f"{'config':>17} {'precision':>9} {'estimate':>9} {'rank 0':>9} {'rank 1':>9} {'est/RSS':>8}"
    )
    ratios = []
    for precision in args.precisions:
        for stage, offload in CANDIDATES:
            est = step_peak(facts, 2, stage, offload, precision, knobs=knobs)
            got = run(
                _rank,
                2,
                args.width,
                args.layers,
                (stage, offload, precision),
                nvme,
                args.buffer_size,
            )
            worst = max(got.values())
            ratios.append(est.host_peak / worst)
            print(
                f"{est.name:>17} {precision:>9} {est.host_peak / 2**30:>8.2f}G "
                f"{got[0] / 2**30:>8.2f}G {got[1] / 2**30:>8.2f}G {ratios[-1]:>8.2f}",
                flush=True,
            )
    print(
        f"estimate / measured peak RSS above the baseline (the larger rank): "
        f"{min(ratios):.2f} to {max(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
