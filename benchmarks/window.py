"""Window benchmark: full-batch step vs the `cache` and `replay` windows over the same N examples.

For each configuration it runs, side by side on one model and one batch: one full-batch
forward/backward of N examples (the baseline), and the `cache` and `replay` windows over the same N
split into n = 2, 4, 8 microbatches. Times come from one process in which the variants alternate round
by round (median per variant). Peak memory: on CUDA in that same process (max allocated over model,
.grad buffers and batch, reset per variant); on CPU from a fresh process per variant (peak RSS growth over
the state before the step, .grad buffers included), since a process's peak RSS cannot be reset.
It prints seconds per window, peak memory, and the ratios against the full batch and cache/replay, each
row as soon as it is measured (a timeout keeps the rows already printed).

    python benchmarks/window.py                       # both default configurations
    python benchmarks/window.py --model small --num-examples 128 --splits 2 4 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from collections.abc import Callable

import torch
from measure import in_subprocess

from naflexclip import accumulate_gradients, create_loss, create_model
from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.batch import split_batch, to_device
from naflexclip.models.precision import create_precision


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _setup(config: dict) -> tuple[Callable[[str, int], None], torch.device]:
    """Model, batch and a `step(method, n)` closure over them."""
    torch.manual_seed(0)
    torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    model = create_model(config["model"]).to(device).train()
    loss_fn = create_loss("clip")
    batch = random_naflex_batch(
        config["num_examples"], patch_size=model.image_patch_size, context_length=model.context_length,
        seq_lens=tuple(config["seq_lens"]), generator=torch.Generator().manual_seed(0), dtype=torch.float32,
    )
    full = to_device(batch, device)
    autocast = create_precision(config["precision"], device).autocast
    splits: dict[int, list[dict]] = {}
    for n in config["splits"]:
        sizes = [len(part) for part in torch.arange(config["num_examples"]).tensor_split(n)]
        splits[n] = [to_device(mb, device) for mb in split_batch(batch, sizes)]

    def step(method: str, n: int) -> None:
        model.zero_grad(set_to_none=False)
        if method == "full":
            with autocast():
                out = model(image=full["image"], text=full["text"])
            features = {k: v.float() for k, v in out.items()}  # the loss runs in fp32, as in the window
            loss_fn(features["image_features"], features["text_features"], features["logit_scale"]).backward()
        else:
            accumulate_gradients(model, loss_fn, splits[n], method=method, autocast=autocast)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step, device


def _variants(config: dict) -> list[tuple[str, int]]:
    return [("full", 1)] + [(method, n) for n in config["splits"] for method in ("cache", "replay")]


def _time_all(config: dict, queue: mp.Queue) -> None:
    """Median seconds per window of every variant; the variants alternate within each round, so a
    change in machine load hits them all alike. On CUDA also the peak memory of each (else None)."""
    step, device = _setup(config)
    variants = _variants(config)
    memory: dict[tuple[str, int], int] = {}
    for variant in variants:
        step(*variant)  # warm-up (allocates the .grad buffers, kept by zero_grad(set_to_none=False))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(*variant)
            memory[variant] = torch.cuda.max_memory_allocated() - base
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for _ in range(config["repeats"]):
        for variant in variants:
            start = time.perf_counter()
            step(*variant)
            times[variant].append(time.perf_counter() - start)
    queue.put(({v: statistics.median(t) for v, t in times.items()}, memory or None))


def _peak_memory(config: dict, variant: tuple[str, int], queue: mp.Queue) -> None:
    """Peak memory of one step over the state before it (model, batch); .grad buffers included."""
    step, device = _setup(config)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(*variant)
        queue.put(torch.cuda.max_memory_allocated() - base)
    else:
        base = _peak_rss_bytes()
        step(*variant)
        queue.put(_peak_rss_bytes() - base)


def run_configuration(args: argparse.Namespace, model: str, num_examples: int, seq_lens: list[int]) -> None:
    """Print the configuration's table, row by row as each is measured."""
    config = dict(model=model, num_examples=num_examples, seq_lens=seq_lens, device=args.device,
                  repeats=args.repeats, threads=args.threads, splits=args.splits, precision=args.precision)
    print(f"\n### {model}, N = {num_examples}, seq lens {seq_lens}, {args.device}, {args.precision}, "
          f"median of {args.repeats}", flush=True)
    seconds, memory = in_subprocess(_time_all, config)
    print("| step | s / window | × full batch | peak memory (MiB) | × full batch | cache ÷ replay time |\n"
          "| --- | --- | --- | --- | --- | --- |", flush=True)
    full_time, full_mem = seconds[("full", 1)], None
    for method, n in _variants(config):
        # CPU: a fresh process per variant (peak RSS cannot be reset)
        mem = memory[(method, n)] if memory else in_subprocess(_peak_memory, config, (method, n))
        full_mem = full_mem or mem
        t = seconds[(method, n)]
        label = f"full batch N={num_examples}" if method == "full" else f"{method} n={n}"
        versus = f"{seconds[('cache', n)] / seconds[('replay', n)]:.2f}" if method == "cache" else ""
        print(f"| {label} | {t:.3f} | {t / full_time:.2f} | {mem / 2**20:.0f} | {mem / max(full_mem, 1):.2f} | "
              f"{versus} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="one preset (default: small and tiny configurations)")
    parser.add_argument("--num-examples", type=int, default=None)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None)
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "amp_bf16", "amp"),
                        help="as `naflexclip train --precision` (autocast of the tower forwards)")
    args = parser.parse_args()
    if args.model:
        configurations = [(args.model, args.num_examples or 128, args.seq_lens or [16, 36, 64])]
    else:
        # towers dominate (small preset) / the N×N loss dominates (tiny towers, large N)
        configurations = [("small", 96, [16, 36, 64]), ("tiny", 2048, [4, 9])]
    for model, num_examples, seq_lens in configurations:
        run_configuration(args, model, num_examples, seq_lens)


if __name__ == "__main__":
    main()
