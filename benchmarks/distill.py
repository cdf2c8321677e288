"""Distillation against the plain window and the plain loss: what the teacher costs.

1. `window`: a distillation window (`DistillLoss`, the teacher `--teacher`, by default an untrained copy of
   `--model`, so it costs what the student's forward costs) against the plain window on the same generated data
   (`measure.GeneratedWindow`), same initialisation, `cache`: seconds per window (median, the variants alternating
   round by round in one process), peak memory of one window over the state before it (CPU: peak RSS growth in a
   fresh process per variant; CUDA: max allocated) and the teacher's forwards per window (a forward hook), which
   must equal the window's microbatches (the teacher runs once per microbatch, never replayed).
2. `loss`: the distillation loss alone at `--loss-sizes` pairs against the plain tiled loss, forward + backward over
   random float32 features in a fresh process each (`objective_losses.py`'s step): peak RSS growth of each and
   distill ÷ plain, beside the size of one `N×N` float32 matrix (which neither builds).

    python benchmarks/distill.py                                          # CPU: tiny, 256 pairs; N = 16,384
    python benchmarks/distill.py --parts loss --loss-sizes 16384 65536 --loss-kinds clip siglip
    python benchmarks/distill.py --parts window --model siglip2-base --num-examples 2048 --seq-len 256 --out OUT
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from collections.abc import Callable

import torch
from measure import (
    GeneratedWindow,
    Results,
    add_window_arguments,
    alternating_medians,
    in_subprocess,
    mib,
    window_memory,
    window_precision,
)
from objective_losses import _step as loss_step
from window_loss import GIB, _run_fresh

from naflexclip import accumulate_gradients, create_loss, create_model
from naflexclip.objectives.distillation import Distill, load_teacher
from naflexclip.window import TeacherFeatures

VARIANTS = ("plain", "distill")


def _setup(args: argparse.Namespace, variant: str) -> tuple[Callable[[], tuple[int, int]], torch.device]:
    """The student (same weights in both variants), its window and a `step()` returning (teacher forwards,
    microbatches) of one window."""
    device, _, autocast = window_precision(args)
    torch.manual_seed(0)
    model = create_model(args.model).to(device).train()
    window = GeneratedWindow(args.num_examples, max(1, args.microbatch_tokens // args.seq_len), args.seq_len, model,
                             device)
    loss_fn, keywords, calls = create_loss(model.config.loss), {}, []
    if variant == "distill":
        teacher, _ = load_teacher(args.teacher or args.model, None)
        teacher.register_forward_hook(lambda *_: calls.append(1))
        loss_fn, keywords = Distill(args.teacher or args.model).loss(model.config.loss, 1024), {
            "terms": [TeacherFeatures(teacher.to(device))]}

    def step() -> tuple[int, int]:
        calls.clear()
        model.zero_grad(set_to_none=False)
        accumulate_gradients(model, loss_fn, window, autocast=autocast, **keywords)
        return len(calls), len(window)

    return step, device


def _time_all(args: argparse.Namespace, queue: mp.Queue) -> None:
    steps = {variant: _setup(args, variant)[0] for variant in VARIANTS}
    queue.put(alternating_medians(steps, args.repeats, torch.device(args.device)))


def _peak_memory(args: argparse.Namespace, variant: str, queue: mp.Queue) -> None:
    queue.put(window_memory(*_setup(args, variant)))


def window_part(args: argparse.Namespace, results: Results) -> None:
    _, precision, _ = window_precision(args)
    rows = max(1, args.microbatch_tokens // args.seq_len)
    results.line(f"\n### distillation window: {args.model} (teacher {args.teacher or args.model}, untrained), "
                 f"{args.num_examples} pairs in microbatches of {rows}, {args.seq_len} patches, cache, {precision}, "
                 f"{args.device}, median of {args.repeats}")
    seconds, counts = in_subprocess(_time_all, args)
    memory = {variant: in_subprocess(_peak_memory, args, variant) for variant in VARIANTS}
    results.line("| window | s / window | peak MiB | teacher forwards / microbatches |\n| --- | --- | --- | --- |")
    for variant in VARIANTS:
        forwards, microbatches = counts[variant]
        results.record(f"| {variant} | {seconds[variant]:.3f} | {mib(memory[variant])} | {forwards} / {microbatches} |",
                       kind="distill_window", variant=variant, model=args.model, pairs=args.num_examples,
                       seconds=seconds[variant], peak_bytes=memory[variant], teacher_forwards=forwards,
                       microbatches=microbatches)
    forwards, microbatches = counts["distill"]
    results.record(f"distill ÷ plain: time {seconds['distill'] / seconds['plain']:.2f}×, peak memory "
                   f"{memory['distill'] / max(memory['plain'], 1):.2f}×; teacher forwards {forwards} for "
                   f"{microbatches} microbatches ({'equal' if forwards == microbatches else 'NOT EQUAL'})",
                   kind="distill_window_ratio", time_ratio=seconds["distill"] / seconds["plain"],
                   memory_ratio=memory["distill"] / max(memory["plain"], 1), teacher_forwards=forwards,
                   microbatches=microbatches)


def loss_part(args: argparse.Namespace, results: Results) -> None:
    results.line(f"\n### distillation loss alone: D={args.dim}, float32, {args.threads} thread(s), tile {args.tile}, "
                 "forward + backward, peak RSS growth in a fresh process each")
    results.line("| loss | N | plain GiB | plain s | distill GiB | distill s | memory × | time × | one N×N GiB |\n"
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in args.loss_sizes:
        for kind in args.loss_kinds:
            plain, ours = (_run_fresh(loss_step, kind, variant, n, args.dim, args.tile, args.threads, 1)
                           for variant in VARIANTS)
            ratio = ours["growth"] / max(plain["growth"], 1)
            results.record(f"| {kind} | {n} | {plain['growth'] / GIB:.3f} | {plain['seconds']:.1f} | "
                           f"{ours['growth'] / GIB:.3f} | {ours['seconds']:.1f} | {ratio:.2f} | "
                           f"{ours['seconds'] / plain['seconds']:.2f} | {n * n * 4 / GIB:.1f} |",
                           kind="distill_loss", loss=kind, pairs=n, plain_growth=plain["growth"],
                           distill_growth=ours["growth"], memory_ratio=ratio, plain_seconds=plain["seconds"],
                           distill_seconds=ours["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_window_arguments(parser, model="tiny", seq_len=16)
    parser.set_defaults(microbatch_tokens=1024)
    parser.add_argument("--parts", nargs="+", default=["window", "loss"], choices=("window", "loss"))
    parser.add_argument("--teacher", default=None, help="the teacher (default: --model, untrained)")
    parser.add_argument("--num-examples", type=int, default=256, help="pairs in the window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loss-sizes", type=int, nargs="+", default=[16384])
    parser.add_argument("--loss-kinds", nargs="+", default=["clip", "siglip"], choices=("clip", "siglip"))
    parser.add_argument("--dim", type=int, default=16, help="feature dimension of the loss part")
    parser.add_argument("--tile", type=int, default=1024)
    args = parser.parse_args()
    results = Results(args.out, "distill")
    if "window" in args.parts:
        window_part(args, results)
    if "loss" in args.parts:
        loss_part(args, results)


if __name__ == "__main__":
    main()
