"""TRL's ``SFTTrainer`` and ``DPOTrainer`` through ``ds_strategy.hf.zero`` at ZeRO stage 3,
against the same trainers run plainly (DDP), on two processes started by ``torchrun``
(tests/test_trl.py). Both load a small Llama from a directory by name (``model="<dir>"``),
as TRL loads a Hub model; DPO builds its reference model from it too.

Rank 0 ``torch.save``s what it measured to ``--out``: the logged losses of each run, and for
the DPO reference model the bytes each rank holds and its log-probabilities on a fixed batch;
two steps of ``GRPOTrainer`` (an online trainer, generating on the sharded model).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from ds_strategy.hf import zero

WORDS = [f"w{i}" for i in range(40)]
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def save_model_directory(path: Path) -> None:
    """A 2-layer Llama and a word-level tokenizer, written as a Hub model directory."""
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)


def _sentence(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def sft_data() -> Dataset:
    g = torch.Generator().manual_seed(1)
    return Dataset.from_dict({"text": [_sentence(g, 8) for _ in range(16)]})


def dpo_data() -> Dataset:
    g = torch.Generator().manual_seed(2)
    rows = [(_sentence(g, 4), _sentence(g, 3), _sentence(g, 3)) for _ in range(16)]
    prompt, chosen, rejected = zip(*rows, strict=True)
    return Dataset.from_dict({"prompt": prompt, "chosen": chosen, "rejected": rejected})


def settings(out: Path) -> dict[str, Any]:
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
        bf16=False,  # TRL turns it on by default: fp32 compares plain and ZeRO to round-off
    )


def losses(trainer: Any) -> list[float]:
    return [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]


def sft(model_dir: Path, out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, cls, extra in (("plain", SFTTrainer, {}), ("zero3", zero(SFTTrainer), ZERO3)):
        args = SFTConfig(**settings(out / f"sft_{name}"), max_length=16)
        kw = {"config": extra} if extra else {}
        trainer = cls(model=str(model_dir), args=args, train_dataset=sft_data(), **kw)
        trainer.train()
        results[name] = losses(trainer)
    return results


def reference_bytes(ref: torch.nn.Module) -> dict[str, int]:
    """Bytes of the reference model's parameters this rank holds: in the parameters' own
    storage (empty outside forward when sharded), and in the engine's shards."""
    module = getattr(ref, "module", ref)
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()
    }
    held = {"in_parameters": sum(storages.values())}
    report = getattr(ref, "memory_report", None)
    held["in_shards"] = report()["params"] if report is not None else 0
    return held


def reference_log_probs(ref: torch.nn.Module, tokenizer: Any) -> torch.Tensor:
    """The reference model's per-token log-probs on a fixed batch, as DPO asks for them."""
    g = torch.Generator().manual_seed(3)
    batch = tokenizer([_sentence(g, 6) for _ in range(3)], return_tensors="pt")
    with torch.no_grad():
        out = ref(input_ids=batch["input_ids"], labels=batch["input_ids"], fused_lm_head=True)
    return out.log_probs.detach().clone()


def dpo(model_dir: Path, out: Path) -> dict[str, Any]:
    from trl.trainer import dpo_trainer

    results: dict[str, Any] = {}
    whole_loads = []  # the models TRL loads whole with its own from_pretrained
    real = dpo_trainer.create_model_from_path

    def counted(*args: Any, **kwargs: Any) -> Any:
        whole_loads.append(args[0] if args else kwargs.get("model_id"))
        return real(*args, **kwargs)

    dpo_trainer.create_model_from_path = counted
    for name, cls, extra in (("plain", DPOTrainer, {}), ("zero3", zero(DPOTrainer), ZERO3)):
        args = DPOConfig(**settings(out / f"dpo_{name}"), max_length=16)
        kw = {"config": extra} if extra else {}
        whole_loads.clear()
        trainer = cls(model=str(model_dir), args=args, train_dataset=dpo_data(), **kw)
        trainer.train()
        ref = trainer.ref_model
        results[name] = {
            "whole_loads": len(whole_loads),
            "loss": losses(trainer),
            "ref_type": type(ref).__name__,
            "ref_bytes": reference_bytes(ref),
            "ref_log_probs": reference_log_probs(ref, trainer.processing_class),
            "ref_requires_grad": any(p.requires_grad for p in ref.parameters()),
        }
        whole = LlamaForCausalLM.from_pretrained(model_dir)
        results["whole_bytes"] = sum(p.numel() * p.element_size() for p in whole.parameters())
    return results


def grpo(model_dir: Path, out: Path) -> dict[str, Any]:
    """An online trainer: two steps of ``zero(GRPOTrainer)`` (sampling, so no plain twin)."""
    g = torch.Generator().manual_seed(4)
    prompts = Dataset.from_dict({"prompt": [_sentence(g, 3) for _ in range(8)]})
    base = {k: v for k, v in settings(out / "grpo").items() if k != "gradient_accumulation_steps"}
    base.update(max_steps=2, learning_rate=1e-3)
    args = GRPOConfig(**base, num_generations=2, max_completion_length=4, beta=0.1)
    trainer = zero(GRPOTrainer)(
        model=str(model_dir),
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args,
        train_dataset=prompts,
        config=ZERO3,
    )
    trainer.train()
    return {
        "steps": trainer.state.global_step,
        "loss": losses(trainer),
        "ref_type": type(trainer.ref_model).__name__,
        "ref_bytes": reference_bytes(trainer.ref_model),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    work = a.out.parent
    results = {"sft": sft(a.model, work), "dpo": dpo(a.model, work), "grpo": grpo(a.model, work)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results["dpo"]["zero3"]["ref_bytes"])
    results["dpo"]["zero3"]["ref_bytes_per_rank"] = gathered
    if dist.get_rank() == 0:
        torch.save(results, a.out)


if __name__ == "__main__":
    main()
