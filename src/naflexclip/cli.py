"""Command-line entry point: `naflexclip <command>` with one module per command.

Each command module exposes `add_parser(subparsers)`, which registers its flags and sets
`func(args) -> int` as the handler; this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command modules, in the order `--help` lists them
COMMAND_MODULES = (
    "naflexclip.train.train_command",
    "naflexclip.audit.verify_command",
    "naflexclip.data.data_command",
    "naflexclip.models.export_command",
    "naflexclip.checkpoints.checkpoint_command",
    "naflexclip.evaluation.benchmark_tasks",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="naflexclip",
        description="Exact gradient accumulation for NaFlex CLIP/SigLIP training.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from naflexclip.settings import given_destinations

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.given = given_destinations(parser, argv)  # a resume keeps the run's saved value of every other setting
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
