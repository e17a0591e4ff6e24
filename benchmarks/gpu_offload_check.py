"""On one large GPU: the largest GPT that trains with CPU offload, whose fp32 Adam state does
not fit in the GPU's memory.

    python benchmarks/gpu_offload_check.py                    # the whole GPU
    python benchmarks/gpu_offload_check.py --gpu-mem-gib 24   # cap the GPU at 24 GiB
    python benchmarks/gpu_offload_check.py --d 4096 --heads 32 --max-layers 256

Every try trains a GPT (``ds_strategy/demos/gpt.py``: width ``--d``, a number of layers the search
chooses) for ``--steps`` steps under ZeRO stage 3 with bf16 compute, on the meta device first
and materialised unit by unit, with ``offload_optimizer`` and ``offload_param`` on the CPU
(pinned): the fp32 master shards, Adam's moments and the parameter shards live in host
memory and the optimizer step runs on the CPU. Each try runs in its own process (an
out-of-memory error ends only that try). Layers double until a try fails, then a bisection
finds the largest that trains. Tries whose host-memory need (about 18 bytes a parameter)
exceeds the machine's available memory are counted as failures without running.

Printed: every try (layers, parameters, fp32 Adam state = 12 bytes a parameter for the fp32
master and both moments, GPU peak, step time), then the largest model that trained, its step
time, and whether its fp32 Adam state exceeds the GPU memory. ``--baseline`` also tries that
model without offload, which is expected to run out of GPU memory. Host memory bounds the
model (about 18 bytes a parameter); where the GPU has more memory than the host can back,
``--gpu-mem-gib`` caps the GPU so that a model whose state exceeds it can be shown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30
HOST_BYTES_PER_PARAM = 18  # fp32 master 4 + Adam moments 8 + fp32 grads 4 + bf16 shard 2


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _params(d: int, layers: int, vocab: int, seq: int) -> int:
    per_block = 12 * d * d + 13 * d  # qkv, proj, fc, out (+ biases) and two LayerNorms
    return layers * per_block + vocab * d + seq * d + 2 * d


def child(args: argparse.Namespace) -> dict:
    import torch

    import ds_strategy
    from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss, init_weights

    total = torch.cuda.get_device_properties(0).total_memory
    if args.gpu_mem_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_gib * GIB / total))
    cfg = GPTConfig(vocab=args.vocab, d=args.d, layers=args.child, heads=args.heads, seq=args.seq)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    zo: dict = {"stage": 3}
    if not args.no_offload:
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"zero_optimization": zo, "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    torch.cuda.set_device(0)
    engine = ds_strategy.initialize(
        model,
        lambda p: torch.optim.AdamW(p, lr=1e-4),
        config,
        param_init_fn=init_weights,
    )
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device="cuda")
    times = []
    for _ in range(args.steps + 1):  # the first step allocates the optimizer state
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(gpt_loss(engine, tokens))
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[1:])
    return {
        "params": n,
        "step_s": steady[len(steady) // 2],
        "gpu_peak": torch.cuda.max_memory_allocated(),
        "gpu_limit": int(args.gpu_mem_gib * GIB) if args.gpu_mem_gib else total,
    }


def attempt(args: argparse.Namespace, layers: int, no_offload: bool = False) -> dict:
    n = _params(args.d, layers, args.vocab, args.seq)
    if not no_offload and n * HOST_BYTES_PER_PARAM > 0.9 * _host_available():
        return {"ok": False, "params": n, "why": "host memory too small (not run)"}
    cmd = [sys.executable, __file__, "--child", str(layers)]
    for k in ["d", "heads", "vocab", "seq", "batch", "steps", "gpu_mem_gib"]:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if no_offload:
        cmd.append("--no-offload")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ.copy()
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "params": n, "why": f"timed out after {args.timeout}s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        why = "out of GPU memory" if "out of memory" in proc.stderr.lower() else tail[0][:160]
        return {"ok": False, "params": n, "why": why}
    return {"ok": True, **json.loads(proc.stdout.strip().splitlines()[-1])}


def show(layers: int, r: dict) -> None:
    state = 12 * r["params"] / GIB
    line = f"layers {layers:4d}  params {r['params'] / 1e9:7.2f}B  fp32 Adam state {state:8.1f} GiB"
    if r["ok"]:
        line += f"  GPU peak {r['gpu_peak'] / GIB:6.1f} GiB  step {r['step_s']:.2f} s"
    else:
        line += f"  failed: {r['why']}"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d", type=int, default=4096, help="model width")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per try (after one)")
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--gpu-mem-gib", type=float, default=0.0, help="cap the GPU (0: all of it)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per try")
    ap.add_argument("--baseline", action="store_true", help="also try the winner without offload")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--no-offload", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit(
            "gpu_offload_check: no CUDA GPU is visible to torch; run this on a machine with one "
            "large GPU (it checks CPU offload of a model whose fp32 Adam state exceeds GPU memory)"
        )
    props = torch.cuda.get_device_properties(0)
    limit = args.gpu_mem_gib * GIB if args.gpu_mem_gib else props.total_memory
    print(
        f"{props.name}: {props.total_memory / GIB:.0f} GiB, using {limit / GIB:.0f} GiB; host "
        f"memory available {_host_available() / GIB:.0f} GiB; GPT d={args.d}, seq {args.seq}, "
        f"batch {args.batch}; ZeRO-3 bf16, optimizer and parameters offloaded to the CPU"
    )
    best: tuple[int, dict] | None = None
    low, high, layers = 0, None, 1
    while layers <= args.max_layers:  # doubling
        r = attempt(args, layers)
        show(layers, r)
        if not r["ok"]:
            high = layers
            break
        best, low = (layers, r), layers
        layers *= 2
    while high is not None and high - low > 1:  # bisection
        mid = (low + high) // 2
        r = attempt(args, mid)
        show(mid, r)
        if r["ok"]:
            best, low = (mid, r), mid
        else:
            high = mid
    if best is None:
        sys.exit("no model trained, not even one layer; lower --d or --seq")
    layers, r = best
    state = 12 * r["params"]
    print(
        f"largest that trains: {layers} layers, {r['params'] / 1e9:.2f}B parameters, "
        f"step {r['step_s']:.2f} s; fp32 Adam state {state / GIB:.1f} GiB vs GPU {limit / GIB:.0f} "
        f"GiB: {'does NOT fit' if state > limit else 'would fit'} in GPU memory"
    )
    if args.baseline:
        b = attempt(args, layers, no_offload=True)
        print("same model without offload: " + ("trains" if b["ok"] else f"fails ({b['why']})"))


if __name__ == "__main__":
    main()
