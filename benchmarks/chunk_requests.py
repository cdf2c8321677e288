"""GETs per sample and bytes fetched ÷ the shards' bytes of one training epoch read from S3 (moto's server on
localhost), at 1 and 2 ranks, the shards' indexes already cached: every ranged GET of the data layer counted.

    python benchmarks/chunk_requests.py --num-images 800 --shard-size 100 [--fetch-chunk-size 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from s3_server import s3_environment, s3_server, upload  # noqa: E402

from naflexclip.data import DataConfig, build_loader, remote  # noqa: E402
from naflexclip.data.dataset_export import export_synthetic  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=800)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--fetch-chunk-size", type=int, default=8)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    export_synthetic(os.path.join(root, "wds"), count=args.num_images, shard_size=args.shard_size)
    shard_bytes = sum(os.path.getsize(os.path.join(root, "wds", f)) for f in os.listdir(os.path.join(root, "wds"))
                      if f.endswith(".tar"))
    count = {"gets": 0, "bytes": 0}
    cat = remote._cat_range

    def counted(fs, path, url, start, end, version):  # noqa: ANN001, ANN202
        data = cat(fs, path, url, start, end, version)
        count["gets"] += 1
        count["bytes"] += len(data)
        return data

    remote._cat_range = counted
    last = args.num_images // args.shard_size - 1
    with s3_server() as endpoint:
        os.environ.update(s3_environment(endpoint))
        upload(os.path.join(root, "wds"), "s3://data/wds")
        spec = f"s3://data/wds/train-{{00000..{last:05d}}}.tar"
        cfg = DataConfig(train_data=spec, naflex_seq_lens=(64, 144), naflex_max_tokens_per_batch=1152, workers=0,
                         seed=0, shard_index_dir=os.path.join(root, "index"), fetch_chunk_size=args.fetch_chunk_size)
        build_loader(cfg, split="train", patch_size=16, context_length=32)  # indexes cached
        for world in (1, 2):
            count.update(gets=0, bytes=0)
            samples = 0
            for rank in range(world):
                loader = build_loader(cfg, split="train", patch_size=16, context_length=32, rank=rank,
                                      world_size=world)
                samples += sum(b["text"].shape[0] for b in loader)
            print(f"{world} rank(s), --fetch-chunk-size {args.fetch_chunk_size}: {samples} samples, "
                  f"{count['gets'] / samples:.3f} GETs per sample, {count['bytes'] / shard_bytes:.3f} x the shards' "
                  f"bytes")


if __name__ == "__main__":
    main()
