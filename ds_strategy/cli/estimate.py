"""``ds-strategy estimate``: the memory model of ``ds_strategy.estimate`` for one model and
world size, every ZeRO stage / offload tier / precision as a table, the peak of a step, and
the cheapest configuration that fits."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from ..core.model_factory import build_failure
from ..estimate import (
    CANDIDATES,
    DEFAULT_PERSISTENCE_THRESHOLD,
    PRECISIONS,
    Estimate,
    Knobs,
    ModelFacts,
    StageFacts,
    activation_bytes,
    config_of,
    estimate_all,
    format_peaks,
    format_table,
    gigabytes,
    model_facts,
    parse_bytes,
    parse_count,
    pipeline_facts,
    recommend,
    step_peak,
    worst_per_candidate,
)

__all__ = ["add_cli_parser", "run_cli"]


def add_cli_parser(sub: Any) -> None:
    """Register ``ds-strategy estimate`` on an argparse subparsers object."""
    e = sub.add_parser(
        "estimate",
        help="per-rank memory of every ZeRO stage / offload / precision, and the cheapest that fits",
        description="Per-rank memory of every ZeRO stage, offload tier and precision (Adam), "
        "and the cheapest configuration that fits the given memory.",
    )
    what = e.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="number of parameters: 7e9, 7B, 350M")
    what.add_argument(
        "--model",
        help="a model factory 'package.module:factory', called on the meta device "
        "(counts parameters and the largest ZeRO-3 unit without allocating)",
    )
    e.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the factory (repeatable; values are Python literals)",
    )
    e.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    e.add_argument("--gpu-mem", help="memory per accelerator: 80GB, 24GiB")
    e.add_argument("--cpu-mem", help="host memory per node, shared by its ranks: 512GB")
    e.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks sharing one node's host memory (default: min(world size, 8))",
    )
    e.add_argument("--activations", default="0", help="activation memory per rank, if known: 10GB")
    _add_sequence_arguments(e)
    e.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="bf16",
        help="the precision to recommend a configuration for (default bf16); below 16 bytes "
        "a parameter: bf16-states (bf16_optimizer_states), bf16-low (bf16 masters and states), "
        "fp32-8bit / bf16-8bit / fp32-4bit / bf16-4bit (torchao's AdamW8bit / AdamW4bit), "
        "fp32-muon / bf16-muon (Muon, every parameter counted as a matrix)",
    )
    _add_layout_arguments(e)


def _add_sequence_arguments(e: Any) -> None:
    """The flags that count activations from the sequence length."""
    e.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens a sequence: activations per rank from the --model's config (a "
        "transformers decoder's sizes) instead of --activations",
    )
    e.add_argument("--micro-batch", type=int, default=1, help="sequences a micro-batch")
    e.add_argument(
        "--sequence-ranks",
        type=int,
        default=1,
        help="ranks each sequence is split over (sequence_parallel_size x "
        "context_parallel_size); ZeRO shards over --world-size x this",
    )
    e.add_argument("--checkpointing", action="store_true", help="checkpoint every layer")
    e.add_argument(
        "--tiled", action="store_true", help="the loss and the MLPs over tiles (tiling section)"
    )
    e.add_argument("--tile-tokens", type=int, default=4096, help="tokens a tile (tiling.tokens)")


def _sequence_activations(args: Any, facts: ModelFacts) -> float | None:
    """Activation bytes per rank from ``--seq-len`` and the model's sizes; None without it."""
    counts = {"--micro-batch": args.micro_batch, "--sequence-ranks": args.sequence_ranks}
    counts["--tile-tokens"] = args.tile_tokens
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if args.seq_len is None:
        return None
    if args.seq_len < 1 or args.seq_len % args.sequence_ranks:
        raise ValueError(
            f"--seq-len {args.seq_len} must be a positive multiple of --sequence-ranks "
            f"{args.sequence_ranks}"
        )
    if facts.shape is None:
        raise ValueError(
            "--seq-len needs a --model whose config has hidden_size, intermediate_size, "
            "num_hidden_layers, num_attention_heads and vocab_size (a transformers decoder); "
            "otherwise give --activations"
        )
    if parse_bytes(args.activations):
        raise ValueError("--seq-len counts the activations: leave out --activations")
    return activation_bytes(
        facts.shape,
        args.micro_batch * args.seq_len,
        sequence_ranks=args.sequence_ranks,
        dtype_bytes=4 if args.precision == "fp32" else 2,
        checkpointing=args.checkpointing,
        tiled=args.tiled,
        tile_tokens=args.tile_tokens,
    )


