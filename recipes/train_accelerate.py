"""Accelerate recipe: the Lightning recipe's model and config groups, trained with
``ZeroAccelerator`` in a plain Accelerate loop.

    python recipes/train_accelerate.py strategy=zero3 precision=bf16 trainer.devices=2

Run with ``python``, it starts ``trainer.devices`` processes itself through ``accelerate
launch`` (with ``configs/accelerate/cpu_2proc.yaml`` when ``trainer.accelerator=cpu``, else
``configs/accelerate/multi_gpu.yaml``); started by a launcher, it trains in place:

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \\
        recipes/train_accelerate.py strategy=zero3
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import recipes  # noqa: E402,F401  (names the extra when a framework is missing)
from ds_strategy.accelerate import ZeroAccelerator  # noqa: E402
from recipes.data import CharCorpus  # noqa: E402
from recipes.models import build_model, generate, lm_loss  # noqa: E402
from recipes.output import say  # noqa: E402
from recipes.schema import REPO, corpus_path, engine_config, precision_name, register  # noqa: E402

register()

_MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relaunch(cfg: DictConfig) -> int:
    """Start this script under ``accelerate launch`` with the same overrides."""
    t = cfg.trainer
    name = "cpu_2proc.yaml" if t.accelerator == "cpu" else "multi_gpu.yaml"
    overrides = [a for a in sys.argv[1:] if not a.startswith("hydra.run.dir=")]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / name),
        "--num_processes",
        str(t.devices * t.num_nodes),
        "--main_process_port",
        str(_free_port()),
        str(Path(__file__).resolve()),
        *overrides,
        f"hydra.run.dir={HydraConfig.get().runtime.output_dir}",
    ]
    return subprocess.call(cmd)


def train(cfg: DictConfig) -> None:
    zero = engine_config(cfg)
    t = cfg.trainer
    accelerator = ZeroAccelerator(
        config=zero,
        mixed_precision=_MIXED[precision_name(zero)],
        gradient_accumulation_steps=t.accumulate_grad_batches,
        cpu=t.accelerator == "cpu",
    )
    torch.manual_seed(cfg.seed)
    corpus = CharCorpus(corpus_path(cfg), cfg.model.seq, cfg.data.stride)
    loader = DataLoader(corpus, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    model = build_model(corpus.vocab, cfg.model)
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    bar = tqdm(
        total=t.max_steps,
        disable=not (t.enable_progress_bar and accelerator.is_main_process),
        desc="train",
    )
    step, start, loss = 0, time.perf_counter(), torch.tensor(float("nan"))
    while step < t.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = lm_loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and t.gradient_clip_val:
                    accelerator.clip_grad_norm_(model.parameters(), t.gradient_clip_val)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            mean = accelerator.reduce(loss.detach(), reduction="mean").item()
            bar.update(1)
            bar.set_postfix(loss=f"{mean:.3f}")
            if step % t.log_every_n_steps == 0 or step == t.max_steps:
                accelerator.print(f"step {step:4d}  loss {mean:.3f}")
            if step >= t.max_steps:
                break
    bar.close()
    engine = accelerator.zero_engine
    report = engine.memory_report()
    say(
        f"rank {accelerator.process_index}: stage {engine.stage}, {precision_name(zero)}, "
        f"{engine.global_steps} steps in {time.perf_counter() - start:.1f}s, "
        f"model state {report['total'] / 1e6:.3f} MB"
    )
    state = accelerator.get_state_dict(model)  # collective: consolidates on every rank
    if accelerator.is_main_process and t.sample_chars > 0:
        local = build_model(corpus.vocab, cfg.model)
        local.load_state_dict(state)
        local.eval()
        text = corpus.decode(generate(local, corpus.encode("ZeRO "), t.sample_chars))
        say(f"sample: {'ZeRO ' + text!r}")
    accelerator.end_training()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    launched = "LOCAL_RANK" in os.environ or "RANK" in os.environ
    if not launched and cfg.trainer.devices * cfg.trainer.num_nodes > 1:
        if cfg.trainer.num_nodes > 1:
            raise ValueError(
                "trainer.num_nodes > 1: start each node with `accelerate launch` "
                "(--num_machines, --machine_rank, --main_process_ip) instead"
            )
        sys.exit(relaunch(cfg))
    train(cfg)


if __name__ == "__main__":
    main()
