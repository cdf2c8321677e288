"""`naflexclip data export`: write a slice of the built-in dataset as shards, CSV + images, a folder, or Parquet;
`naflexclip data index`: write shards' indexes beside them, so that a run's startup reads no shard."""

from __future__ import annotations

import argparse
import shlex
import sys

from naflexclip.data import remote
from naflexclip.data.data_config import DEFAULT_IMAGE_KEY, split_keys
from naflexclip.data.dataset_export import EXPORT_FORMATS, IMAGE_FORMATS, export_synthetic, shard_spec
from naflexclip.data.shard_index import INDEX_SUFFIX, SHARD_STATUS_REASONS, index_shards, is_indexable
from naflexclip.data.shards import MemberKeys, expand_shards


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `data` with its `export` and `index` subcommands."""
    data = subparsers.add_parser("data", help="data tools (export the built-in dataset, index shards)")
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
    index = commands.add_parser(
        "index", help=f"write each .tar shard's sample offsets beside it (<shard>{INDEX_SUFFIX}, local or in object "
        "storage, stamped with the shard's size and version): a run then reads them instead of the shards' headers")
    index.add_argument("shards", nargs="+", help='shard specs as --train-data takes them ("s3://b/s/{00000..00099}.tar")')
    index.add_argument("--image-key", default=DEFAULT_IMAGE_KEY, help="as the runs that read them will pass it")
    index.add_argument("--text-key", default="txt", help="as the runs that read them will pass it")
    index.add_argument("--json-text-key", default=None, help="as the runs that read them will pass it")
    index.add_argument("--shard-index-dir", default=None, help="the local index cache (as a run's): shards indexed "
                       "there already are not read again")
    index.set_defaults(func=run_index)


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


def run_index(args: argparse.Namespace) -> int:
    """Handler of `naflexclip data index`."""
    urls = [url for spec in args.shards for part in spec.split("::") for url in expand_shards(part)]
    unindexable = [url for url in urls if not is_indexable(url)]
    if unindexable:
        print(f"naflexclip data index: error: {unindexable[0]!r} is not an uncompressed .tar shard (only those are "
              "read by offset)", file=sys.stderr)
        return 2
    keys = MemberKeys(split_keys(args.image_key), split_keys(args.text_key), args.json_text_key is not None)
    try:
        indexes = index_shards(urls, keys, args.shard_index_dir)
    except (OSError, remote.Unreachable) as error:
        print(f"naflexclip data index: error: cannot write an index beside the shards: {error}", file=sys.stderr)
        return 2
    failed = [i for i in indexes if i.status in ("missing", "unreachable", "changed")]
    for index in failed:
        print(f"{SHARD_STATUS_REASONS[index.status]}: {index.detail or index.url} (not indexed)", file=sys.stderr)
    done = [i for i in indexes if i not in failed]
    print(f"indexed {len(done)} shards ({sum(len(i) for i in done)} samples)"
          + (f"; {len(failed)} could not be read" if failed else ""))
    return 1 if failed else 0
