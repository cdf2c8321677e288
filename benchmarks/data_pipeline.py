"""Benchmark: samples/s per worker of decode -> NaFlex transform -> collate, naflexclip vs timm's NaFlex loader.

All loaders read the same JPEG/PNG images exported from the built-in dataset, with the same
sequence lengths, token budget, patch size, interpolation and no augmentation; timm's side is
`timm.data.naflex_loader.create_naflex_loader` (its `NaFlexMapDatasetWrapper`) over the image files,
without the GPU prefetcher, so every loader does the whole job on the CPU workers. naflexclip reads
the images three ways: a CSV table of files, WebDataset shards indexed and read by offset (local
`.tar`), and the same shards streamed (`pipe:cat`, the path for shards that cannot be indexed).
Prints each rate and its ratio to timm's.

    python benchmarks/data_pipeline.py --num-images 2000 --workers 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time

import torch
from PIL import Image
from timm.data.naflex_loader import create_naflex_loader

from naflexclip.data import DataConfig, build_loader
from naflexclip.data.export import export_synthetic, shard_spec


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
    args = parser.parse_args()
    torch.set_num_threads(1)

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
