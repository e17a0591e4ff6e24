"""``ds-strategy generate``: text from a model directory or checkpoint, plain, sharded,
offloaded, quantized or tensor-parallel.

    ds-strategy generate out/gpt --prompt "ZeRO" --bits 4
    torchrun --nproc-per-node=2 -m ds_strategy.cli generate out/gpt --prompt "ZeRO" --tp 2
    ds-strategy generate ckpt/global_step200 --model out/gpt --prompt "ZeRO" --zero3
    ds-strategy generate path/to/hf-llama --prompt "Hello" --bits 8 --max-new-tokens 64
    ds-strategy generate out/gpt --prompt "ZeRO" --json   # prompt, ids and text as JSON

Under ``torchrun`` every rank runs the model and rank 0 prints the text.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["add_cli_parser", "run_cli"]


def add_cli_parser(sub: Any) -> None:
    g = sub.add_parser(
        "generate",
        help="generate text from a model directory or checkpoint (ZeRO-Inference, int8/int4, TP)",
        description="Generate text with ds_strategy.init_inference.",
    )
    g.add_argument(
        "model_or_checkpoint",
        help="a model directory (Hugging Face, or one with ds_model.json), a .safetensors file or "
        "a ds_strategy checkpoint (then --model says which model)",
    )
    g.add_argument("--prompt", help="the text to continue (needs the model's tokenizer)")
    g.add_argument("--prompt-ids", help="the prompt as comma-separated token ids instead")
    g.add_argument(
        "--model",
        help="the model, when the first argument holds weights only: "
        "a model directory or 'package.module:factory'",
    )
    g.add_argument("--config", help="a config file (zero_optimization, quantization, ...)")
    g.add_argument("--bits", type=int, choices=(4, 8), help="quantize the weights on load")
    g.add_argument("--group-size", type=int, default=None, choices=(32, 64, 128))
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    g.add_argument("--zero3", action="store_true", help="ZeRO-Inference: shard over the ranks")
    g.add_argument("--offload", choices=("cpu", "nvme"), help="ZeRO-Inference parameter offload")
    g.add_argument("--nvme-path", help="directory for --offload nvme")
    g.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the model directory's ds_model.json name a factory outside ds_strategy "
        "(its code is imported and run)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: prompt, prompt_ids, generated_ids (the new tokens) and "
        "text (prompt and continuation; absent without a tokenizer)",
    )


def _config(args: Any) -> dict[str, Any]:
    from ds_strategy.config import load_config

    cfg = load_config(args.config).to_dict() if args.config else {}
    zero = cfg.setdefault("zero_optimization", {})
    if args.zero3 or args.offload:
        zero["stage"] = 3
    if args.offload:
        zero["offload_param"] = {"device": args.offload, "nvme_path": args.nvme_path}
    if args.bits:
        q = cfg.setdefault("quantization", {})
        q["bits"] = args.bits
        if args.group_size:
            q["group_size"] = args.group_size
    if args.tp:
        cfg.setdefault("tensor_parallel", {})["autotp_size"] = args.tp
    return cfg


def run_cli(args: Any) -> int:
    from ds_strategy.core.collectives import destroy_default_group, init_process_group_from_env

    if (args.prompt is None) == (args.prompt_ids is None):
        print("ds-strategy generate: give --prompt or --prompt-ids", file=sys.stderr)
        return 2
    problem = _check_options(args)
    if problem:
        print(f"ds-strategy generate: {problem}", file=sys.stderr)
        return 2
    started = init_process_group_from_env()  # under torchrun; this command then ends it
    try:
        return _generate(args)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"ds-strategy generate: {e}", file=sys.stderr)
        return 2
    finally:
        if started:  # a clean shutdown, not the process group's destructor at exit
            destroy_default_group()


def _check_options(args: Any) -> str | None:
    """What is wrong with the options, naming the option (None: nothing)."""
    if args.prompt is not None and not args.prompt:
        return "--prompt is empty; give the text to continue"
    if args.tp is not None and args.tp < 1:
        return f"--tp must be >= 1 (ranks per tensor-parallel group), got {args.tp}"
    if args.prompt_ids is not None:
        try:
            _prompt_ids(args.prompt_ids)
        except ValueError as e:
            return str(e)
    from ds_strategy.core.inference.generate import options_problem

    # (--temperature is checked with or without --sample: a bad one is a mistake either way)
    return options_problem(
        args.max_new_tokens,
        args.top_k,
        args.top_p,
        args.temperature,
        sampling=True,
        name=_option,
        seed=args.seed,
    )


def _option(argument: str) -> str:
    """The command-line option of a generation argument: ``top_k`` -> ``--top-k``."""
    return "--" + argument.replace("_", "-")


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--prompt-ids {text!r}: expected comma-separated token ids, e.g. 1,5,42"
        ) from None
    if not ids or min(ids) < 0 or max(ids) >= 2**63:
        raise ValueError(f"--prompt-ids {text!r}: token ids are integers in [0, 2**63)")
    return ids


def _generate(args: Any) -> int:
    import ds_strategy

    model: Any = args.model if args.model else args.model_or_checkpoint
    checkpoint = args.model_or_checkpoint if args.model else None
    engine = ds_strategy.init_inference(
        model,
        _config(args),
        dtype=args.dtype,
        checkpoint=checkpoint,
        trust_remote_code=args.trust_remote_code,
    )
    try:
        return _generate_with(engine, args)
    finally:
        engine.destroy()


def _generate_with(engine: Any, args: Any) -> int:
    import torch

    from ds_strategy.core.collectives import world_rank

    options = dict(
        do_sample=args.sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if args.prompt is not None:
        try:
            ids = engine.encode(args.prompt)
        except ValueError as err:
            raise ValueError(f"--prompt: {err}") from None
    else:
        ids = torch.tensor([_prompt_ids(args.prompt_ids)], dtype=torch.int64)
    prompt_option = "--prompt" if args.prompt is not None else "--prompt-ids"
    problem = engine.generation_problem(
        ids,
        args.max_new_tokens,
        **options,
        name=lambda arg: prompt_option if arg == "input_ids" else _option(arg),
    )
    if problem is not None:
        print(f"ds-strategy generate: {problem}", file=sys.stderr)
        return 2
    out = engine.generate(ids, args.max_new_tokens, **options)[0].tolist()
    if args.json:
        prompt_ids = ids[0].tolist()
        result: dict[str, Any] = {
            "prompt": args.prompt,
            "prompt_ids": prompt_ids,
            "generated_ids": out[len(prompt_ids) :],
        }
        if engine.tokenizer is not None:
            result["text"] = engine.decode(out)
        text = json.dumps(result)
    elif args.prompt is not None:
        text = engine.decode(out)
    else:
        text = ",".join(str(t) for t in out)
    if world_rank() == 0:
        print(text, flush=True)
    return 0
