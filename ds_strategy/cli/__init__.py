"""The ``ds-strategy`` command: ``consolidate`` (here), ``estimate`` (``estimate.py``) and
``generate`` (``generate.py``); ``python -m ds_strategy.cli`` runs it too."""

from __future__ import annotations

import argparse
import sys

import torch

from ..core.checkpoint.consolidate import consolidate
from . import estimate, generate

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "keep": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-strategy", description="ds_strategy tools")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write a sharded checkpoint's weights to one file")
    c.add_argument(
        "checkpoint_dir",
        help="a directory written by engine.save_checkpoint, a checkpoint root (its latest), "
        "or a pipeline checkpoint's root (its stage_<k> together)",
    )
    c.add_argument(
        "output",
        help="the file to write: .safetensors (streamed, one tensor at a time), or .pt / .pth / "
        ".bin (torch.save: the whole model in memory at once)",
    )
    c.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="fp32",
        help="floating-point dtype of the output (keep: as saved)",
    )
    c.add_argument(
        "--no-require-checksums",
        action="store_true",
        help="accept a checkpoint that records no checksums (only one you trust)",
    )
    estimate.add_cli_parser(sub)
    generate.add_cli_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return estimate.run_cli(args)
    if args.command == "generate":
        return generate.run_cli(args)
    try:
        out = consolidate(
            args.checkpoint_dir,
            args.output,
            _DTYPES[args.dtype],
            require_checksums=not args.no_require_checksums,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"ds-strategy consolidate: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
