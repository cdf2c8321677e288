"""Benchmark: samples/s of one training epoch read from object storage against the same data on local disk.

The built-in dataset is exported once as WebDataset shards (with `sizes.json`) and as Parquet files in the Hub's
layout (the same samples), and uploaded to an S3 API on localhost (moto's server, in its own process). One epoch
each, the same token budget, sequence lengths and patch size:

- indexed shards on local disk and in the bucket (ranged reads), at 0, 2 and 4 `--workers`;
- the same shards streamed from the bucket the WebDataset way (`pipe:curl --aws-sigv4`, `--train-num-samples` = all
  samples);
- Parquet against WebDataset on local disk and in the bucket, at 2 workers.

Each row is build + one epoch (startup included: listing, `sizes.json`, indexing by ranged requests), the best of
`--repeats`; ratios are to the local shards at the same workers. A localhost server has no network latency, so this
measures the per-request overhead of the S3 path (HTTP, signing, the client), not a real store's.

    python benchmarks/remote_data.py --num-images 400 --shard-size 50
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time

from naflexclip.data import DataConfig, build_loader
from naflexclip.data.dataset_export import export_synthetic, shard_spec


def start_s3() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process (as a store is: it does not share this process's interpreter)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    return server, endpoint


def upload(local_dir: str, prefix: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = prefix.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for name in sorted(os.listdir(local_dir)):
        fs.put_file(os.path.join(local_dir, name), f"s3://{prefix}/{name}")


def epoch_rate(spec: str, workers: int, repeats: int, index_dir: str, **overrides: object) -> float:
    best = float("inf")
    for r in range(repeats):
        cfg = DataConfig(train_data=spec, naflex_seq_lens=(64, 128, 256), naflex_max_tokens_per_batch=4096,
                         workers=workers, seed=0, shard_index_dir=os.path.join(index_dir, f"{time.time_ns()}-{r}"),
                         **overrides)
        start = time.perf_counter()
        loader = build_loader(cfg, split="train", patch_size=16, context_length=32)
        samples = sum(len(batch["keys"]) for batch in loader)
        best = min(best, time.perf_counter() - start)
    return samples / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=400)
    parser.add_argument("--shard-size", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    logging.getLogger("naflexclip.data").setLevel(logging.ERROR)
    root = tempfile.mkdtemp(prefix="remote-bench-")
    wds = export_synthetic(os.path.join(root, "wds"), count=args.num_images, shard_size=args.shard_size)
    tables = export_synthetic(os.path.join(root, "parquet"), fmt="parquet", count=args.num_images,
                              shard_size=args.shard_size)
    server, endpoint = start_s3()
    upload(os.path.join(root, "wds"), "bench/wds")
    upload(os.path.join(root, "parquet"), "bench/parquet")
    local_tar, local_pq = shard_spec(wds), shard_spec(tables)
    s3_tar = f"s3://bench/wds/{os.path.basename(local_tar)}"
    s3_pq = f"s3://bench/parquet/{os.path.basename(local_pq)}"
    # WebDataset's way to read a private bucket: a signed GET per shard, streamed (exit 23: the reader closed the
    # pipe before the shard's end, as a slot does when its share of the epoch is read)
    piped = (f"pipe:curl -s --fail --aws-sigv4 aws:amz:us-east-1:s3 --user bench:bench "
             f"{endpoint}/bench/wds/{os.path.basename(local_tar)} || test $? -eq 23")
    index = os.path.join(root, "index")
    epoch_rate(local_tar, 0, 1, index)  # warm-up: imports, the tokenizer, the page cache
    rows = []
    for workers in (0, 2, 4):
        local = epoch_rate(local_tar, workers, args.repeats, index)
        rows.append((f"WebDataset shards, local disk, {workers} workers", local, local))
        rows.append((f"the same shards in S3 (ranged reads), {workers} workers",
                     epoch_rate(s3_tar, workers, args.repeats, index), local))
        rows.append((f"the same shards streamed from S3 (`pipe:curl`), {workers} workers",
                     epoch_rate(piped, workers, args.repeats, index, train_num_samples=args.num_images), local))
        if workers == 2:
            rows.append(("Parquet (the same samples), local disk, 2 workers",
                         epoch_rate(local_pq, workers, args.repeats, index), local))
            rows.append(("Parquet in S3, 2 workers", epoch_rate(s3_pq, workers, args.repeats, index), local))
    server.terminate()
    server.wait()
    print(f"{args.num_images} samples, shards of {args.shard_size}; one epoch each (build + read), best of "
          f"{args.repeats}\n")
    print("| data | samples/s | ÷ local shards (same workers) |\n| --- | --- | --- |")
    for name, rate, base in rows:
        print(f"| {name} | {rate:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