def _add_layout_arguments(e: Any) -> None:
    """The ZeRO++ / MiCS / pipeline / config / CPU flags of ``ds-strategy estimate``."""
    e.add_argument(
        "--hpz-partition-size",
        type=int,
        default=1,
        help="ZeRO++ zero_hpz_partition_size (its secondary stage-3 copy is counted)",
    )
    e.add_argument(
        "--mics-shard-size",
        type=int,
        default=-1,
        help="MiCS mics_shard_size: stages 1-3 shard over this many ranks, not all of them",
    )
    e.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="moe.ep_size: ranks each layer's experts are spread over; the experts' model "
        "state is counted apart",
    )
    e.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        help="pipeline stages (with --model, an nn.Sequential factory): the table per stage; "
        "--world-size is then the data-parallel ranks of each stage",
    )
    e.add_argument(
        "--partition-method",
        default=None,
        help="pipeline.partition_method: parameters (default), uniform, type:<regex>",
    )
    e.add_argument(
        "--stages-per-rank", type=int, default=None, help="chunks per rank (interleaved 1F1B)"
    )
    e.add_argument(
        "--config",
        help="a ds_strategy / DeepSpeed config or preset name: its pipeline section gives the "
        "three above (flags given explicitly win), its bucket and offload buffer sizes size "
        "the peak of a step",
    )
    e.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="the model's hidden size, for a --config whose bucket sizes are 'auto' (as the "
        "Hugging Face Trainer and Accelerate fill them: reduce_bucket_size = hidden^2, ...); "
        "default: the --model's config.hidden_size",
    )
    e.add_argument(
        "--cpu-only",
        action="store_true",
        help="the ranks compute on CPUs (gloo): device memory is host memory, so the host peak "
        "is the whole per-rank peak",
    )
    e.add_argument(
        "--persistence-threshold",
        type=float,
        default=DEFAULT_PERSISTENCE_THRESHOLD,
        help="stage3_param_persistence_threshold (with --model)",
    )


def _literal(text: str) -> Any:
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _pipeline_args(args: Any) -> tuple[int, str, int]:
    """(stages, partition method, chunks per rank) from the flags, else the config's
    ``pipeline`` section, else no pipeline."""
    stages, method, chunks = 1, "parameters", 1
    if args.config:
        pc = _loaded(args).resolve(args.world_size).pipeline  # the pipeline's "auto": defaults
        stages, method = pc.stages, pc.partition_method
        chunks = pc.stages_per_rank or (2 if pc.schedule == "interleaved_1f1b" else 1)
    if args.pipeline_stages != 1:
        stages = args.pipeline_stages
    method = args.partition_method or method
    chunks = args.stages_per_rank or chunks
    if stages < 1 or chunks < 1:
        raise ValueError(f"--pipeline-stages {stages} / --stages-per-rank {chunks}: must be >= 1")
    return stages, method, chunks


def _loaded(args: Any) -> Any:
    """``--config``, loaded once (so its warnings are given once)."""
    if getattr(args, "loaded_config", None) is None:
        from ..config import load_config

        args.loaded_config = load_config(args.config)
    return args.loaded_config


def _knobs(args: Any, facts: ModelFacts) -> Knobs:
    """The buffer sizes of ``--config`` (DeepSpeed's defaults without one), its ``"auto"``
    bucket sizes from the hidden size (``--hidden-size``, else the ``--model``'s config) as
    the Hugging Face Trainer and Accelerate derive them."""
    cpu_only = bool(args.cpu_only)
    if not args.config:
        return Knobs(reduce_scratch=cpu_only, shared_memory=cpu_only, cpu_only=cpu_only)
    from ..config.loop import fill_for_estimate

    hidden = args.hidden_size if args.hidden_size is not None else facts.hidden_size
    unknown = (
        "the estimate has no hidden size to derive them from (a training loop reads the "
        "model's config.hidden_size); pass --hidden-size, or write numbers for these keys"
    )
    cfg = fill_for_estimate(_loaded(args), args.world_size, hidden, unknown)
    return Knobs.from_config(cfg, cpu_only)


