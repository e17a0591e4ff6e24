"""Generation recipe: a trained model served by ``ds_strategy.init_inference``, configured by the
same presets the training recipes use.

    python examples/train_gpt.py --save out/gpt          # (or torchrun ...) a model to serve
    python recipes/generate.py model_path=out/gpt prompt=ZeRO \\
        strategy.zero_optimization.stage3_param_persistence_threshold=1000   # ZeRO-Inference
    python recipes/generate.py model_path=out/gpt strategy.quantization.bits=4   # int4 weights
    python recipes/generate.py model_path=out/gpt devices=2 strategy=zero3_offload
    python recipes/generate.py model_path=out/gpt devices=2 strategy.zero_optimization.stage=0 \\
        strategy.tensor_parallel.autotp_size=2                               # tensor parallel

``strategy`` is a ds_strategy config (a preset of the package; stage 3 shards the weights over the
processes, stage 0 keeps them whole), ``precision`` its dtype. With ``devices`` > 1 the recipe
starts itself under ``torchrun``; rank 0 prints the text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import ds_strategy  # noqa: E402
import recipes  # noqa: E402,F401  (names the extra when a framework is missing)
from recipes.output import say  # noqa: E402
from recipes.schema import REPO, register_generate  # noqa: E402

register_generate()


def relaunch(cfg: DictConfig) -> int:
    """This script under ``torchrun`` with the same overrides, ``devices`` processes."""
    overrides = [a for a in sys.argv[1:] if not a.startswith("hydra.run.dir=")]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.devices}",
        str(Path(__file__).resolve()),
        *overrides,
        f"hydra.run.dir={HydraConfig.get().runtime.output_dir}",
    ]
    return subprocess.call(cmd)


def _path(p: str) -> str:
    """A path relative to the repository root when it is not one from here."""
    return p if Path(p).exists() or ":" in p else str(REPO / p)


@hydra.main(version_base="1.3", config_path="conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    launched = "LOCAL_RANK" in os.environ or "RANK" in os.environ
    if not launched and cfg.devices > 1:
        sys.exit(relaunch(cfg))
    engine = ds_strategy.init_inference(
        _path(cfg.model_path),
        ds_strategy.load_config(cfg.strategy),
        checkpoint=_path(cfg.checkpoint) if cfg.checkpoint else None,
    )
    prompt_ids = engine.encode(cfg.prompt)
    out = engine.generate(
        prompt_ids,
        cfg.max_new_tokens,
        do_sample=cfg.do_sample,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        seed=cfg.seed,
    )[0].tolist()
    new_ids = out[prompt_ids.shape[1] :]
    report = engine.memory_report()
    rank = int(os.environ.get("RANK", "0"))
    say(f"rank {rank}: weights {report['params'] / 1e6:.3f} MB, peak {report['peak'] / 1e6:.3f} MB")
    if rank == 0:
        result = {"prompt": cfg.prompt, "generated_ids": new_ids}
        say(f"text: {engine.decode(out)!r}", f"result: {json.dumps(result)}")
    engine.destroy()
    if torch.distributed.is_initialized():  # a clean shutdown, not the group's destructor
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
