"""The window loss at scale: dense vs tiled memory and time, a 65k-pair window, and per-rank FLOPs.

Three parts, each printing ratios side by side:

1. `loss`: the loss alone (forward + backward) over `N` random `[N, D]` float32 features, the dense formula
   (`clip_loss_dense`/`siglip_loss_dense`, the `N×N` logits) against the tiled default (`ClipLoss`/`SigLipLoss`),
   CLIP and SigLIP. Each variant runs in a fresh process; memory is its peak RSS growth during the step. Dense
   runs only where its projected memory (its measured growth at a smaller N, × N²) fits `--dense-max-gib`;
   elsewhere it is reported as not fitting.
2. `window`: a whole window through the public API (`accumulate_gradients(model, create_loss(loss), ...)`,
   `tiny` preset, float32) of `--window-examples` pairs: peak RSS growth, seconds, and `WindowStats.loss`
   against an independent float64 reference (row- and column-chunked `torch.logsumexp` over the same features).
3. `flops`: the FLOPs one rank spends on a window of `--flops-examples` pairs with R = 1, 2, 4 real gloo
   processes (`torch.utils.flop_counter`), with the default (sharded) loss and with the loss computed whole on
   every rank (a plain function, which the window cannot split), as a fraction of one process's FLOPs.

    python benchmarks/window_loss.py                                  # all three, CPU defaults
    python benchmarks/window_loss.py --parts loss --sizes 4096 8192 --dense-max-gib 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
from typing import Any

import torch

GIB = 1024**3


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _features(n: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1)
    return [image.requires_grad_(), text.requires_grad_()]


def _loss_step(kind: str, variant: str, n: int, dim: int, tile: int, threads: int) -> dict[str, float]:
    """One forward + backward of the loss in this (fresh) process: peak RSS growth and seconds."""
    from naflexclip.loss import ClipLoss, SigLipLoss, clip_loss_dense, siglip_loss_dense

    torch.set_num_threads(threads)
    image, text = _features(n, dim)
    scale = torch.tensor(14.0, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True) if kind == "siglip" else None
    if variant == "dense":
        loss_fn = siglip_loss_dense if kind == "siglip" else clip_loss_dense
    else:
        loss_fn = (SigLipLoss if kind == "siglip" else ClipLoss)(tile)
    before = _peak_rss()
    start = time.perf_counter()
    loss = loss_fn(image, text, scale, bias)
    loss.backward()
    seconds = time.perf_counter() - start
    return {"growth": _peak_rss() - before, "seconds": seconds, "loss": float(loss.detach())}


def _reference_loss(kind: str, image: torch.Tensor, text: torch.Tensor, scale: float, bias: float | None,
                    chunk: int = 512) -> float:
    """An independent float64 L: chunks of whole logit rows and columns through `torch.logsumexp`."""
    image, text, n = image.double(), text.double(), image.shape[0]
    shift = 0.0 if bias is None else bias
    diagonal = scale * (image * text).sum(1) + shift
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, n, chunk):
        rows = scale * image[start : start + chunk] @ text.T + shift  # [chunk, N]
        if kind == "siglip":
            total += torch.nn.functional.softplus(rows, threshold=1e9).sum()
        else:
            columns = scale * text[start : start + chunk] @ image.T + shift  # text→image rows
            total += rows.logsumexp(1).sum() + columns.logsumexp(1).sum()
    if kind == "siglip":
        return float((total - diagonal.sum()) / n)
    return float((total - 2 * diagonal.sum()) / (2 * n))


def _window_step(kind: str, n: int, microbatch: int, threads: int) -> dict[str, float]:
    """A whole window through the public API in this (fresh) process."""
    from naflexclip import accumulate_gradients, create_loss, create_model
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import split_batch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    siglip = kind == "siglip"
    model = create_model("tiny", loss=kind)
    batch = random_naflex_batch(n, patch_size=model.image_patch_size, context_length=model.context_length,
                                seq_lens=(16,), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    microbatches = split_batch(batch, [len(part) for part in torch.arange(n).split(microbatch)])
    del batch
    before = _peak_rss()
    start = time.perf_counter()
    stats = accumulate_gradients(model, create_loss(kind), microbatches)
    seconds = time.perf_counter() - start
    growth = _peak_rss() - before
    # the same features again (the tiny preset has no dropout), for the float64 reference
    with torch.no_grad():
        outs = [model(image=mb["image"], text=mb["text"]) for mb in microbatches]
    image = torch.cat([out["image_features"] for out in outs])
    text = torch.cat([out["text_features"] for out in outs])
    bias = float(outs[0]["logit_bias"].detach()) if siglip else None
    reference = _reference_loss(kind, image, text, float(outs[0]["logit_scale"]), bias)
    return {"growth": growth, "seconds": seconds, "loss": stats.loss, "reference": reference}


def _run_fresh(target: Any, *args: Any) -> dict[str, float]:
    """Run `target(*args)` in a new process (a clean peak RSS) and return its result."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(target, args)


# ------------------------------------------------------------------------------------------------ flops


