"""`naflexclip data export`: write a slice of the built-in dataset as shards, CSV + images, a folder, or Parquet."""

from __future__ import annotations

import argparse
import shlex

from naflexclip.data.dataset_export import EXPORT_FORMATS, IMAGE_FORMATS, export_synthetic, shard_spec


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `data` with its `export` subcommand."""
    data = subparsers.add_parser("data", help="data tools (export the built-in dataset)")
    commands = data.add_subparsers(dest="data_command", required=True)
    export = commands.add_parser(
        "export", help="write the built-in dataset as WebDataset shards, image folder + CSV, image + .txt, or Parquet "
        "in the Hub's layout"
    )
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--format", default="webdataset", choices=EXPORT_FORMATS)
    export.add_argument("--split", default="train", choices=("train", "val"))
    export.add_argument("--start", type=int, default=0, help="first sample index")
    export.add_argument("--count", type=int, default=1000, help="number of samples")
    export.add_argument("--image-format", default="jpg", choices=tuple(IMAGE_FORMATS))
    export.add_argument("--shard-size", type=int, default=1000, help="samples per tar shard (Parquet file)")
    export.add_argument("--synthetic-seed", type=int, default=0)
    export.add_argument("--csv-separator", default="\t")
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Handler of `naflexclip data export`."""
    paths = export_synthetic(
        args.out, fmt=args.format, split=args.split, start=args.start, count=args.count,
        image_format=args.image_format, shard_size=args.shard_size, seed=args.synthetic_seed,
        csv_separator=args.csv_separator,
    )
    target = shard_spec(paths) if args.format in ("webdataset", "parquet") else paths[0]
    flags = f"--{args.split}-data {shlex.quote(target)} --dataset-type {args.format}"
    if args.format == "csv" and args.csv_separator != "\t":  # the reader's default is a tab: say the one written
        flags += f" --csv-separator {shlex.quote(args.csv_separator)}"
    print(f"wrote {args.count} {args.split} samples; use {flags}")
    return 0
