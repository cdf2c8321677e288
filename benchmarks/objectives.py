"""The training objectives against the plain window on the same data: seconds and peak memory per image.

Every objective runs the same towers from the same initialisation (`--model`, its own loss, bf16 autocast,
`cache`) on the same images (`--num-examples` in microbatches of `--microbatch-tokens` image tokens, made on the
device by `measure.GeneratedWindow`), once untimed, then `--repeats` timed (median) with the peak memory of the
first over the state before it (CUDA max allocated, .grad buffers included). An objective is present when
`naflexclip train` accepts its flag; one that is absent, or present without an adapter here yet, is skipped with
one line saying which. Multi-positive windows hold the same images with 2 captions each. Distillation's teacher
is `--teacher` (default: an untrained copy of `--model`, so the teacher costs what the student's forward costs).

    python benchmarks/objectives.py --out OUT                                # GPU: siglip2-base, 2,048 pairs
    python benchmarks/objectives.py --model tiny --num-examples 128 --seq-len 16 --microbatch-tokens 512 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from measure import GeneratedWindow, Results, add_window_arguments, mib, time_and_peak, window_precision

from naflexclip import accumulate_gradients, create_loss, create_model
from naflexclip.cli import build_parser
from naflexclip.models.naflex_clip import NaFlexClip
from naflexclip.window import TeacherFeatures

# an objective's window: (model, loss, the rest of accumulate_gradients' keywords), on the device
Built = tuple[NaFlexClip, Callable, dict[str, Any]]


def _plain(args: argparse.Namespace, device: torch.device) -> Built:
    model = create_model(args.model).to(device)
    return model, create_loss(model.config.loss), {}


def _locked_image(args: argparse.Namespace, device: torch.device) -> Built:
    model = create_model(args.model)
    model.lock_image_tower()  # LiT: `--lock-image`
    return model.to(device), create_loss(model.config.loss), {}


def _distilled(args: argparse.Namespace, device: torch.device) -> Built:
    """`--distill-model TEACHER`: the frozen teacher runs once per microbatch without gradient; the loss is the
    contrastive one plus the distillation term (`naflexclip.objectives.distillation`)."""
    from naflexclip.objectives.distillation import Distill, load_teacher

    model = create_model(args.model).to(device)
    teacher, _ = load_teacher(args.teacher or args.model, None)
    loss_fn = Distill(args.teacher or args.model).loss(model.config.loss, 1024)
    return model, loss_fn, {"terms": [TeacherFeatures(teacher.to(device))]}


def _multi_positive(args: argparse.Namespace, device: torch.device) -> Built:
    """`--multi-positive`: every caption a text row with its image's group id; the loss is the multi-positive
    InfoNCE (clip) or SigLIP+ (siglip), symmetric weighting."""
    from naflexclip.loss import MultiPositiveLoss

    model = create_model(args.model).to(device)
    return model, MultiPositiveLoss(model.config.loss, "symmetric"), {}


@dataclass(frozen=True)
class Objective:
    name: str
    flag: str | None  # the `naflexclip train` flag that turns it on: present iff train accepts it
    build: Callable[[argparse.Namespace, torch.device], Built] | None  # None: no adapter here yet
    captions: int = 1  # captions per image in its window (the same images)


OBJECTIVES = (
    Objective("plain window", None, _plain),
    Objective("LiT (--lock-image)", "--lock-image", _locked_image),
    Objective("distillation (--distill-model)", "--distill-model", _distilled),
    Objective("multi-positive (--multi-positive, 2 captions per image)", "--multi-positive", _multi_positive,
              captions=2),
    Objective("SigLIP 2 recipe (--recipe siglip2)", "--recipe", None),
)


def train_flags() -> set[str]:
    """Every option string `naflexclip train` accepts with a meaning (not one of OpenCLIP's it only names to
    refuse, or takes as built in)."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    train = subparsers.choices["train"]
    try:
        from naflexclip.train.config.openclip_flags import status
    except ImportError:  # a version without OpenCLIP's flag table: every flag it has, it accepts
        return set(train._option_string_actions)
    return {flag for flag in train._option_string_actions if status(flag, train) == "accepted"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_window_arguments(parser, model="siglip2-base", seq_len=256)
    parser.add_argument("--teacher", default=None, help="the distillation teacher (default: --model, untrained)")
    parser.add_argument("--num-examples", type=int, default=2048, help="images in the window")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device, precision, autocast = window_precision(args)
    results = Results(args.out, "objectives")
    flags = train_flags()
    rows = max(1, args.microbatch_tokens // args.seq_len)
    results.line(f"\n### objectives: {args.model}, {args.num_examples} pairs in microbatches of {rows}, "
                 f"{args.seq_len} patches per image, cache, {precision}, {device}, median of {args.repeats}")
    results.line("| objective | s / window | × plain | ms per image | peak MiB | × plain |\n"
                 "| --- | --- | --- | --- | --- | --- |")
    plain = None
    for objective in OBJECTIVES:
        if objective.flag is not None and objective.flag not in flags:
            results.skip(objective.name, f"not in this version (`naflexclip train` does not accept {objective.flag})")
            continue
        if objective.build is None:
            results.skip(objective.name, f"present ({objective.flag}) but benchmarks/objectives.py has no adapter "
                                         "for it yet")
            continue
        left = deadline - time.monotonic()
        if plain is not None and plain["seconds"] * (1 + args.repeats) > left:
            results.skip(objective.name, f"projected {plain['seconds'] * (1 + args.repeats):.0f} s (as the plain "
                                         f"window) > {left:.0f} s left of --budget-s")
            continue
        torch.manual_seed(0)
        model, loss_fn, keywords = objective.build(args, device)
        model.train()
        window = GeneratedWindow(args.num_examples, rows, args.seq_len, model, device, captions=objective.captions)

        def step(model: NaFlexClip = model, loss_fn: Callable = loss_fn, window: GeneratedWindow = window,
                 keywords: dict = keywords) -> None:
            model.zero_grad(set_to_none=False)
            accumulate_gradients(model, loss_fn, window, autocast=autocast, **keywords)

        seconds, peak = time_and_peak(step, device, args.repeats)
        record = dict(kind="objective", objective=objective.name, model=args.model, pairs=args.num_examples,
                      seq_len=args.seq_len, rows=rows, precision=precision, device=str(device), seconds=seconds,
                      seconds_per_pair=seconds / args.num_examples, peak_bytes=peak)
        plain = plain or record
        time_ratio = seconds / plain["seconds"]
        memory_ratio = peak / plain["peak_bytes"] if peak is not None and plain["peak_bytes"] else None
        results.record(f"| {objective.name} | {seconds:.3f} | {time_ratio:.2f} | "
                       f"{seconds / args.num_examples * 1e3:.4f} | {mib(peak)} | "
                       f"{'n/a' if memory_ratio is None else f'{memory_ratio:.2f}'} |",
                       **record, time_ratio=time_ratio, memory_ratio=memory_ratio)
        del model, loss_fn, keywords, window, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
