"""Benchmark: one training epoch read from object storage against the same data on local disk.

Default (`--latency`): the latency table. The built-in dataset is exported as WebDataset shards (with `sizes.json`)
and uploaded to an S3 API on localhost (moto's server, in its own process), reached through a proxy (the tests'
`FaultProxy`) that adds a fixed delay to every request and counts requests and bytes. For each delay and each number
of ranks (each rank its own process, `build_loader(rank=, world_size=)`, as torchrun's ranks call it, no process
group), one epoch of the train split is read; reported per (delay, ranks): samples/s against the same shards on local
disk (at the same ranks), object GETs per sample, bytes fetched ÷ the shards' bytes, client CPU per sample (every
process of the reader: ranks and their workers), and time to the first batch (slowest rank, from `build_loader`).
WebDataset's streaming of the same shards (`pipe:curl` through the proxy, shards split over ranks, then workers) is
measured side by side, against its own local-disk rate, and so is MosaicML Streaming: the same samples written as MDS
shards of the same number of samples (`streaming.MDSWriter`, every member's bytes as they are in the tar, no
compression), uploaded beside them and read by `StreamingDataset(remote="s3://...", local=<a fresh cache>)` (boto3,
its endpoint from `S3_ENDPOINT_URL`: the proxy), shuffled (its default algorithm, seed 0), decoded and resized as the
WebDataset rows are; its ranks are the processes of one node (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
a gloo process group, which it needs to agree on its shared memory), sharing one cache as torchrun's ranks would;
`--readers ... mosaicml-fresh-clients` reads it with each DataLoader worker dropping the S3 client it inherits from
its rank (forked workers share that client's open connection, and collide on it).
Each reader's bytes are divided by its own shards' bytes. Each run starts with an empty index cache (startup included);
`--indexed` runs `naflexclip data index` on the bucket first. `--reader-option NAME=VALUE` passes a `DataConfig`
setting to the naflexclip reader (for readers still to come: `--reader-option fetch_chunk_mib=16`).

    python benchmarks/remote_data.py --num-images 800 --shard-size 100 --workers 2 --ranks 1 2 4 --delays-ms 0 50 200

MosaicML Streaming (`mosaicml-streaming`, imported as `streaming`) pins `transformers<5`, so it lives in an environment
of its own, holding only it and its small compression packages; the benchmark runs its jobs there
(`--streaming-python`), handing that interpreter this one's packages (torch, boto3, Pillow) through `PYTHONPATH`.
Without it (and without `streaming` here) its rows are skipped, in one line:

    python3 -m venv .venv-streaming   # the same Python version as this environment's
    .venv-streaming/bin/pip install --no-deps mosaicml-streaming brotli python-snappy cramjam zstd catalogue
    python benchmarks/remote_data.py ... --streaming-python .venv-streaming/bin/python

`--formats`: the older table: indexed shards on local disk and in the bucket at 0, 2 and 4 workers, WebDataset's
streaming, and Parquet (local and in the bucket), the best of `--repeats` (no delay added):

    python benchmarks/remote_data.py --formats --num-images 400 --shard-size 50 --repeats 2

A localhost server shares the CPUs with the reader; the delay stands for a store's latency, not its bandwidth.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import tarfile
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


def formats_table(args: argparse.Namespace) -> None:
    """The `--formats` table (see the module's docstring)."""
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
    piped = curl_spec(endpoint, local_tar)
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


def curl_spec(endpoint: str, local_spec: str, prefix: str = "bench/wds") -> str:
    """The shards as WebDataset streams them from a private bucket: a signed GET per shard (`pipe:curl`)."""
    return (f"pipe:curl -s --fail --aws-sigv4 aws:amz:us-east-1:s3 --user bench:bench "
            f"{endpoint}/{prefix}/{os.path.basename(local_spec)} || test $? -eq 23")


def reader_options(pairs: list[str]) -> dict[str, object]:
    """`NAME=VALUE` pairs as DataConfig settings (values read as Python literals where they are one)."""
    options: dict[str, object] = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        try:
            options[name.replace("-", "_")] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[name.replace("-", "_")] = text
    return options


def run_rank(job: dict) -> None:
    """One rank's epoch (a process of its own); prints {"samples", "first_batch_s", "wall_s", "import_cpu_s"} as
    JSON (`import_cpu_s`: the CPU spent before the reader starts, left out of the reader's)."""
    logging.getLogger("naflexclip.data").setLevel(logging.ERROR)
    if job["reader"].startswith("mosaicml") and job["world_size"] > 1:  # as torchrun's ranks have it, before the clock
        import torch.distributed

        torch.distributed.init_process_group("gloo", rank=job["rank"], world_size=job["world_size"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    first = None
    samples = 0
    if job["reader"].startswith("mosaicml"):  # MosaicML Streaming: MDS shards, a node's ranks share one cache
        import torch
        from streaming import StreamingDataset

        dataset = StreamingDataset(remote=job["remote"], local=job["spec"], shuffle=True, shuffle_seed=0,
                                   batch_size=1)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=job["workers"],
                                             collate_fn=decode_mds_sample,
                                             worker_init_fn=fresh_s3_clients if "fresh" in job["reader"] else None)
        for _ in loader:
            first = first if first is not None else time.perf_counter() - start
            samples += 1
    elif job["reader"] == "naflexclip":
        cfg = DataConfig(train_data=job["spec"], naflex_seq_lens=(64,), naflex_max_tokens_per_batch=2048,
                         workers=job["workers"], seed=0, shard_index_dir=job["index_dir"], **job["options"])
        loader = build_loader(cfg, split="train", patch_size=16, context_length=32, rank=job["rank"],
                              world_size=job["world_size"])
        for batch in loader:
            first = first if first is not None else time.perf_counter() - start
            samples += len(batch["keys"])
    else:  # WebDataset streaming: shards split over ranks (here by hand), then over workers; images decoded
        import torch
        import webdataset as wds

        from naflexclip.data.shards import expand_shards

        urls = expand_shards(job["spec"])[job["rank"]::job["world_size"]]
        dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, empty_check=False).decode("pil")
        dataset = dataset.to_tuple("jpg;png", "txt").map(lambda s: (s[0].convert("RGB").resize((128, 128)), s[1]))
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=job["workers"],
                                             collate_fn=lambda s: s)
        for _ in loader:
            first = first if first is not None else time.perf_counter() - start
            samples += 1
    print(json.dumps({"samples": samples, "first_batch_s": first, "wall_s": time.perf_counter() - start,
                      "import_cpu_s": usage.ru_utime + usage.ru_stime}))