class _Whole:
    """The loss as a plain callable: the window cannot split it, so every rank computes all of L(W)."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.loss(*args)


def _flops_worker(rank: int, world: int, port: int, n: int, kind: str, sharded: bool, queue: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch.utils.flop_counter import FlopCounterMode

    from naflexclip import accumulate_gradients, create_loss, create_model
    from naflexclip.audit.random_windows import random_naflex_batch
    from naflexclip.batch import split_batch
    from naflexclip.parallel.feature_exchange import window_exchange
    from naflexclip.parallel.process_group import cleanup, init_distributed
    from naflexclip.parallel.wrapping import no_sync_context, wrap_model

    env = init_distributed(device="cpu", timeout_s=600)
    torch.manual_seed(0)
    model = wrap_model(create_model("tiny", loss=kind), env)
    module = model.module if hasattr(model, "module") else model
    rows = [len(part) for part in torch.arange(n).tensor_split(world)]
    batch = random_naflex_batch(rows[rank], patch_size=module.image_patch_size, context_length=module.context_length,
                                seq_lens=(16,), generator=torch.Generator().manual_seed(rank), dtype=torch.float32)
    microbatches = split_batch(batch, [len(part) for part in torch.arange(rows[rank]).tensor_split(2)])
    loss = create_loss(kind) if sharded else _Whole(create_loss(kind))
    with FlopCounterMode(display=False) as counter:
        accumulate_gradients(model, loss, microbatches, exchange=window_exchange(env, model),
                             no_sync=no_sync_context(model))
    if rank == 0:
        queue.put(counter.get_total_flops())
    cleanup(env)


def _rank_flops(world: int, n: int, kind: str, sharded: bool) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_flops_worker, args=(rank, world, port, n, kind, sharded, queue))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    flops = queue.get()
    for proc in procs:
        proc.join()
    return int(flops)


# ------------------------------------------------------------------------------------------------- main


def part_loss(args: argparse.Namespace) -> None:
    print(f"\n## loss alone, forward + backward (D={args.dim}, float32, {args.threads} thread(s), tile {args.tile})")
    print(f"{'loss':6} {'N':>6} | {'dense GiB':>9} {'dense s':>8} | {'tiled GiB':>9} {'tiled s':>8} | "
          f"{'memory ×':>9} {'time ×':>7} | {'|Δloss|/loss':>12}")
    for kind in ("clip", "siglip"):
        dense_seen: tuple[int, float] | None = None  # (N, growth) of the largest dense run
        for n in args.sizes:
            tiled = _run_fresh(_loss_step, kind, "tiled", n, args.dim, args.tile, args.threads)
            projected = (dense_seen[1] * (n / dense_seen[0]) ** 2 if dense_seen else 5 * n * n * 4) / GIB
            if projected <= args.dense_max_gib:
                dense = _run_fresh(_loss_step, kind, "dense", n, args.dim, args.tile, args.threads)
                dense_seen = (n, dense["growth"])
                print(f"{kind:6} {n:>6} | {dense['growth'] / GIB:9.3f} {dense['seconds']:8.2f} | "
                      f"{tiled['growth'] / GIB:9.3f} {tiled['seconds']:8.2f} | "
                      f"{tiled['growth'] / max(dense['growth'], 1):9.4f} {tiled['seconds'] / dense['seconds']:7.2f} | "
                      f"{abs(tiled['loss'] - dense['loss']) / abs(dense['loss']):12.1e}")
            else:
                print(f"{kind:6} {n:>6} | {'does not fit: ~' + format(projected, '.0f') + ' GiB':>18} | "
                      f"{tiled['growth'] / GIB:9.3f} {tiled['seconds']:8.2f} |")


def part_window(args: argparse.Namespace) -> None:
    n, b = args.window_examples, args.window_microbatch
    print(f"\n## a whole window through accumulate_gradients(model, create_loss(loss), ...): tiny preset, "
          f"N={n} in microbatches of {b}, float32, {args.threads} thread(s)")
    print(f"{'loss':6} | {'peak growth GiB':>15} {'seconds':>8} | {'WindowStats.loss':>16} {'float64 ref':>12} "
          f"{'rel. error':>10}")
    for kind in ("clip", "siglip"):
        result = _run_fresh(_window_step, kind, n, b, args.threads)
        error = abs(result["loss"] - result["reference"]) / abs(result["reference"])
        print(f"{kind:6} | {result['growth'] / GIB:15.3f} {result['seconds']:8.1f} | {result['loss']:16.8f} "
              f"{result['reference']:12.8f} {error:10.1e}")


def part_flops(args: argparse.Namespace) -> None:
    n = args.flops_examples
    print(f"\n## FLOPs of rank 0 per window (tiny preset, N={n} split evenly over R ranks, 2 microbatches each), "
          "as a fraction of one process's")
    print(f"{'loss':6} {'R':>2} | {'sharded GFLOP':>13} {'× R=1':>6} | {'whole-loss GFLOP':>16} {'× R=1':>6}")
    for kind in ("clip", "siglip"):
        single = _rank_flops(1, n, kind, True)
        print(f"{kind:6} {1:>2} | {single / 1e9:13.2f} {1.0:6.3f} | {single / 1e9:16.2f} {1.0:6.3f}")
        for world in args.world_sizes:
            sharded, whole = _rank_flops(world, n, kind, True), _rank_flops(world, n, kind, False)
            print(f"{kind:6} {world:>2} | {sharded / 1e9:13.2f} {sharded / single:6.3f} | "
                  f"{whole / 1e9:16.2f} {whole / single:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["loss", "window", "flops"], choices=["loss", "window", "flops"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--dim", type=int, default=16, help="feature dimension (the tiny preset's embed_dim)")
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--dense-max-gib", type=float, default=6.0, help="run dense only where it should fit")
    parser.add_argument("--window-examples", type=int, default=65536)
    parser.add_argument("--window-microbatch", type=int, default=4096)
    parser.add_argument("--flops-examples", type=int, default=12288)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # rows appear as they are measured
    for part in args.parts:
        {"loss": part_loss, "window": part_window, "flops": part_flops}[part](args)


if __name__ == "__main__":
    main()
