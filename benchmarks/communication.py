"""Communication volume per accumulation window: naflexclip's exact window against OpenCLIP's scheme.

Both schemes run for real on gloo (CPU) with R processes, on the same NaFlex window of R ranks × n
microbatches of `--microbatch-size` pairs, with the model wrapped in DDP. Every collective is counted
by wrapping the `torch.distributed` functions the code calls, and DDP's gradient all-reduce through a
comm hook; bytes are those each rank *sends* for the tensors actually passed, under the usual algorithms
(ring all-reduce: 2(R-1)/R of the tensor; all-gather: (R-1) × own chunk; scatter: the chunks for others).

- ours (`cache` method): sizes (two tiny all-gathers) + one no-grad all-gather of the window's text
  features (the sharded loss needs only a rank's own images) and of `N` column statistics (CLIP) + one
  reduce-scatter of the text-feature gradients and one all-reduce of three numbers (`loss`: the loss split
  over ranks) + one gradient all-reduce per window (DDP `no_sync` for every microbatch but the last).
- naive (OpenCLIP `_train_step_eager` with `--accum-freq n --gather-with-grad`): per microbatch replay,
  all-gather the rank's window features *with* gradient (the backward sends the gradients back: all-to-all,
  done with scatters on gloo) and a DDP gradient all-reduce after every microbatch.

Usage: `python benchmarks/communication.py [--world-sizes 2 4] [--accum 2 4 8] [--models tiny small]`.
Prints MB sent per rank per window and the naive/ours ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class CommCounter:
    """Bytes this rank sends and collectives it joins, by category (`sizes`, `features`, `gradients`)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.category = "other"
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, num_bytes: float) -> None:
        self.sent[self.category] = self.sent.get(self.category, 0.0) + num_bytes
        self.calls[self.category] = self.calls.get(self.category, 0) + 1

    def reset(self) -> None:
        self.sent, self.calls = {}, {}

    @contextlib.contextmanager
    def counting_as(self, category: str) -> Iterator[None]:
        previous, self.category = self.category, category
        try:
            yield
        finally:
            self.category = previous


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def install_counters(counter: CommCounter) -> None:
    """Wrap the Python-level collectives (the feature exchange and torch.distributed.nn use them)."""
    world = counter.world_size
    names = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "scatter")
    original = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.add((world - 1) * _nbytes(tensor))
        return original["all_gather"](tensor_list, tensor, *args, **kwargs)

    def gather_into(name: str) -> Any:
        def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.add((world - 1) * _nbytes(tensor))
            return original[name](out, tensor, *args, **kwargs)

        return all_gather_into

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.add(2 * (world - 1) / world * _nbytes(tensor))
        return original["all_reduce"](tensor, *args, **kwargs)

    def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, *args: Any,
                **kwargs: Any) -> Any:
        if scatter_list:  # this rank is the source: it sends every chunk but its own
            counter.add(sum(_nbytes(t) for t in scatter_list) * (world - 1) / world)
        return original["scatter"](tensor, scatter_list, *args, **kwargs)

    dist.all_gather = all_gather
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if name in original:
            setattr(dist, name, gather_into(name))
    dist.all_reduce, dist.scatter = all_reduce, scatter


