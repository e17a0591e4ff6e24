"""Train a small Llama from a config with Hugging Face's ``Trainer`` under ZeRO:
``ds_strategy.hf.ZeroTrainer`` in place of ``transformers.Trainer``, the DeepSpeed config (or a
preset's name) passed as ``config=``.

    pip install 'ds_strategy[hf]'
    torchrun --nproc-per-node=2 examples/train_hf.py                  # ZeRO-3 on 2 CPU processes
    torchrun --nproc-per-node=2 examples/train_hf.py --config ds_config_zero2.json
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/train_hf.py

Every other argument is the Trainer's; ``"auto"`` values in a DeepSpeed config are filled from
``TrainingArguments`` as transformers fills them for DeepSpeed, and ``save_model`` writes a
``model.safetensors`` that ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _text import CharWindows
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from ds_strategy.hf import ZeroTrainer


class CausalLM(CharWindows):
    """Windows as the Trainer's causal-LM batches: the model shifts the labels itself."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = super().__getitem__(i)[:-1]
        return {"input_ids": window, "labels": window}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="zero3", help="a preset or a DeepSpeed JSON")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=None, help="output_dir (default: a temporary directory)")
    args = ap.parse_args()
    torch.manual_seed(0)
    data = CausalLM(seq=64)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=data.vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=data.seq,
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        training = TrainingArguments(
            output_dir=args.out or tmp,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
            logging_steps=20,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
        )
        trainer = ZeroTrainer(model=model, args=training, train_dataset=data, config=args.config)
        result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"{args.config}: {result.global_step} steps, mean loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main()
