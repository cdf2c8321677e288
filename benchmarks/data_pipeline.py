"""Benchmark: samples/s per worker of decode -> NaFlex transform -> collate, naflexclip vs timm's NaFlex loader.

All loaders read the same JPEG/PNG images exported from the built-in dataset, with the same
sequence lengths, token budget, patch size, interpolation and no augmentation; timm's side is
`timm.data.naflex_loader.create_naflex_loader` (its `NaFlexMapDatasetWrapper`) over the image files,
without the GPU prefetcher, so every loader does the whole job on the CPU workers. naflexclip reads
the images three ways: a CSV table of files, WebDataset shards indexed and read by offset (local
`.tar`), and the same shards streamed (`pipe:cat`, the path for shards that cannot be indexed).
Prints each rate and its ratio to timm's.

`--recipes` measures OpenCLIP's data recipes instead, on one set of exported shards: today's loader (every shard
indexed at startup, one permutation per epoch) against the same shards planned from their `sizes.json` (block
order), `--dataset-resampled` and a `::` mixture with `--train-data-upsampling-factors 1::2` (samples/s and the
ratio to today's); then the startup of a 100,000-shard `sizes.json` (10,000 samples each, LAION scale) per rank:
seconds and peak MiB above the imports for `build_loader` and the next epoch's plan, at 1 and 8 simulated ranks
(rank 0 of each, in a fresh process), with `sizes.json` checked against each shard and with `--trust-sizes-json`.

`--epoch-start` measures the time from the start of an epoch (the loader's iteration) to its first microbatch, for
epochs 2 and on, with `--workers`: one loader whose workers are kept from epoch to epoch (ours) against a new loader
each epoch, whose workers start with the epoch (what each epoch cost before they were kept); the median over
`--repeats` epochs, on WebDataset shards with a `sizes.json` and on a CSV of files.

    python benchmarks/data_pipeline.py --num-images 2000 --workers 1
    python benchmarks/data_pipeline.py --recipes --num-images 2000 --workers 2
    python benchmarks/data_pipeline.py --epoch-start --num-images 400 --workers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from PIL import Image
from timm.data.naflex_loader import create_naflex_loader

from naflexclip.data import DataConfig, build_loader
from naflexclip.data.dataset_export import export_synthetic, shard_spec


class FolderImages(torch.utils.data.Dataset):
    """timm-style map dataset over image files: (RGB PIL image, target), like timm's ImageDataset."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        with open(self.paths[index], "rb") as f:
            img = Image.open(f).convert("RGB")
        return img, 0


def time_loader(loader, num_images: int) -> float:
    start = time.perf_counter()
    seen = 0
    for batch in loader:
        seen += (batch["image"]["patches"] if isinstance(batch, dict) else batch[0]["patches"]).shape[0]
    elapsed = time.perf_counter() - start
    # an indexed epoch is every sample once; a stream's is --train-num-samples samples, repeats allowed
    assert seen == num_images, (seen, num_images)
    return seen / elapsed


STARTUP_CHILD = """
import json, resource, sys, time
from naflexclip.data import DataConfig, build_loader
spec, world_size, trusted = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "trusted"
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
cfg = DataConfig(train_data=spec, naflex_seq_lens=(128, 256, 576, 784, 1024), naflex_max_tokens_per_batch=16384,
                 naflex_batch_divisor=8, workers=2, trust_sizes_json=trusted)
loader = build_loader(cfg, split="train", patch_size=16, context_length=77, rank=0, world_size=world_size)
built = time.perf_counter()
loader.set_epoch(1)
planned = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"samples": loader.samples_per_epoch, "steps": loader.num_batches, "build_s": built - start,
                  "next_epoch_s": planned - built, "peak_mib": (peak - base) / 1024}))
"""


