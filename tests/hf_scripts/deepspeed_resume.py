"""Resume the Hugging Face Trainer's DeepSpeed checkpoint (the fixture
``tests/data/deepspeed_checkpoints/hf_s2``) with ``ZeroTrainer`` on every rank of a launch at
ZeRO stage STAGE, one sample per rank (the fixture's two ranks both trained on the same batch of
2: see make_fixtures.py); rank 0 writes the largest difference from the Trainer's own
DeepSpeed continuation to OUT.

Usage: ``torchrun --nproc-per-node=2 deepspeed_resume.py OUT STAGE``
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(DATA))

from make_fixtures import HF_CONFIG, MICRO, hf_parts  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ds_strategy.hf import ZeroTrainer  # noqa: E402


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {**HF_CONFIG, "zero_optimization": {"stage": stage}}
    net, data, args = hf_parts(tempfile.mkdtemp())
    arguments = args(per_device_train_batch_size=MICRO // world, use_cpu=True)
    trainer = ZeroTrainer(model=net, args=arguments, train_dataset=data, config=config)
    trainer.train(resume_from_checkpoint=str(DATA / "hf_s2" / "checkpoint"))
    got = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.accelerator.is_main_process:
        ref = load_file(DATA / "hf_s2" / "continued.safetensors")
        diff = max((got[k].float() - v.float()).abs().max().item() for k, v in ref.items())
        out.write_text(f"{trainer.state.global_step} {diff}")


if __name__ == "__main__":
    main()
    import torch

    if torch.distributed.is_initialized():  # destroyed before exit (else gloo can abort)
        torch.distributed.destroy_process_group()
