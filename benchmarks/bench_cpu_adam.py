"""The CPU optimizer step of offloaded training: torch's fused AdamW over flat shards vs
``torch.optim.AdamW`` as a user writes it (the per-parameter loop torch runs on CPU).

    python benchmarks/bench_cpu_adam.py                  # GPT, ~25M parameters
    python benchmarks/bench_cpu_adam.py --layers 12 --d 768 --steps 10

Parameters are those of ``ds_strategy/demos/gpt.py``'s GPT (one tensor per parameter, its real
shapes). Each variant runs the same number of AdamW steps on the same gradients; the
median step time is printed side by side with the per-parameter loop's, and the final
weights are compared (they agree to float round-off).

- ``per-param loop``: ``torch.optim.AdamW(params, foreach=False)``, the default on CPU;
- ``foreach``: torch's multi-tensor path over the same tensors;
- ``fused, per piece``: ``fused=True`` over the same tensors (what the engine runs over its
  shard pieces, each a view of one flat shard);
- ``fused, flat``: ``fused=True`` over one flat tensor holding every parameter.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ds_strategy.demos.gpt import GPT, GPTConfig


def make_params(cfg: GPTConfig) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach().clone() for p in GPT(cfg).parameters()]


def build(
    name: str, shapes: list[torch.Tensor], grads: list[torch.Tensor]
) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """The optimizer of one variant (its state already allocated) and its flat weights."""
    flat = torch.cat([p.reshape(-1) for p in shapes])
    if name == "fused, flat":
        params = [flat]
        flat.grad = torch.cat([g.reshape(-1) for g in grads])
    else:
        params, offset = [], 0
        for p, g in zip(shapes, grads, strict=True):
            view = flat[offset : offset + p.numel()].view(p.shape)
            view.grad = g
            params.append(view)
            offset += p.numel()
    kw = {
        "per-param loop": {"foreach": False},
        "foreach": {"foreach": True},
        "fused, per piece": {"fused": True},
        "fused, flat": {"fused": True},
    }[name]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kw)
    opt.step()  # state allocation outside the timing
    return opt, flat


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab=args.vocab, d=args.d, layers=args.layers, heads=8)
    shapes = make_params(cfg)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in shapes]
    numel = sum(p.numel() for p in shapes)
    print(
        f"AdamW step over {len(shapes)} tensors, {numel / 1e6:.1f}M parameters, "
        f"{torch.get_num_threads()} threads, median of {args.steps} steps"
    )
    names = ["per-param loop", "foreach", "fused, per piece", "fused, flat"]
    built = {n: build(n, shapes, grads) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.steps):  # round-robin, so machine noise hits every variant alike
        for n in names:
            t0 = time.perf_counter()
            built[n][0].step()
            times[n].append(time.perf_counter() - t0)
    results = {n: (statistics.median(times[n]), built[n][1]) for n in names}
    base, ref = results["per-param loop"]
    print(f"{'variant':<18} {'s/step':>9} {'Melem/s':>9} {'speed-up vs per-param':>22}  max |dw|")
    for n in names:
        t, w = results[n]
        diff = (w - ref).abs().max().item()
        print(f"{n:<18} {t:9.4f} {numel / t / 1e6:9.1f} {base / t:21.2f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