def startup(tmp: str, num_shards: int, per_shard: int) -> None:
    """Per-rank startup and memory of a `num_shards`-shard sizes.json at 1 and 8 simulated ranks: checked against
    each shard (the default) and trusted (--trust-sizes-json)."""
    root = os.path.join(tmp, "laion")
    os.makedirs(root)
    export_synthetic(root, fmt="webdataset", count=2, shard_size=2)  # one real shard: the list must name a file
    os.replace(os.path.join(root, "train-00000.tar"), os.path.join(root, "00000000.tar"))
    with open(os.path.join(root, "sizes.json"), "w") as f:
        json.dump({f"{i:08d}.tar": per_shard for i in range(num_shards)}, f)
    spec = os.path.join(root, f"{{00000000..{num_shards - 1:08d}}}.tar")
    print(f"startup: {num_shards} shards x {per_shard} samples in a sizes.json (seq_lens 128-1024, 16384 tokens, "
          "divisor 8), rank 0, fresh process each")
    for how in ("checked", "trusted"):
        for world_size in (1, 8):
            out = subprocess.run([sys.executable, "-c", STARTUP_CHILD, spec, str(world_size), how],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"  sizes.json {how}, {world_size} rank(s): build_loader {r['build_s']:.2f} s, next epoch's plan "
                  f"{r['next_epoch_s']:.2f} s, peak +{r['peak_mib']:.0f} MiB; {r['samples']} samples, "
                  f"{r['steps']} microbatches per rank")


def recipes(args: argparse.Namespace, tmp: str) -> None:
    """Today's loader, the sizes.json plan, resampled and mixture loaders on the same shards (samples/s)."""
    sized = os.path.join(tmp, "sized")
    shards = export_synthetic(sized, fmt="webdataset", count=args.num_images, image_format=args.image_format,
                              shard_size=args.shard_size)
    indexed = os.path.join(tmp, "indexed")  # the same files, no sizes.json: every shard indexed at startup
    os.makedirs(indexed)
    for path in shards:
        os.symlink(path, os.path.join(indexed, os.path.basename(path)))
    half = len(shards) // 2
    common = dict(naflex_seq_lens=tuple(args.seq_lens), naflex_max_tokens_per_batch=args.max_tokens,
                  workers=args.workers)
    specs = {
        "today (indexed)": DataConfig(train_data=shard_spec([os.path.join(indexed, os.path.basename(p))
                                                             for p in shards]), **common),
        "sizes.json plan": DataConfig(train_data=shard_spec(shards), **common),
        "resampled": DataConfig(train_data=shard_spec(shards), dataset_resampled=True,
                                train_num_samples=args.num_images, **common),
        "mixture 1::2": DataConfig(train_data=f"{shard_spec(shards[:half])}::{shard_spec(shards[half:])}",
                                   train_data_upsampling_factors="1::2", train_num_samples=args.num_images, **common),
    }
    loaders = {name: build_loader(cfg, split="train", patch_size=args.patch_size, context_length=77)
               for name, cfg in specs.items()}
    rates = dict.fromkeys(loaders, 0.0)
    for _ in range(args.repeats):  # alternate, so background load hits all alike
        for name, loader in loaders.items():
            rates[name] = max(rates[name], time_loader(loader, args.num_images))
    print(f"images={args.num_images} ({args.image_format}, 48-512 px) seq_lens={args.seq_lens} "
          f"max_tokens={args.max_tokens} patch={args.patch_size} workers={args.workers} shard_size={args.shard_size}")
    today = rates["today (indexed)"]
    for name, rate in rates.items():
        print(f"{name:<20}: {rate:8.1f} samples/s  {rate / today:.2f}x today's")


def first_batch_s(loader, epoch: int) -> float:
    """Seconds from the start of `epoch`'s iteration to its first microbatch (the rest of the epoch is read too)."""
    loader.set_epoch(epoch)
    start = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    elapsed = time.perf_counter() - start
    for _ in iterator:
        pass
    return elapsed


