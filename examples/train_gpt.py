"""Train a small character-level GPT with ZeRO-3 across the ranks that started this script.

    torchrun --nproc-per-node=2 examples/train_gpt.py            # 2 CPU processes (gloo)
    torchrun --nproc-per-node=2 examples/train_gpt.py --stage 1 --steps 100
    torchrun --nproc-per-node=2 examples/train_gpt.py --precision bf16 --breakdown
    torchrun --nproc-per-node=2 examples/train_gpt.py --save out/gpt    # then:
    ds-strategy generate out/gpt --prompt "ZeRO" --bits 4
    torchrun --nproc-per-node=2 examples/train_gpt.py --init out/gpt --qat 4 --steps 100 \
        --lr 1e-3 --save out/gpt-qat                  # quantization-aware fine-tuning
    torchrun --nproc-per-node=2 examples/train_gpt.py --plot plots   # figures of the run

The corpus is the project's own documentation, ``docs/**/*.md`` in order (no download;
``--text`` another file or directory), its last tenth held out (``--holdout``). Each rank
reads a different slice of every global batch; the loss printed is the mean over ranks. At the end: the held-out perplexity, a sample of
generated text, and each rank's model-state memory next to the ZeRO formula and its time.
``--save DIR`` writes the weights (``model.safetensors``) and ``ds_model.json``, which
``ds_strategy.init_inference(DIR)`` and ``ds-strategy generate DIR`` read; with ``--qat``
also ``model-int<bits>.safetensors``, the quantized export. ``--plot DIR`` turns on the CSV
monitor (files in ``outputs/train_gpt/``), the wall-clock breakdown and the memory timeline,
and at the end draws ``ds-strategy plot``'s figures into DIR (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

import ds_strategy
from ds_strategy.core.inference import write_model_card
from ds_strategy.demos.gpt import GPT, GPTConfig, gpt_loss, perplexity, split_text
from ds_strategy.estimate import estimate, model_facts

ROOT = Path(__file__).resolve().parent.parent

PERSISTENCE = 1000  # stage3_param_persistence_threshold: biases and norms stay whole


def mean_over_ranks(x: torch.Tensor, world: int) -> float:
    x = x.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(x)
        x /= world
    return x.item()


@torch.no_grad()
def sample(model: GPT, prompt: list[int], n: int, seq: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([prompt])
    for _ in range(n):
        logits = model(idx[:, -seq:])[0, -1] / 0.8
        idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1, generator=gen)[None]], 1)
    return idx[0, len(prompt) :].tolist()


def memory_line(engine: ds_strategy.ZeroEngine, cfg: GPTConfig, precision: str) -> str:
    """This rank's model state against the paper's formula (all parameters sharded) and
    against ``ds-strategy estimate``'s (parameters under the persistence threshold whole)."""
    report = engine.memory_report()
    world, stage = engine.world_size, engine.stage
    psi = sum(p.numel() for p in GPT(cfg).parameters())
    p, g, k = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    paper = {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi / world,
        2: p * psi + (g + k) * psi / world,
        3: (p + g + k) * psi / world,
    }[stage]
    facts = model_facts(lambda: GPT(cfg), persistence_threshold=PERSISTENCE)
    est = estimate(facts, world, stage, "none", precision).model_state
    return (
        f"rank {engine.rank}: model state {report['total'] / 1e6:.3f} MB (params "
        f"{report['params'] / 1e6:.3f}, grads {report['grads'] / 1e6:.3f}, optimizer "
        f"{report['optimizer_state'] / 1e6:.3f}); ZeRO-{stage} formula {paper / 1e6:.3f} MB "
        f"({report['total'] / paper:.3f}x), estimate with persistent small parameters "
        f"{est / 1e6:.3f} MB ({report['total'] / est:.3f}x); peak within a step "
        f"{report['peak'] / 1e6:.3f} MB (gathered parameters and gradient buckets in flight "
        f"included); {psi / 1e6:.2f}M parameters, {precision}, {world} rank(s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--breakdown", action="store_true", help="wall_clock_breakdown every 20 steps")
    ap.add_argument("--sample", type=int, default=200, help="characters to generate at the end")
    ap.add_argument(
        "--text", type=Path, default=ROOT / "docs", help="the corpus: a file, or a directory's .md"
    )
    ap.add_argument("--holdout", type=float, default=0.1, help="fraction held out at the end")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save", type=Path, help="write the trained model here")
    ap.add_argument("--init", type=Path, help="start from a model --save wrote")
    ap.add_argument("--qat", type=int, choices=(4, 8), help="quantization-aware training")
    ap.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--plot", type=Path, help="monitor the run and draw its figures here")
    args = ap.parse_args()
    # the engine's start summary and the package's warnings (a library leaves logging to you)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    files = sorted(args.text.rglob("*.md")) if args.text.is_dir() else [args.text]
    text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    train_text, held_out = split_text(text, args.holdout)
    card = json.loads((args.init / "ds_model.json").read_text()) if args.init else None
    chars = card["tokenizer"]["chars"] if card else "".join(sorted(set(text)))
    data = torch.tensor([chars.index(c) for c in train_text])
    kwargs = (
        card["kwargs"] if card else dict(vocab=len(chars), d=128, layers=4, heads=4, seq=args.seq)
    )
    cfg = GPTConfig(**kwargs)
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.init:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(args.init / "model.safetensors"))
    config = {
        "zero_optimization": {
            "stage": args.stage,
            "stage3_param_persistence_threshold": PERSISTENCE,
        },
        "bf16": {"enabled": args.precision == "bf16"},
        "gradient_clipping": 1.0,
        "train_batch_size": args.batch,
        "wall_clock_breakdown": args.breakdown,
        "steps_per_print": 20,
    }
    if args.plot:  # the files ds-strategy plot draws from
        config["wall_clock_breakdown"] = True
        config["csv_monitor"] = {"enabled": True, "output_path": "outputs", "job_name": "train_gpt"}
        config["memory_timeline"] = {"enabled": True}
    if args.qat:
        config["quantization"] = {"bits": args.qat, "group_size": args.group_size, "qat": True}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.plot and int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(Path("outputs", "train_gpt"), ignore_errors=True)  # CSV files append
    engine = ds_strategy.initialize(model, opt, config)
    rank, world = engine.rank, engine.world_size
    micro = engine.config.train_micro_batch_size_per_gpu
    if engine.timers is not None:
        engine.timers.printer = tqdm.write  # keep the progress bar intact
    gen = torch.Generator().manual_seed(1234)
    bar = tqdm(total=args.steps, desc=f"ZeRO-{args.stage}", disable=rank != 0, leave=True)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
        mine = starts[rank * micro : (rank + 1) * micro]
        batch = torch.stack([data[s : s + args.seq + 1] for s in mine])
        loss = gpt_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        bar.update(1)
        if step % 10 == 0 or step == 1:
            mean = mean_over_ranks(loss, world)
            bar.set_postfix(loss=f"{mean:.3f}")
            if rank == 0:
                tqdm.write(f"step {step:4d}  loss {mean:.3f}  {time.perf_counter() - t0:.1f}s")
    bar.close()
    elapsed = time.perf_counter() - t0

    state = engine.full_state_dict()  # collective: every rank takes part in the gathers
    if rank == 0:
        local = GPT(cfg)
        local.load_state_dict(state)
        local.eval()
        held = torch.tensor([chars.index(c) for c in held_out if c in chars])
        if held.numel() > cfg.seq:
            ppl = perplexity(local, held, cfg.seq)
            print(f"\nheld-out perplexity: {ppl:.3f} ({held.numel()} characters)", flush=True)
        if args.sample > 0:
            prompt = "ZeRO"
            out = sample(local, [chars.index(c) for c in prompt], args.sample, args.seq)
            print(f"\nsample: {prompt}{''.join(chars[i] for i in out)}\n", flush=True)
    del state
    if args.save:
        engine.save_weights(args.save / "model.safetensors")
        if rank == 0:
            write_model_card(args.save, "ds_strategy.demos.gpt:GPT", kwargs, chars=chars)
        if args.qat:
            engine.save_quantized(args.save / f"model-int{args.qat}.safetensors")
    if dist.is_initialized():
        dist.barrier()
    line = memory_line(engine, cfg, args.precision)
    step_ms = elapsed / args.steps * 1e3
    lines = [f"{line}\nrank {rank}: {args.steps} steps in {elapsed:.1f}s ({step_ms:.0f} ms/step)"]
    if dist.is_initialized():  # print in rank order
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, lines)
        lines = [x for part in gathered if part for x in part]
    if rank == 0:
        print("\n".join(lines), flush=True)
    engine.destroy()  # writes each rank's memory timeline last
    if args.plot:
        if dist.is_initialized():
            dist.barrier()  # every rank's timeline written
        if rank == 0:
            from ds_strategy.cli.plot import plot_run

            plot_run(Path("outputs", "train_gpt"), args.plot)
    if dist.is_initialized():  # a clean shutdown, not the process group's destructor at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
