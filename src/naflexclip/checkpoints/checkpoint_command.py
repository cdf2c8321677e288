"""`naflexclip checkpoint consolidate DIR --out FOLDER_OR_FILE`: the full form of a sharded checkpoint
(`--fsdp-checkpoint sharded`), for tools that need one file: a checkpoint folder every reader of full checkpoints
takes (`--resume`, `--pretrained`, eval, verify, export), or, for `--out NAME.safetensors`, the model's weights alone.
Runs in one process, without a process group.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def consolidate(source: Path, out: Path) -> Path:
    """The full form of the sharded checkpoint `source`: a checkpoint folder `out` (`model.safetensors`,
    `train_state.pt` holding the other states whole, `checkpoint.json`) that every reader of full checkpoints takes;
    a path ending in `.safetensors` gets the model's weights alone. One process holds one state whole at a time."""
    from naflexclip.checkpoints import storage

    found = storage.load_checkpoint(source)
    if not found.sharded:
        raise ValueError(f"{str(found.path)!r} is a full checkpoint already; nothing to consolidate")
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        storage.write_safetensors({k: v.contiguous() for k, v in found.full_state(storage.MODEL).items()}, out)
        return out
    if out.exists():
        raise FileExistsError(f"--out {str(out)!r} exists; name a new folder")
    states = {**found.states, **{name: found.full_state(name) for name in found.sharded}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")  # renamed into place once complete
    try:
        tmp.mkdir()
        storage.write_full(tmp, states, step=found.step, epoch=found.epoch)
    except BaseException:
        storage.discard(tmp)
        raise
    os.replace(tmp, out)
    return out


def consolidate_command(args: argparse.Namespace) -> int:
    from naflexclip.checkpoints import storage

    try:
        found = storage.load_checkpoint(args.checkpoint, notify=lambda line: print(line, file=sys.stderr))
        out = consolidate(found.path, Path(args.out))
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
    merge.set_defaults(func=consolidate_command)
