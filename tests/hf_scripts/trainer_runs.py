"""``ZeroTrainer`` against a plain ``transformers.Trainer`` (DDP) on a small Llama built from a
config, two processes; started by ``torchrun`` or ``accelerate launch`` (tests/test_hf_trainer.py).

``parity``: transformers' own DeepSpeed test configs (``tests/deepspeed/ds_config_zero2.json``
and ``ds_config_zero3.json``, read unmodified from tests/data/deepspeed_configs: "auto"
everywhere, an AdamW and a WarmupLR section, CPU offload) and a config without sections (the
Trainer's own optimizer and scheduler), each against the plain Trainer set up to mean the same;
then evaluation, prediction and ``save_model`` -> ``from_pretrained``.
``resume``: an uninterrupted run with checkpoints, and a run resumed from its middle one.
``split``: tensor parallelism, then sequence parallelism, each over both processes.
Rank 0 ``torch.save``s what it measured to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from ds_strategy.hf import ZeroTrainer

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "deepspeed_configs"
VOCAB, LENGTH, SAMPLES = 64, 16, 40  # 40 samples, 2 ranks x 2 x accumulation 2: an odd tail
MAX_NORM = 0.5


class Tokens(torch.utils.data.Dataset):
    def __init__(self, samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (samples, LENGTH), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(vocab: int = VOCAB, positions: int = LENGTH) -> LlamaForCausalLM:
    """A 2-layer Llama (4 attention heads, 2 key/value heads) from a config, seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
    )
    return LlamaForCausalLM(config)


def arguments(out: str, **changes: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=1e-2,
        weight_decay=0.01,
        adam_beta2=0.99,
        max_grad_norm=MAX_NORM,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
    )
    settings.update(changes)
    return TrainingArguments(**settings)


def logged(trainer: Trainer) -> dict[str, list[float]]:
    steps = [e for e in trainer.state.log_history if "loss" in e]
    return {
        "loss": [float(e["loss"]) for e in steps],
        "grad_norm": [float(e["grad_norm"]) for e in steps],
        "lr": [float(e["learning_rate"]) for e in steps],
    }


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    if isinstance(trainer, ZeroTrainer):
        return trainer.accelerator.get_state_dict(trainer.model_wrapped)  # collective
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def run(
    cls: type, out: str, *, all_decay: bool, args: dict[str, Any] | None = None, **kw: Any
) -> tuple[Trainer, dict[str, Any]]:
    m = model()
    extra: dict[str, Any] = {}
    if cls is Trainer and all_decay:  # what a config optimizer section means: every parameter
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
        extra["optimizers"] = (opt, None)
    schedule = "constant_with_warmup" if all_decay else "linear"  # = WarmupLR (log) over 1 step
    trainer = cls(
        model=m,
        args=arguments(out, lr_scheduler_type=schedule, **(args or {})),
        train_dataset=Tokens(SAMPLES, 1),
        eval_dataset=Tokens(8, 2),
        **extra,
        **kw,
    )
    trainer.train()
    result: dict[str, Any] = {"state": weights(trainer), **logged(trainer)}
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["global_step"] = trainer.state.global_step
    return trainer, result