def epoch_start(args: argparse.Namespace, tmp: str) -> None:
    """Time to an epoch's first microbatch: workers kept across epochs against workers started with each epoch."""
    table = export_synthetic(tmp, fmt="csv", count=args.num_images, image_format=args.image_format)[0]
    shards = export_synthetic(os.path.join(tmp, "shards"), fmt="webdataset", count=args.num_images,
                              image_format=args.image_format, shard_size=args.shard_size)
    common = dict(naflex_seq_lens=tuple(args.seq_lens), naflex_max_tokens_per_batch=args.max_tokens,
                  workers=args.workers)
    print(f"time to the first microbatch of epochs 2..{args.repeats + 1}, median; images={args.num_images} "
          f"({args.image_format}) workers={args.workers} seq_lens={args.seq_lens} max_tokens={args.max_tokens}")
    for name, cfg in (("webdataset, sizes.json", DataConfig(train_data=shard_spec(shards), **common)),
                      ("csv (files)", DataConfig(train_data=table, **common))):
        build = lambda epoch, cfg=cfg: build_loader(cfg, split="train", patch_size=args.patch_size,  # noqa: E731
                                                    context_length=77, epoch=epoch)
        kept_loader = build(0)
        first_batch_s(kept_loader, 0)  # the workers start here, once
        kept, restarted = [], []
        for epoch in range(1, args.repeats + 1):  # alternate, so background load hits both alike
            kept.append(first_batch_s(kept_loader, epoch))
            restarted.append(first_batch_s(build(epoch), epoch))
        k, r = statistics.median(kept), statistics.median(restarted)
        print(f"{name:<24}: kept {k:.3f} s, restarted each epoch {r:.3f} s ({r / k:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256, 576])
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--patch-size", type=int, default=16)
    parser.add_argument("--image-format", default="jpg", choices=("jpg", "png", "webp"))
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per loader (best is kept)")
    parser.add_argument("--shard-size", type=int, default=250, help="samples per WebDataset shard")
    parser.add_argument("--recipes", action="store_true",
                        help="the resampled and mixture loaders against today's, and startup at 100,000 shards")
    parser.add_argument("--startup-shards", type=int, default=100_000)
    parser.add_argument("--startup-shard-size", type=int, default=10_000)
    parser.add_argument("--epoch-start", action="store_true",
                        help="time to each epoch's first microbatch, workers kept across epochs or restarted")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.epoch_start:
        with tempfile.TemporaryDirectory() as tmp:
            epoch_start(args, tmp)
        return
    if args.recipes:
        with tempfile.TemporaryDirectory() as tmp:
            recipes(args, tmp)
            startup(tmp, args.startup_shards, args.startup_shard_size)
        return

    with tempfile.TemporaryDirectory() as tmp:
        table = export_synthetic(tmp, fmt="csv", count=args.num_images, image_format=args.image_format)[0]
        shards = export_synthetic(os.path.join(tmp, "shards"), fmt="webdataset", count=args.num_images,
                                  image_format=args.image_format, shard_size=args.shard_size)
        common = dict(naflex_seq_lens=tuple(args.seq_lens), naflex_max_tokens_per_batch=args.max_tokens,
                      workers=args.workers)
        specs = {
            "csv (files)": DataConfig(train_data=table, **common),
            "webdataset indexed": DataConfig(train_data=shard_spec(shards), **common),
            "webdataset streamed": DataConfig(train_data="::".join(f"pipe:cat {p}" for p in shards),
                                              dataset_type="webdataset", train_num_samples=args.num_images,
                                              **common),
        }
        ours = {name: build_loader(cfg, split="train", patch_size=args.patch_size, context_length=77)
                for name, cfg in specs.items()}
        paths = sorted(os.path.join(tmp, "images", f) for f in os.listdir(os.path.join(tmp, "images")))
        with contextlib.redirect_stdout(io.StringIO()):  # timm prints its schedule
            theirs = create_naflex_loader(
                FolderImages(paths), patch_size=args.patch_size, train_seq_lens=tuple(args.seq_lens),
                batch_size=args.max_tokens // max(args.seq_lens), is_training=True, no_aug=True,
                interpolation="bicubic", num_workers=args.workers, use_prefetcher=False, pin_memory=False,
                device=torch.device("cpu"), persistent_workers=False,
            )
        rates = dict.fromkeys([*ours, "timm"], 0.0)
        for _ in range(args.repeats):  # alternate, so background load hits all alike
            for name, loader in ours.items():
                rates[name] = max(rates[name], time_loader(loader, args.num_images))
            rates["timm"] = max(rates["timm"], time_loader(theirs, args.num_images))

    workers = max(1, args.workers)
    print(f"images={args.num_images} ({args.image_format}, 48-512 px) seq_lens={args.seq_lens} "
          f"max_tokens={args.max_tokens} patch={args.patch_size} workers={args.workers} shard_size={args.shard_size}")
    for name, rate in rates.items():
        ratio = f"  {rate / rates['timm']:.2f}x timm" if name != "timm" else ""
        print(f"{name:<20}: {rate:8.1f} samples/s ({rate / workers:.1f} per worker){ratio}")


if __name__ == "__main__":
    main()
