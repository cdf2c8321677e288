"""Benchmark: samples/s per worker of decode -> NaFlex transform -> collate, naflexclip vs timm's NaFlex loader.

Both loaders read the same JPEG/PNG files exported from the built-in dataset, with the same
sequence lengths, token budget, patch size, interpolation and no augmentation; timm's side is
`timm.data.naflex_loader.create_naflex_loader` (its `NaFlexMapDatasetWrapper`) without the
GPU prefetcher, so both do the whole job on the CPU workers. Prints both rates and the ratio.

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
from naflexclip.data.export import export_synthetic


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
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        table = export_synthetic(tmp, fmt="csv", count=args.num_images, image_format=args.image_format)[0]
        cfg = DataConfig(train_data=table, naflex_seq_lens=tuple(args.seq_lens),
                         naflex_max_tokens_per_batch=args.max_tokens, workers=args.workers)
        ours = build_loader(cfg, split="train", patch_size=args.patch_size, context_length=77)
        paths = sorted(os.path.join(tmp, "images", f) for f in os.listdir(os.path.join(tmp, "images")))
        with contextlib.redirect_stdout(io.StringIO()):  # timm prints its schedule
            theirs = create_naflex_loader(
                FolderImages(paths), patch_size=args.patch_size, train_seq_lens=tuple(args.seq_lens),
                batch_size=args.max_tokens // max(args.seq_lens), is_training=True, no_aug=True,
                interpolation="bicubic", num_workers=args.workers, use_prefetcher=False, pin_memory=False,
                device=torch.device("cpu"), persistent_workers=False,
            )
        ours_rate = timm_rate = 0.0
        for _ in range(args.repeats):  # alternate, so background load hits both alike
            ours_rate = max(ours_rate, time_loader(ours, args.num_images))
            timm_rate = max(timm_rate, time_loader(theirs, args.num_images))

    workers = max(1, args.workers)
    print(f"images={args.num_images} ({args.image_format}, 48-512 px) seq_lens={args.seq_lens} "
          f"max_tokens={args.max_tokens} patch={args.patch_size} workers={args.workers}")
    print(f"naflexclip: {ours_rate:8.1f} samples/s ({ours_rate / workers:.1f} per worker, incl. tokenization)")
    print(f"timm      : {timm_rate:8.1f} samples/s ({timm_rate / workers:.1f} per worker)")
    print(f"ratio naflexclip/timm: {ours_rate / timm_rate:.2f}")


if __name__ == "__main__":
    main()