def parity(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    zero2 = json.loads((CONFIGS / "transformers__tests_zero2.json").read_text())
    zero3 = json.loads((CONFIGS / "transformers__tests_zero3.json").read_text())
    _, results["plain_sections"] = run(Trainer, str(out / "p1"), all_decay=True)
    _, results["plain"] = run(Trainer, str(out / "p2"), all_decay=False)
    t2, results["zero2_sections"] = run(ZeroTrainer, str(out / "z2"), all_decay=True, config=zero2)
    results["zero2_config"] = _resolved(t2)
    t3, results["zero3_sections"] = run(ZeroTrainer, str(out / "z3"), all_decay=True, config=zero3)
    results["zero3_config"] = _resolved(t3)
    bare = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
    compiled = {
        "torch_compile": True,
        "torch_compile_backend": "aot_eager",
        "torch_compile_mode": "max-autotune-no-cudagraphs",  # reaches torch.compile's kwargs
    }
    tc, results["zero3_compiled"] = run(
        ZeroTrainer, str(out / "z3c"), all_decay=False, config=bare, args=compiled
    )
    engine = tc.accelerator.zero_engine
    results["zero3_compiled"]["compile"] = (
        engine.config.compile.enabled,
        engine.config.compile.backend,
        engine.config.compile.kwargs.get("mode"),
    )
    results["zero3_compiled"]["report"] = engine.compile_report()
    t, results["zero3"] = run(ZeroTrainer, str(out / "z3b"), all_decay=False, config=bare)
    # the trained ZeRO-3 model: predictions through the Trainer, then saved and reloaded
    held_out = Tokens(8, 3)
    results["predicted"] = torch.as_tensor(t.predict(held_out).predictions)
    t.save_model(str(out / "saved"))
    if t.args.process_index == 0:
        reloaded = LlamaForCausalLM.from_pretrained(str(out / "saved")).eval()
        with torch.no_grad():
            results["reloaded"] = reloaded(held_out.ids).logits
        results["saved_files"] = sorted(os.listdir(out / "saved"))
    return results


def _resolved(trainer: ZeroTrainer) -> dict[str, Any]:
    cfg = trainer.accelerator.zero_engine.config
    zc = cfg.zero_optimization
    return {
        "optimizer": dict(cfg.optimizer.params),
        "scheduler": dict(cfg.scheduler.params) if cfg.scheduler else None,
        "batch": (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu),
        "accumulation": cfg.gradient_accumulation_steps,
        "clipping": cfg.gradient_clipping,
        "buckets": (
            zc.reduce_bucket_size,
            zc.stage3_prefetch_bucket_size,
            zc.stage3_param_persistence_threshold,
        ),
        "offload": (zc.offload_optimizer.device, zc.offload_param.device),
    }


def resume(out: Path, stage: int) -> dict[str, Any]:
    config = {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_max_lr": "auto",
                "total_num_steps": "auto",
                "warmup_num_steps": "auto",
            },
        },
        "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    saving = dict(save_strategy="steps", save_steps=5)

    def trainer(folder: str) -> ZeroTrainer:
        return ZeroTrainer(
            model=model(),
            args=arguments(folder, **saving),
            train_dataset=Tokens(SAMPLES, 1),
            config=config,
        )

    whole = trainer(str(out / "whole"))
    whole.train()
    results: dict[str, Any] = {"whole": weights(whole), "whole_log": logged(whole)}
    middle = out / "whole" / "checkpoint-5"
    results["checkpoint_files"] = sorted(os.listdir(middle))
    resumed = trainer(str(out / "resumed"))
    resumed.train(resume_from_checkpoint=str(middle))
    results["resumed"] = weights(resumed)
    results["resumed_log"] = logged(resumed)
    results["resumed_step"] = resumed.state.global_step
    return results


def split(out: Path) -> dict[str, Any]:
    """The Llama through ZeroTrainer with its layers split over both ranks (2-way tensor
    parallelism, D=1 x T=2, ZeRO-2), then with each sequence split over them
    (``TrainingArguments.parallelism_config`` with ``sp_size=2``, ZeRO-3, the loss and MLPs
    tiled): the test compares each with a plain Trainer in one process."""
    from accelerate import ParallelismConfig

    layers = {"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}}
    sequences = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "tiling": {"loss": True, "mlp": True, "tokens": 3},
    }
    per_sequence = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    results = {}
    for name, config, args in (
        ("tp", layers, {}),
        ("sp", sequences, {"parallelism_config": per_sequence}),
    ):
        trainer = ZeroTrainer(
            model=model(),
            args=arguments(str(out / name), **args),
            train_dataset=Tokens(SAMPLES, 1),
            eval_dataset=Tokens(8, 2),
            config=config,
        )
        trainer.train()
        results[name] = {
            "state": weights(trainer),
            **logged(trainer),
            "eval_loss": trainer.evaluate()["eval_loss"],
            "mesh": dict(trainer.accelerator.zero_engine.mesh.coordinates),
            "total_batch": trainer.get_total_train_batch_size(trainer.args),
            "global_step": trainer.state.global_step,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["parity", "resume", "split"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    a = parser.parse_args()
    out = Path(a.out)
    if a.mode == "parity":
        results = parity(out.parent)
    elif a.mode == "resume":
        results = resume(out.parent, a.stage)
    else:
        results = split(out.parent)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
