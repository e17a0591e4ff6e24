"""The ``ds-strategy`` command: ``consolidate`` (here), ``convert`` (``convert.py``),
``env`` (``env.py``, the report for a bug report), ``estimate`` (``estimate.py``),
``generate`` (``generate.py``) and ``plot`` (``plot.py``, matplotlib imported only when it
draws); ``--version`` prints the package's version. ``python -m ds_strategy`` and ``python -m
ds_strategy.cli`` run it too."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from .. import __version__
from ..core.checkpoint.consolidate import consolidate
from . import convert, env, estimate, generate, plot

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "keep": None}


def main(argv: list[str] | None = None) -> int:
    """Run the ``ds-strategy`` command on ``argv`` (default: ``sys.argv[1:]``); returns the
    exit status. ``--version``, ``--help`` and usage errors exit through ``SystemExit``."""
    if not logging.getLogger().handlers:  # an application: show the package's INFO lines
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="ds-strategy", description="ds_strategy tools")
    parser.add_argument("--version", action="version", version=f"ds-strategy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_consolidate(sub)
    convert.add_cli_parser(sub)
    env.add_cli_parser(sub)
    estimate.add_cli_parser(sub)
    generate.add_cli_parser(sub)
    plot.add_cli_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "convert":
        return convert.run_cli(args)
    if args.command == "env":
        return env.run_cli(args)
    if args.command == "estimate":
        return estimate.run_cli(args)
    if args.command == "generate":
        return generate.run_cli(args)
    if args.command == "plot":
        return plot.run_cli(args)
    try:
        out = consolidate(
            args.checkpoint_dir,
            args.output,
            _DTYPES[args.dtype],
            require_checksums=not args.no_require_checksums,
            tag=args.tag,
            max_shard_size=args.max_shard_size,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
            trust_checkpoint=args.trust_checkpoint,
            plain_weights=args.plain_weights,
        )
    except (OSError, ValueError) as e:  # CheckpointError: a damaged or hostile checkpoint
        # one line, no traceback: the message names the file and what is wrong with it
        print(f"ds-strategy consolidate: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _add_consolidate(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "consolidate",
        help="write a sharded checkpoint's weights (ours or DeepSpeed's) to one file or shards",
        description="Write the weights of a ds_strategy or DeepSpeed checkpoint (told apart by "
        "content; DeepSpeed need not be installed) to one file, or to Hugging Face shards "
        "with --max-shard-size, as DeepSpeed's zero_to_fp32.py does.",
    )
    c.add_argument(
        "checkpoint_dir",
        help="a directory written by engine.save_checkpoint, a checkpoint root (its latest), "
        "a pipeline checkpoint's root (its stage_<k> together), or a DeepSpeed checkpoint's "
        "save directory (its latest) or tag directory",
    )
    c.add_argument(
        "output",
        help="the file to write: .safetensors (streamed, one tensor at a time), or .pt / .pth / "
        ".bin / .ckpt (torch.save: the whole model, or one shard, in memory at once; a "
        "Lightning Trainer's checkpoint becomes a file LightningModule.load_from_checkpoint "
        "reads)",
    )
    c.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="fp32",
        help="floating-point dtype of the output (keep: as saved; DeepSpeed's trained "
        "parameters are its fp32 master weights)",
    )
    c.add_argument(
        "--tag",
        default=None,
        help="the tag directory to export (global_step100) instead of the one latest names",
    )
    c.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="write shards of at most SIZE (5GB, 500MB, 10KB, 2GiB, or bytes) as Hugging Face "
        "does: for dir/model.safetensors, dir/model-00001-of-0000N.safetensors ... and "
        "dir/model.safetensors.index.json (just the output file when one shard holds all); a "
        "tensor larger than SIZE gets a shard of its own",
    )
    c.add_argument(
        "--exclude-frozen-parameters",
        action="store_true",
        help="leave out parameters that did not train (DeepSpeed's frozen_param_shapes; ours: "
        "weights without optimizer state)",
    )
    c.add_argument(
        "--plain-weights",
        action="store_true",
        help="write the weights alone ({name: tensor}), also for a Lightning Trainer's "
        "checkpoint (whose .pt / .ckpt output otherwise keeps Lightning's entries, "
        "hyper-parameters among them, with the weights under state_dict)",
    )
    c.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="a DeepSpeed checkpoint: unpickle objects other than tensors, plain data and "
        "DeepSpeed's few records; a Lightning Trainer's: its entries' objects other than "
        "plain data (only for a checkpoint you trust)",
    )
    c.add_argument(
        "--no-require-checksums",
        action="store_true",
        help="accept a checkpoint that records no checksums (only one you trust)",
    )