def decode_mds_sample(sample: dict) -> tuple:
    """An MDS sample as the WebDataset rows decode theirs: the image in RGB at 128×128, the caption."""
    from PIL import Image

    image = Image.open(io.BytesIO(sample["jpg"] or sample["png"])).convert("RGB").resize((128, 128))
    return image, sample["txt"].decode()


def fresh_s3_clients(worker_id: int) -> None:
    """A DataLoader worker of MosaicML Streaming drops the S3 client its rank made (fetching `index.json`) before
    forking it, as Streaming's own pickling does for spawned workers: forked, they would share its open connection."""
    import torch

    for stream in torch.utils.data.get_worker_info().dataset.streams:
        stream._downloader.clean_up()


def write_mds(job: dict) -> None:
    """The tar shards `job["tars"]` as MDS shards in `job["out"]`, one MDS shard per tar (the same samples): each
    sample's members (grouped by key as WebDataset does) as raw bytes, no compression. Runs where `streaming` is."""
    from streaming import MDSWriter

    columns = {"__key__": "str", "jpg": "bytes", "png": "bytes", "txt": "bytes", "json": "bytes"}
    with MDSWriter(out=job["out"], columns=columns, size_limit=None, compression=None) as writer:
        for tar in job["tars"]:
            sample: dict = {}
            with tarfile.open(tar) as members:
                for member in members:
                    key, _, ext = member.name.partition(".")
                    if sample and sample["__key__"] != key:
                        writer.write(sample)
                        sample = {}
                    sample = sample or {"__key__": key, **{name: b"" for name in columns if name != "__key__"}}
                    sample[ext] = members.extractfile(member).read()
            if sample:
                writer.write(sample)
            writer.flush_shard()  # the tar's samples as one shard; then a new one begins, as `write` does it
            writer._reset_cache()


