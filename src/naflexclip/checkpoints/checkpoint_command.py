"""`naflexclip checkpoint consolidate DIR --out FOLDER_OR_FILE`: the full form of a sharded checkpoint
(`--fsdp-checkpoint sharded`), for tools that need one file: a checkpoint folder every reader of full checkpoints
takes (`--resume`, `--pretrained`, eval, verify, export), or, for `--out NAME.safetensors`, the model's weights alone.
Runs in one process, without a process group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def consolidate(args: argparse.Namespace) -> int:
    from naflexclip.checkpoints import sharded, storage

    try:
        found = storage.load_checkpoint(args.checkpoint, notify=lambda line: print(line, file=sys.stderr))
        out = sharded.consolidate(found.path, Path(args.out))
    except (ValueError, FileNotFoundError, FileExistsError) as error:  # CheckpointError is a ValueError
        print(f"naflexclip checkpoint consolidate: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {out} (step {found.step}, the full form of {found.path})")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("checkpoint", help="checkpoint tools: consolidate a sharded checkpoint")
    tools = parser.add_subparsers(dest="tool", required=True)
    merge = tools.add_parser("consolidate", help="write the full form of a sharded checkpoint")
    merge.add_argument("checkpoint", help="a sharded checkpoint directory, or a run's checkpoints/ (latest)")
    merge.add_argument("--out", required=True,
                       help="a new checkpoint folder (full form), or a .safetensors file (the model's weights)")
    merge.set_defaults(func=consolidate)