def _whole(parts: list[StageFacts]) -> ModelFacts:
    """The pipeline's parameters in total (a tied copy on each stage counted each time)."""
    return ModelFacts(
        params=sum(p.facts.params for p in parts),
        trainable=sum(p.facts.n_trainable for p in parts),
    )


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 6]`` -> ``"0-2, 5-6"``."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def _option(name: str, parse: Callable[[str], Any], text: str) -> Any:
    """``parse(text)``, its error naming the option ``name``."""
    try:
        return parse(text)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _model_from_args(args: Any) -> tuple[ModelFacts, list[StageFacts]]:
    """The model's facts (and a pipeline's per stage) from ``--model`` or ``--params``."""
    if not args.model:
        if args.model_arg:
            raise ValueError("--model-arg needs --model")
        if _pipeline_args(args)[0] > 1:
            raise ValueError("--pipeline-stages needs --model (its layers are partitioned)")
        return ModelFacts(params=_option("--params", parse_count, args.params)), []
    kwargs = {}
    for item in args.model_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--model-arg {item!r}: expected KEY=VALUE")
        kwargs[key] = _literal(value)
    stages, method, chunks = _pipeline_args(args)
    threshold = int(args.persistence_threshold)
    try:
        if stages > 1:
            parts = pipeline_facts(args.model, stages, method, chunks, kwargs, threshold)
            return _whole(parts), parts
        return model_facts(args.model, kwargs, threshold), []
    except ValueError as err:  # the model's own check of its arguments, or ours
        if str(err).startswith("--"):
            raise
        raise ValueError(f"--model {args.model} with {kwargs}: {err}") from None
    except (RuntimeError, TypeError, OverflowError, MemoryError) as err:
        raise ValueError(
            f"--model {args.model} with {kwargs}: building it on the meta device failed "
            f"({build_failure(err)}); check --model-arg"
        ) from None


def _check_layout_args(args: Any) -> None:
    """``--world-size``, ``--hpz-partition-size``, ``--ranks-per-node``, ``--mics-shard-size``."""
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
    if args.hpz_partition_size < 1 or args.world_size % args.hpz_partition_size:
        raise ValueError(
            f"--hpz-partition-size {args.hpz_partition_size} must divide --world-size "
            f"{args.world_size}"
        )
    if args.hidden_size is not None and args.hidden_size < 1:
        raise ValueError(f"--hidden-size must be at least 1, got {args.hidden_size}")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    if args.mics_shard_size == 0 or args.mics_shard_size < -1:
        raise ValueError(
            f"--mics-shard-size must be -1 (off) or a divisor of --world-size, got "
            f"{args.mics_shard_size}"
        )
    mics = args.mics_shard_size
    if mics > 0 and (args.world_size % mics or args.hpz_partition_size > 1):
        raise ValueError(
            f"--mics-shard-size {mics} must divide --world-size {args.world_size} and "
            "cannot be combined with --hpz-partition-size"
        )


def _describe(args: Any, facts: ModelFacts, parts: list[StageFacts]) -> str:
    """The heading: the model's size, its units or stages, the ranks."""
    mics_note = (
        f" (MiCS: stages 1-3 sharded over groups of {args.mics_shard_size})"
        if args.mics_shard_size > 0
        else ""
    )
    unit = (
        f", ZeRO-3 units: root {facts.root_unit / 1e6:.2f}M, largest block "
        f"{facts.largest_unit / 1e6:.2f}M"
        if args.model and not parts
        else f" in {len(parts)} pipeline stages"
        if parts
        else "; ZeRO-3 gathers counted as the prefetch bucket only (give --model for its units)"
    )
    return (
        f"{facts.params / 1e9:.3f}B parameters ({facts.n_trainable / 1e9:.3f}B trainable){unit}\n"
        f"{args.world_size} rank(s){mics_note}{' per stage' if parts else ''}, Adam; GB per rank "
        "(1 GB = 1e9 bytes); ok = fits"
    )


