"""One whole window of 262,144 pairs through `accumulate_gradients` against a window of 16,384: peak memory and
seconds per pair.

Both windows run the same towers (`siglip2-base` by default, its own loss, bf16 autocast, `cache`) on microbatches
of the same size (`--microbatch-tokens` image tokens of `--seq-len` patches each), made on the device as the
window reads them (`measure.GeneratedWindow`: a window of 262,144 images never exists whole). The small window
runs first, once untimed (kernels, .grad buffers) and once measured; the large one runs once, measured (a second
run would double the step's cost). Per window: seconds, seconds per pair, peak memory over the state before it
(CUDA max allocated; model, .grad buffers and whatever the window keeps: its cached features and their gradients)
and `WindowStats.loss`; then large ÷ small per pair. A window whose time, projected from the small one per pair,
does not fit `--budget-s` is skipped with one line, and the largest of N/2, N/4, ... that fits is measured instead.

    python benchmarks/big_window.py --out OUT                                  # GPU: 262,144 vs 16,384 pairs
    python benchmarks/big_window.py --model tiny --sizes 1024 128 --seq-len 16 --microbatch-tokens 1024 --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch
from measure import GeneratedWindow, Results, add_window_arguments, mib, time_and_peak, window_precision

from naflexclip import accumulate_gradients, create_loss, create_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_window_arguments(parser, model="siglip2-base", seq_len=64)
    parser.add_argument("--sizes", type=int, nargs=2, default=[262144, 16384], metavar=("LARGE", "SMALL"),
                        help="pairs in the large and the small window")
    parser.add_argument("--method", default="cache", choices=("cache", "replay"))
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device, precision, autocast = window_precision(args)
    results = Results(args.out, "window")
    torch.manual_seed(0)
    model = create_model(args.model).to(device).train()
    loss_fn = create_loss(model.config.loss)
    rows = max(1, args.microbatch_tokens // args.seq_len)
    large, small = args.sizes
    results.line(f"\n### a whole window through accumulate_gradients: {args.model} ({model.config.loss}), "
                 f"{args.seq_len} patches per image, {rows} pairs per microbatch, {args.method}, {precision}, "
                 f"{device}")
    results.line("| pairs | microbatches | s | ms per pair | peak MiB | WindowStats.loss |\n"
                 "| --- | --- | --- | --- | --- | --- |")
    measured: dict[int, dict] = {}
    for num, warmup in ((small, True), (large, False)):
        if small in measured:
            # the largest of N, N/2, N/4, ... whose time, per pair as the small window's, fits what is left
            per_pair, left = measured[small]["seconds"] / small, deadline - time.monotonic()
            fits = next((size for size in (num // 2**k for k in range(12)) if size > small and per_pair * size <= left),
                        None)
            if fits != num:
                results.skip(f"the {num}-pair window", f"projected {per_pair * num:.0f} s (per pair as the "
                                                       f"{small}-pair window) > {left:.0f} s left of --budget-s"
                                                       + (f"; measuring {fits} pairs instead" if fits else ""))
                if fits is None:
                    break
                num = large = fits
        window = GeneratedWindow(num, rows, args.seq_len, model, device)
        stats: list = []

        def step(window: GeneratedWindow = window, stats: list = stats) -> None:
            model.zero_grad(set_to_none=False)
            stats.append(accumulate_gradients(model, loss_fn, window, method=args.method, autocast=autocast))

        try:
            seconds, peak = time_and_peak(step, device, repeats=1, warmup=warmup)
        except torch.OutOfMemoryError:
            results.record(f"| {num} | {len(window)} | out of memory | | | |", kind="window", model=args.model,
                           pairs=num, status="oom")
            break
        measured[num] = dict(seconds=seconds, peak_bytes=peak)
        results.record(f"| {num} | {len(window)} | {seconds:.2f} | {seconds / num * 1e3:.4f} | {mib(peak)} | "
                       f"{stats[-1].loss:.4f} |", kind="window", model=args.model, loss=model.config.loss,
                       pairs=num, microbatches=len(window), rows=rows, seq_len=args.seq_len, method=args.method,
                       precision=precision, device=str(device), seconds=seconds, seconds_per_pair=seconds / num,
                       peak_bytes=peak, window_loss=stats[-1].loss, status="ok")
    if large in measured and small in measured:
        per_pair = (measured[large]["seconds"] / large) / (measured[small]["seconds"] / small)
        peak_l, peak_s = measured[large]["peak_bytes"], measured[small]["peak_bytes"]
        memory = f", peak memory {peak_l / peak_s:.2f}× ({mib(peak_l - peak_s)} MiB more)" if peak_s else ""
        results.record(f"{large} ÷ {small} pairs: time per pair {per_pair:.2f}×{memory}", kind="window_ratio",
                       time_per_pair_ratio=per_pair, memory_ratio=peak_l / peak_s if peak_s else None)


if __name__ == "__main__":
    main()
