"""Command-line entry point: `naflexclip <command>` with one module per command.

Each command module exposes `add_parser(subparsers)`, which registers its flags and sets
`func(args) -> int` as the handler; this file only dispatches.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import NoReturn

# command modules, in the order `--help` lists them
COMMAND_MODULES = (
    "naflexclip.train.train_command",
    "naflexclip.audit.verify_command",
    "naflexclip.data.data_command",
    "naflexclip.families.export_command",
    "naflexclip.checkpoints.checkpoint_command",
    "naflexclip.evaluation.benchmark_tasks",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser (its commands' too) whose error is one line naming the command, without the usage block
    that argparse prints first (over 100 lines for `train`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="naflexclip",
        description="Exact gradient accumulation for NaFlex CLIP/SigLIP training.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def _hint(command: argparse.ArgumentParser, argv: list[str], unrecognized: list[str]) -> str:
    """For an unknown flag, the command's nearest real one (not one it refuses, which --help hides); for
    unrecognized values, `_one_value_hint`."""
    if unrecognized[0].startswith("--"):
        flags = [flag for flag, action in command._option_string_actions.items()
                 if flag.startswith("--") and action.help is not argparse.SUPPRESS]
        nearest = difflib.get_close_matches(unrecognized[0].split("=", 1)[0], flags, n=1)
        return f"; did you mean {nearest[0]}?" if nearest else ""
    return _one_value_hint(command, argv, unrecognized)


def _one_value_hint(command: argparse.ArgumentParser, argv: list[str], unrecognized: list[str]) -> str:
    """Where the unrecognized values follow the value of a flag that takes one (a shell glob, OpenCLIP's `1::2`
    typed as `1 2`): that the flag takes one value, and how its form joins several."""
    at = argv.index(unrecognized[0]) if unrecognized[0] in argv else 0
    action = command._option_string_actions.get(argv[at - 2]) if at >= 2 else None
    if action is None or action.nargs is not None:
        return ""
    form = str(action.metavar or "")
    joined = f"; join several with '::' ({argv[at - 2]} {form})" if "::" in form else ""
    return f"; {argv[at - 2]} takes one value{joined}"


def main(argv: list[str] | None = None) -> int:
    from naflexclip.settings import given_destinations

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unrecognized = parser.parse_known_args(argv)
    if unrecognized:  # said by the parser of the command given (`data export`), which names it
        command: argparse.ArgumentParser = parser
        while chosen := next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None):
            command = chosen.choices[getattr(args, chosen.dest)]
        command.error(f"unrecognized arguments: {' '.join(unrecognized)}{_hint(command, argv, unrecognized)}")
    args.given = given_destinations(parser, argv)  # a resume keeps the run's saved value of every other setting
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