def run_cli(args: Any) -> int:
    """Print the table and the recommendation; 0 when something fits (or nothing to fit),
    1 when nothing does, 2 on bad input."""
    try:
        if not 0 <= args.persistence_threshold < 2**63:  # (NaN fails too)
            raise ValueError(
                f"--persistence-threshold must be a number of elements >= 0, got "
                f"{args.persistence_threshold}"
            )
        _check_layout_args(args)
        facts, parts = _model_from_args(args)
        gpu = _option("--gpu-mem", parse_bytes, args.gpu_mem) if args.gpu_mem else None
        cpu = _option("--cpu-mem", parse_bytes, args.cpu_mem) if args.cpu_mem else None
        act = _option("--activations", parse_bytes, args.activations)
        counted = _sequence_activations(args, facts)
        knobs = _knobs(args, facts)
    except (ValueError, OSError) as err:
        print(f"ds-strategy estimate: {err}", file=sys.stderr)
        return 2
    per_node = args.ranks_per_node or min(args.world_size, 8)
    ranks = args.world_size * args.sequence_ranks  # ZeRO shards over data x sequence ranks
    if counted is not None:
        act = counted

    def table(f: ModelFacts) -> list[Estimate]:
        return estimate_all(
            f,
            ranks,
            tuple(dict.fromkeys(("fp32", "bf16", "fp16", args.precision))),
            activation_bytes=act,
            hpz_partition_size=args.hpz_partition_size,
            mics_shard_size=args.mics_shard_size,
            ep_size=args.ep_size,
        )

    print(_describe(args, facts, parts))
    if counted is not None:
        tools = "".join(
            f", {name}" for name, on in (("checkpointing", args.checkpointing), ("tiled", args.tiled))
            if on
        )  # fmt: skip
        print(
            f"activations: {gigabytes(act)} GB per rank ({args.micro_batch} x {args.seq_len} "
            f"tokens over {args.sequence_ranks} rank(s) a sequence, {args.precision}{tools}); "
            f"model state sharded over {ranks} ranks"
        )
    if parts:
        per_stage = [table(part.facts) for part in parts]
        for part, rows in zip(parts, per_stage, strict=True):
            f = part.facts
            print(
                f"\npipeline stage {part.stage}: layers {_ranges(part.layers)}, "
                f"{f.params / 1e6:.2f}M parameters, ZeRO-3 units: root {f.root_unit / 1e6:.2f}M, "
                f"largest block {f.largest_unit / 1e6:.2f}M"
            )
            print(format_table(rows, None, cpu, per_node))
        # one config serves every stage: the recommendation must fit the largest
        estimates = worst_per_candidate(per_stage)
        print("\nper configuration, the stage needing the most memory:")
    else:
        estimates = table(facts)
    print(format_table(estimates, gpu, cpu, per_node))
    if facts.experts and not parts:
        mine = [e for e in estimates if e.precision == args.precision]
        print(
            f"experts: {facts.experts / 1e6:.2f}M of the {facts.params / 1e6:.2f}M parameters, "
            f"each layer's over {args.ep_size} rank(s) (moe.ep_size) and sharded over "
            f"{ranks // args.ep_size}; their part of the model state per rank at "
            f"{args.precision}: " + ", ".join(f"{e.name} {gigabytes(e.experts)} GB" for e in mine)
        )
    if args.ep_size > 1:
        print("(the peak of a step is not modelled with --ep-size: the table above is)")
    elif not parts and args.mics_shard_size <= 0 and args.hpz_partition_size == 1:
        peaks = [step_peak(facts, ranks, s, o, args.precision, act, knobs) for s, o in CANDIDATES]
        where = "host memory (CPU ranks)" if knobs.cpu_only else "each tier"
        print(
            f"\npeak of a training step at {args.precision}, {where}, GB per rank: model state "
            "and the step's buffers (gathered units, gradient buckets, swap buffers), "
            "[the phase] and the largest terms held then"
        )
        print(format_peaks(peaks))
    return _recommendation(args, estimates, gpu, cpu, per_node, len(parts))


def _recommendation(
    args: Any,
    estimates: list[Estimate],
    gpu: float | None,
    cpu: float | None,
    per_node: int,
    stages: int,
) -> int:
    if gpu is None:
        print("give --gpu-mem (and --cpu-mem) for a recommendation")
        return 0
    best = recommend(estimates, gpu, cpu, per_node, args.precision)
    if best is None:
        print(
            f"nothing fits {args.gpu_mem} per device at {args.precision}: add ranks "
            "(--world-size), reduce activations (activation checkpointing) or use larger devices"
        )
        return 1
    where = f", {gigabytes(best.cpu)} GB host" if best.cpu else ""
    where += f", {gigabytes(best.nvme)} GB NVMe" if best.nvme else ""
    config = config_of(best)
    if stages:
        config = {"pipeline": {"stages": stages}, **config}
    print(
        f"recommended: {best.name} {args.precision} -- {gigabytes(best.device_total)} GB per device"
        f"{where}\n  config: {json.dumps(config)}"
    )
    return 0
