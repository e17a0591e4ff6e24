"""Generation speed and weight memory: plain, ZeRO-Inference (sharded over 2 ranks, CPU
offload, NVMe offload), int8 and int4, side by side.

    python benchmarks/bench_inference.py                   # GPT 25M parameters (101 MB fp32)
    python benchmarks/bench_inference.py --d 1024 --layers 12 --tokens 32
    python benchmarks/bench_inference.py --device cuda      # the same on a GPU, where there is one

One GPT (the package's demo model, ``--d``/``--layers``, vocabulary 256, random weights: speed
and memory do not depend on them) is written once to a ``.safetensors`` file; every row builds
``ds_strategy.init_inference`` from that file in fresh processes (one per rank, one CPU thread
each) and generates ``--tokens`` tokens greedily after a 16-token prompt, batch 1, with the KV
cache, after one warm-up generation. Printed per row: tokens per second (the slowest rank,
median of ``--repeats`` generations), weight bytes this rank holds (``memory_report()``:
whole parameters, ZeRO slices, quantized tensors with their scales; bytes in NVMe files not
counted), the peak including the blocks gathered at once, each against plain fp32's, and
whether the generated tokens are plain fp32's. ZeRO-Inference rows gather at most the
embeddings plus ``--live-blocks`` blocks at once (``stage3_max_live_parameters``), prefetching
one block ahead. Quality is not measured here (the weights are random): the tests measure it
on the main job's trained model (held-out perplexity, ``tests/test_inference_jobs.py``). On a
CPU the int8 and int4 rows pay for turning stored integers into the matmul's dtype on every
call; the memory columns are the point of them there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ds_strategy  # noqa: E402
from benchmarks._ranks import run  # noqa: E402
from ds_strategy.demos.gpt import GPT, GPTConfig  # noqa: E402


def _rows(swap: str, live: int, block: int) -> list[tuple[str, int, Any, dict[str, Any]]]:
    """(name, ranks, config, init_inference keywords). ZeRO-Inference gathers at most ``live``
    elements at once and prefetches one block (``block`` elements) ahead."""

    def _zero(extra: dict[str, Any] | None = None) -> dict[str, Any]:
        zero = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": live,
            "stage3_prefetch_bucket_size": block,
            **(extra or {}),
        }
        return {"zero_optimization": zero}

    return [
        ("plain fp32", 1, None, {}),
        ("ZeRO-Inference, 2 ranks", 2, _zero(), {}),
        (
            "ZeRO-Inference + CPU offload, 2 ranks",
            2,
            _zero({"offload_param": {"device": "cpu"}}),
            {},
        ),
        (
            "ZeRO-Inference + NVMe offload, 1 rank",
            1,
            _zero({"offload_param": {"device": "nvme", "nvme_path": swap}}),
            {},
        ),
        ("int8 (torchao kernel)", 1, None, {"quantization": 8}),
        ("int8 (torch int8 matmul)", 1, None, {"quantization": {"bits": 8, "kernel": "torch"}}),
        ("int4, group 64", 1, None, {"quantization": 4}),
        ("int4 + ZeRO-Inference, 2 ranks", 2, _zero(), {"quantization": 4}),
    ]


def _worker(
    rank: int, world: int, path: str, kwargs: dict[str, int], row: tuple[Any, ...], args: Any
) -> dict[str, Any]:
    _, _, config, keywords = row
    device = torch.device(args.device, rank) if args.device == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)
    engine = ds_strategy.init_inference(
        lambda: GPT(GPTConfig(**kwargs)), config, checkpoint=path, **keywords
    )
    prompt = (torch.arange(16) * 7 % kwargs["vocab"]).view(1, 16)
    engine.generate(prompt, 4)  # warm-up: kernels, prefetch order
    engine.reset_peak_memory()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = engine.generate(prompt, args.tokens)
        if device is not None:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    report = engine.memory_report()
    engine.destroy()
    return {
        "seconds": statistics.median(times),
        "params": report["params"],
        "peak": report["peak"],
        "nvme": report.get("offloaded_nvme", 0),
        "tokens": out[0, 16:].tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--live-blocks",
        type=int,
        default=2,
        help="ZeRO-Inference's stage3_max_live_parameters: the root plus this many blocks",
    )
    args = ap.parse_args()
    kwargs = dict(vocab=256, d=args.d, layers=args.layers, heads=8, seq=16 + args.tokens + 8)
    tmp = Path(tempfile.mkdtemp(prefix="bench_inference_"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kwargs))
    n_params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = n_params - block * args.layers
    live = root + args.live_blocks * block
    save_file(
        {k: v for k, v in model.state_dict().items() if k != "head.weight"},
        str(tmp / "gpt.safetensors"),
    )
    del model
    (tmp / "swap").mkdir()
    print(
        f"demo GPT d={args.d}, {args.layers} blocks, {n_params / 1e6:.1f}M parameters "
        f"({n_params * 4 / 1e6:.0f} MB fp32); batch 1, 16-token prompt, {args.tokens} new tokens, "
        f"greedy, KV cache; {args.device}, one thread per rank; median of {args.repeats}; "
        f"ZeRO-Inference live budget {live / 1e6:.2f}M elements (embeddings + "
        f"{args.live_blocks} blocks)\n"
    )
    header = (
        "| layout | tokens/s | vs plain | weights MB/rank | vs plain | peak MB/rank | vs plain "
        "| in NVMe files MB | plain's tokens |"
    )
    print(header)
    print("|" + "---|" * 9)
    base: dict[str, Any] | None = None
    for row in _rows(str(tmp / "swap"), live, block):
        name, world = row[0], row[1]
        results = run(_worker, world, str(tmp / "gpt.safetensors"), kwargs, row, args)
        r0 = dict(results[0], seconds=max(r["seconds"] for r in results.values()))
        base = base or r0
        print(
            f"| {name} | {args.tokens / r0['seconds']:.1f} | "
            f"{base['seconds'] / r0['seconds']:.2f}x | {r0['params'] / 1e6:.2f} | "
            f"{r0['params'] / base['params']:.3f} | {r0['peak'] / 1e6:.2f} | "
            f"{r0['peak'] / base['peak']:.3f} | {r0['nvme'] / 1e6:.2f} | "
            f"{'yes' if r0['tokens'] == base['tokens'] else 'no'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