def streaming_python(requested: str | None, env: dict[str, str]) -> str | None:
    """The interpreter that has MosaicML Streaming: `--streaming-python` (run with `env`), else this one where
    `streaming` is here; None (after one line saying so) where neither is."""
    if requested:
        if subprocess.run([requested, "-c", "import streaming"], env=env, capture_output=True).returncode == 0:
            return requested
        print(f"MosaicML Streaming: `import streaming` fails under --streaming-python {requested}; its rows are "
              "skipped", file=sys.stderr)
        return None
    if importlib.util.find_spec("streaming") is not None:
        return sys.executable
    print("MosaicML Streaming: not installed here and no --streaming-python given (see this benchmark's docstring); "
          "its rows are skipped", file=sys.stderr)
    return None


def run_epoch(reader: str, spec: str, ranks: int, workers: int, index_dir: str, options: dict,
              env: dict[str, str], python: str = sys.executable, remote: str | None = None) -> dict[str, float]:
    """One epoch over `ranks` processes at once: samples, wall time (slowest rank), time to the first batch (slowest
    rank), CPU seconds of every process (ranks and their workers, collected when they end; the ranks' imports left
    out). `python`: the interpreter of the ranks; `remote`: MosaicML Streaming's bucket (`spec` its local cache)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = []
    if reader.startswith("mosaicml"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(sock.getsockname()[1])}
    for rank in range(ranks):
        job = dict(reader=reader, spec=spec, rank=rank, world_size=ranks, workers=workers, index_dir=index_dir,
                   options=options, remote=remote)
        if reader.startswith("mosaicml"):  # its ranks: the processes of one node
            env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                   "LOCAL_WORLD_SIZE": str(ranks)}
        procs.append(subprocess.Popen([python, __file__, "--rank-job", json.dumps(job)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a rank of {reader} {spec} failed ({proc.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) - sum(
        r["import_cpu_s"] for r in results)
    return {"samples": sum(r["samples"] for r in results), "wall_s": max(r["wall_s"] for r in results),
            "first_batch_s": max(r["first_batch_s"] or 0.0 for r in results), "cpu_s": cpu}


def latency_table(args: argparse.Namespace) -> None:
    """The latency table (see the module's docstring)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from s3_server import FaultProxy

    from naflexclip.data.shard_index import index_shards

    root = tempfile.mkdtemp(prefix="remote-bench-")
    paths = export_synthetic(os.path.join(root, "wds"), count=args.num_images, shard_size=args.shard_size)
    tars = [p for p in paths if p.endswith(".tar")]
    local = shard_spec(paths)
    data_bytes = dict.fromkeys(("naflexclip", "webdataset"), sum(os.path.getsize(p) for p in tars))
    server, endpoint = start_s3()
    upload(os.path.join(root, "wds"), "bench/wds")
    s3 = f"s3://bench/wds/{os.path.basename(local)}"
    options = reader_options(args.reader_option)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    if args.indexed:
        index_shards([f"s3://bench/wds/{os.path.basename(p)}" for p in tars])
    readers = [r for r in args.readers if not r.startswith("mosaicml")]
    wanted = [r for r in args.readers if r.startswith("mosaicml")]
    mds_python = streaming_python(args.streaming_python, env) if wanted else None
    mds = os.path.join(root, "mds")
    if mds_python:
        subprocess.run([mds_python, __file__, "--mds-job", json.dumps({"tars": tars, "out": mds})], env=env,
                       check=True)
        upload(mds, "bench/mds")
        mds_bytes = sum(os.path.getsize(os.path.join(mds, n)) for n in os.listdir(mds) if n.endswith(".mds"))
        data_bytes.update(dict.fromkeys(wanted, mds_bytes))
        readers += wanted
    runs = 0

    def fresh_index() -> str:
        nonlocal runs
        runs += 1
        return os.path.join(root, "index", str(runs))

    def epoch(reader: str, ranks: int, proxy: FaultProxy | None = None) -> dict[str, float]:
        """`reader`'s epoch from local disk, or through `proxy` from the bucket."""
        if reader.startswith("mosaicml"):  # `spec`: the local cache (a fresh one) or, on local disk, the MDS shards
            remote = "s3://bench/mds" if proxy else None
            extra = {"AWS_ENDPOINT_URL": proxy.url, "S3_ENDPOINT_URL": proxy.url} if proxy else {}
            return run_epoch(reader, fresh_index() if proxy else mds, ranks, args.workers, fresh_index(), options,
                             {**env, **extra}, python=mds_python, remote=remote)
        spec = local if proxy is None else s3 if reader == "naflexclip" else curl_spec(proxy.url, local)
        extra = {"AWS_ENDPOINT_URL": proxy.url} if proxy else {}
        return run_epoch(reader, spec, ranks, args.workers, fresh_index(), options, {**env, **extra})

    rows = []
    for ranks in args.ranks:
        base = {reader: epoch(reader, ranks) for reader in readers}
        for delay in args.delays_ms:
            for reader in readers:
                with FaultProxy(endpoint, delay_s=delay / 1000) as proxy:
                    found = epoch(reader, ranks, proxy)
                    gets = sum(n for (method, _), n in proxy.counts.items() if method == "GET")
                    heads = sum(n for (method, _), n in proxy.counts.items() if method == "HEAD")
                    sent = proxy.bytes_sent
                rate, local_rate = found["samples"] / found["wall_s"], base[reader]["samples"] / base[reader]["wall_s"]
                rows.append((reader, delay, ranks, rate, rate / local_rate, gets / found["samples"], heads,
                             sent / data_bytes[reader], 1000 * found["cpu_s"] / found["samples"],
                             1000 * base[reader]["cpu_s"] / base[reader]["samples"], found["first_batch_s"],
                             found["samples"]))
                print("  " + " ".join(str(round(v, 3)) if isinstance(v, float) else str(v) for v in rows[-1]),
                      file=sys.stderr, flush=True)
    server.terminate()
    server.wait()
    sizes = f", MDS shards of the same samples {mds_bytes / 2**20:.1f} MiB" if mds_python else ""
    print(f"{args.num_images} samples in shards of {args.shard_size} ({data_bytes['webdataset'] / 2**20:.1f} MiB"
          f"{sizes}), {args.workers} workers per rank, one epoch each, a fresh index cache"
          + (", indexes beside the shards (`naflexclip data index`)" if args.indexed else "")
          + (f", reader options {options}" if options else "") + "\n")
    print("| reader | delay per request | ranks | samples/s | ÷ local disk | GETs per sample | HEADs | bytes fetched ÷ "
          "data | client CPU per sample (local) | first batch |\n" + "| --- " * 10 + "|")
    for reader, delay, ranks, rate, ratio, gets, heads, fetched, cpu, cpu_local, first, _ in rows:
        print(f"| {reader} | {delay} ms | {ranks} | {rate:.1f} | {ratio:.2f} | {gets:.3f} | {heads} | {fetched:.2f} "
              f"| {cpu:.1f} ms ({cpu_local:.1f} ms) | {first:.2f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=800)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--formats", action="store_true", help="the older table of formats and workers")
    parser.add_argument("--repeats", type=int, default=1, help="--formats: best of this many")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--delays-ms", type=int, nargs="+", default=[0, 50, 200])
    parser.add_argument("--indexed", action="store_true", help="write the indexes beside the shards first")
    parser.add_argument("--reader-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a DataConfig setting for the naflexclip reader (repeatable)")
    parser.add_argument("--readers", nargs="+",
                        choices=("naflexclip", "webdataset", "mosaicml", "mosaicml-fresh-clients"),
                        default=["naflexclip", "webdataset", "mosaicml"],
                        help="the readers of the latency table (mosaicml-fresh-clients: each DataLoader worker drops "
                        "the S3 client it inherits from its rank)")
    parser.add_argument("--streaming-python", metavar="PATH",
                        help="an interpreter with MosaicML Streaming, to run its jobs (see the docstring)")
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)
    parser.add_argument("--mds-job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        run_rank(json.loads(args.rank_job))
        return
    if args.mds_job:
        write_mds(json.loads(args.mds_job))
        return
    logging.getLogger("naflexclip.data").setLevel(logging.ERROR)
    if args.formats:
        formats_table(args)
    else:
        latency_table(args)


if __name__ == "__main__":
    main()