def counting_comm_hook(model: torch.nn.parallel.DistributedDataParallel, counter: CommCounter) -> None:
    """DDP all-reduces gradient buckets from C++: label them `gradients` through a comm hook."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations it finds
        # the default hook calls dist.all_reduce on the bucket, which the wrapper counts
        with counter.counting_as("gradients"):
            return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)


def naive_window(model: Any, loss_fn: Any, microbatches: list[dict[str, Any]], counter: CommCounter) -> None:
    """OpenCLIP's accumulation: cache features, then per microbatch replay with gathered-with-grad
    features and a (DDP-synchronised) backward."""
    from torch.distributed.nn.functional import all_gather

    with torch.no_grad():
        cached = [model(image=mb["image"], text=mb["text"]) for mb in microbatches]
    for j, mb in enumerate(microbatches):
        out = model(image=mb["image"], text=mb["text"])
        local = {
            key: torch.cat([out[key] if i == j else cached[i][key] for i in range(len(microbatches))])
            for key in ("image_features", "text_features")
        }
        with counter.counting_as("features"):
            features = {key: torch.cat(all_gather(value)) for key, value in local.items()}
        loss = loss_fn(features["image_features"], features["text_features"], out["logit_scale"],
                       out.get("logit_bias"))
        # the backward scatters the gathered features' gradients back to their ranks (`features`) and
        # DDP all-reduces the parameter gradients, every microbatch (OpenCLIP uses no no_sync)
        with counter.counting_as("features"):
            loss.backward()


class CountingExchange:
    """Our exchange, with its collectives labelled `sizes`, `features` and `loss`."""

    def __init__(self, inner: Any, counter: CommCounter) -> None:
        self.inner, self.counter = inner, counter
        self.rank, self.world_size = inner.rank, inner.world_size

    def gather_sizes(self, local_sizes: Any) -> list[list[int]]:
        with self.counter.counting_as("sizes"):
            return self.inner.gather_sizes(local_sizes)

    def gather_rows(self, local_rows: torch.Tensor, rows_per_rank: Any) -> torch.Tensor:
        with self.counter.counting_as("features"):
            return self.inner.gather_rows(local_rows, rows_per_rank)

    def reduce_scatter_rows(self, rows: torch.Tensor, rows_per_rank: Any) -> torch.Tensor:
        # the exchange calls the collective through a reference bound at import, which install_counters does
        # not wrap: count it here (ring reduce-scatter sends (R-1)/R of the padded [R·max_rows, D] input)
        world = self.world_size
        padded_bytes = world * max(rows_per_rank) * rows[0].numel() * rows.element_size()
        with self.counter.counting_as("loss"):
            self.counter.add((world - 1) / world * padded_bytes)
            return self.inner.reduce_scatter_rows(rows, rows_per_rank)

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        with self.counter.counting_as("loss"):
            return self.inner.sum_over_ranks(values)


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out_file: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import split_batch
    from naflexclip.families.factory import create_model
    from naflexclip.loss import create_loss
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.process_group import cleanup, init_distributed
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model
    from naflexclip.window import accumulate_gradients

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    env = init_distributed(device="cpu", timeout_s=300)
    counter = CommCounter(world_size)
    install_counters(counter)
    rows = []
    for model_name in args.models:
        torch.manual_seed(0)
        model = create_model(model_name)
        num_params = sum(p.numel() for p in model.parameters())
        model = wrap_model(model, env)
        counting_comm_hook(model, counter)
        loss_fn = create_loss("clip")
        exchange = CountingExchange(window_exchange(env, model), counter)
        for accum in args.accum:
            b = args.microbatch_size
            batch = random_naflex_batch(
                accum * b, patch_size=model.module.image_patch_size, context_length=model.module.context_length,
                seq_lens=(16, 36, 64), generator=torch.Generator().manual_seed(rank), dtype=torch.float32,
            )
            microbatches = split_batch(batch, [b] * accum)
            result = {"model": model_name, "params": num_params, "R": world_size, "n": accum, "b": b}
            for scheme in ("ours", "naive"):
                seconds = []
                for _ in range(args.repeats + 1):  # the first window warms up (DDP bucket rebuild)
                    model.zero_grad(set_to_none=True)
                    counter.reset()
                    dist.barrier()
                    start = time.perf_counter()
                    if scheme == "ours":
                        accumulate_gradients(model, loss_fn, microbatches, exchange=exchange,
                                             no_sync=no_sync_context(model))
                    else:
                        naive_window(model, loss_fn, microbatches, counter)
                    seconds.append(time.perf_counter() - start)
                result[scheme] = {"sent": dict(counter.sent), "calls": dict(counter.calls),
                                  "seconds": min(seconds[1:]) if len(seconds) > 1 else seconds[0]}
            rows.append(result)
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    cleanup(env)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _part(stats: dict[str, Any], key: str) -> str:
    """`MB/calls` of one category."""
    return f"{stats['sent'].get(key, 0) / 1e6:.3f}/{stats['calls'].get(key, 0)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--accum", type=int, nargs="+", default=[2, 4, 8], help="microbatches per rank (n)")
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="timed windows per case after one warm-up")
    args = parser.parse_args()
    print(f"{'model':6} {'params':>8} {'R':>2} {'n':>2} {'b':>2} | {'ours MB':>9} "
          f"{'sizes, features, loss, grads (MB/calls)':>40} | {'naive MB':>9} {'features, grads':>24} | "
          f"{'ratio':>6} | {'ours s':>7} {'naive s':>7}")
    for world_size in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out_file = str(Path(tmp) / "rows.json")
            mp.spawn(worker, args=(world_size, _free_port(), args, out_file), nprocs=world_size, join=True)
            rows = json.loads(Path(out_file).read_text())
        for row in rows:
            ours, naive = row["ours"], row["naive"]
            ours_total, naive_total = sum(ours["sent"].values()), sum(naive["sent"].values())
            for name, stats in (("ours", ours), ("naive", naive)):
                if "other" in stats["sent"]:  # every collective should be labelled
                    print(f"warning: {name} sent {stats['sent']['other'] / 1e6:.3f} MB in unlabelled collectives")
            ours_parts = " ".join(_part(ours, key) for key in ("sizes", "features", "loss", "gradients"))
            naive_parts = " ".join(_part(naive, key) for key in ("features", "gradients"))
            print(f"{row['model']:6} {row['params'] / 1e6:7.2f}M {row['R']:>2} {row['n']:>2} {row['b']:>2} | "
                  f"{ours_total / 1e6:9.3f} {ours_parts:>40} | {naive_total / 1e6:9.3f} {naive_parts:>24} | "
                  f"{naive_total / ours_total:6.2f} | {ours['seconds']:7.3f} {naive['seconds']:7.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
