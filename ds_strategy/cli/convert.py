"""``ds-strategy convert SRC DST --to deepspeed``: one of our checkpoints in DeepSpeed's layout
(``core/checkpoint/deepspeed/export.py``), so a run can go back to DeepSpeed."""

from __future__ import annotations

import sys
from typing import Any

from ..core.checkpoint.deepspeed.export import convert


def add_cli_parser(sub: Any) -> None:
    c = sub.add_parser(
        "convert",
        help="write a checkpoint in DeepSpeed's layout, for DeepSpeed to resume from",
        description="Write a ds_strategy checkpoint as DeepSpeed's global_step<N>/ and latest.",
    )
    c.add_argument("src", help="a checkpoint written by save_checkpoint, or its root (latest)")
    c.add_argument("dst", help="the directory to write DeepSpeed's checkpoint under")
    c.add_argument("--to", choices=["deepspeed"], default="deepspeed", help="the layout")
    c.add_argument("--world-size", type=int, required=True, help="DeepSpeed's data-parallel ranks")
    c.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True, help="its ZeRO stage")
    c.add_argument("--tag", help="a tag under SRC other than the one latest names")
    c.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle objects other than tensors and plain data (only a checkpoint you trust)",
    )


def run_cli(args: Any) -> int:
    try:
        out = convert(
            args.src,
            args.dst,
            args.to,
            world_size=args.world_size,
            stage=args.stage,
            tag=args.tag,
            trust_checkpoint=args.trust_checkpoint,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"ds-strategy convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
