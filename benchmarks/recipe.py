"""SigLIP 2's recipe window against the sigmoid-only window on the same data: time and peak memory, part by part.

Every row is one window through `accumulate_gradients` on the same microbatches (one initialisation of the towers,
train mode, `--method`), built as tests/test_window_self_distill.py builds it, and adds one part of the recipe
(`--recipe siglip2`'s values) to the row above:

    sigmoid only     the pair loss (SigLIP's sigmoid loss)
    + LocCa decoder  the decoder's term: random decoder examples of every task, half parallel, at its full length
    + EMA teacher    the teacher's forward once per microbatch without gradient, its features kept for the window,
                     and its EMA update after the window (the view seeds are not given: no student term yet)
    + local crops    the self-distillation term: `--local-crops` crops per image forwarded, backpropagated
                     (the model's student terms cut to their crops half, `crops_only`)
    + masked pass    the masked-prediction term: each image again with half its patches masked — the whole recipe
                     after `--self-distill-start`

Printed per row: seconds per window (median; the rows alternate round by round in one process, so a change in the
machine's load hits all alike), ms per pair, peak memory of one window over the state before it (.grad buffers
included; CPU: peak RSS growth in a fresh process per row, since a process's peak RSS cannot be reset; CUDA: max
allocated), the teacher's forwards per window; the ratios to the sigmoid-only window; and each part's own cost,
the difference to the row above.

    python benchmarks/recipe.py                    # base, 8 pairs in 2 microbatches of 64 patches each: CPU-sized
    python benchmarks/recipe.py --num-examples 256 --splits 4 --seq-len 256 --device cuda --precision amp_bf16
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
from collections.abc import Callable
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F
from measure import alternating_medians, in_subprocess

from naflexclip import accumulate_gradients, create_loss
from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.batch import EXAMPLE_INPUTS, split_batch, to_device
from naflexclip.models.naflex_clip import NaFlexClip, model_config
from naflexclip.models.precision import create_precision
from naflexclip.objectives import self_distillation
from naflexclip.objectives.locca_decoder import LOCCA, LoccaTerm, random_decoder_inputs
from naflexclip.objectives.self_distillation import (
    MASKED_PREDICTION,
    SELF_DISTILL,
    STUDENT_TEMPERATURE,
    SelfDistillTerm,
    _tower,
    _upcast,
    local_crops,
    teacher_distribution,
)
from naflexclip.objectives.siglip2_recipe import RECIPES, Recipe
from naflexclip.processing.view_seeds import VIEW_SEED

ROWS = ("sigmoid only", "+ LocCa decoder", "+ EMA teacher", "+ local crops", "+ masked pass")
PARTS = {"+ LocCa decoder": "decoder", "+ EMA teacher": "EMA teacher", "+ local crops": "local crops",
         "+ masked pass": "masked pass"}


def crops_only(visual: torch.nn.Module, heads: torch.nn.Module, image: dict[str, torch.Tensor],
               view_seed: torch.Tensor, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`naflexclip.objectives.self_distillation.student_terms` without its masked pass: each example's
    self-distillation term alone
    (the same values, tested), so the crops' cost can be measured apart from the masked pass's."""
    count = heads.config.local_crops
    batch = image["patches"].shape[0]
    pooled, _ = _tower(visual, local_crops(image, view_seed, count))
    log_p = F.log_softmax(_upcast(heads.global_head(pooled)) / STUDENT_TEMPERATURE, dim=-1)
    owner = torch.arange(batch, device=log_p.device).repeat_interleave(count)
    crop_ce = -(teacher_distribution(targets, "global")[owner].to(log_p.dtype) * log_p).sum(-1)
    return {SELF_DISTILL: crop_ce.reshape(batch, count).sum(1)}


def _setup(config: dict, row: str) -> tuple[Callable[[], int], torch.device]:
    """The row's model (the same towers every row), the window's microbatches and a `step()` returning the
    teacher's forwards."""
    level = ROWS.index(row)
    torch.manual_seed(0)
    torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    model = NaFlexClip(model_config(config["model"], loss="siglip"))
    recipe = Recipe(recipe="siglip2", local_crops=config["local_crops"])
    if level >= 1:
        recipe.prepare(model, self_distill=level >= 2)
    model = model.to(device).train()
    num = config["num_examples"]
    gen = torch.Generator().manual_seed(0)
    batch = random_naflex_batch(num, patch_size=model.image_patch_size, context_length=model.context_length,
                                seq_lens=(config["seq_len"],), generator=gen, dtype=torch.float32)
    if level >= 1:
        batch[EXAMPLE_INPUTS] = random_decoder_inputs(num, model.decoder.vocab, model.decoder.config.max_length, gen)
    if level >= 3:
        batch[EXAMPLE_INPUTS][VIEW_SEED] = torch.randint(0, 2**31 - 1, (num,), generator=gen)
    sizes = [len(part) for part in torch.arange(num).tensor_split(config["splits"])]
    microbatches = [to_device(mb, device) for mb in split_batch(batch, sizes)]
    weights = recipe.term_weights(progress=1.0)
    teacher = recipe.ema_teacher(model) if level >= 2 else None
    terms: list = [LoccaTerm(weights[LOCCA])] if level >= 1 else []
    if teacher is not None:  # "+ EMA teacher": its forwards alone (a term without parts); then each part
        parts = {2: (), 3: (SELF_DISTILL,), 4: (SELF_DISTILL, MASKED_PREDICTION)}[level]
        terms.append(SelfDistillTerm(teacher, {name: weights[name] for name in parts}))
    calls: list[int] = []
    if teacher is not None:
        teacher.register_forward_hook(lambda *_: calls.append(1))
    autocast = create_precision(config["precision"], device).autocast
    loss_fn = create_loss("siglip")
    cut = mock.patch.object(self_distillation, "student_terms", crops_only) if level == 3 else nullcontext()

    def step() -> int:
        calls.clear()
        model.zero_grad(set_to_none=False)
        with cut:
            accumulate_gradients(model, loss_fn, microbatches, method=config["method"], autocast=autocast,
                                 terms=terms)
        if teacher is not None:
            teacher.update(model)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return len(calls)

    return step, device


def _time_all(config: dict, queue: mp.Queue) -> None:
    """Median seconds per window of every row, alternating round by round in one process, and the teacher's
    forwards of each."""
    steps = {row: _setup(config, row)[0] for row in ROWS}
    queue.put(alternating_medians(steps, config["repeats"], torch.device(config["device"])))


def _peak_memory(config: dict, row: str, queue: mp.Queue) -> None:
    """Peak memory of one window over the state before it, in a fresh process (CPU: the first window's RSS growth,
    its .grad buffers included; CUDA: max allocated in the second window, on top of them)."""
    step, device = _setup(config, row)
    if device.type == "cuda":
        step()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        queue.put(torch.cuda.max_memory_allocated() - base)
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        step()
        queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base")
    parser.add_argument("--num-examples", type=int, default=8, help="pairs in the window")
    parser.add_argument("--splits", type=int, default=2, help="microbatches per window")
    parser.add_argument("--seq-len", type=int, default=64, help="patches per image (a full grid)")
    parser.add_argument("--local-crops", type=int, default=RECIPES["siglip2"]["local_crops"],
                        help="student crops per image (default: the recipe's)")
    parser.add_argument("--method", default="cache", choices=("cache", "replay"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "amp_bf16", "amp"))
    args = parser.parse_args(argv)
    for flag in ("num_examples", "splits", "seq_len", "local_crops", "repeats", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.splits > args.num_examples:
        parser.error(f"--splits {args.splits} is more microbatches than --num-examples {args.num_examples}")
    config = vars(args)
    print(f"### SigLIP 2 recipe window: {args.model}, N = {args.num_examples} pairs in n = {args.splits} "
          f"microbatches, {args.seq_len} patches per image, {args.local_crops} local crops, {args.method}, "
          f"{args.device}, {args.precision}, median of {args.repeats}", flush=True)
    seconds, forwards = in_subprocess(_time_all, config)
    memory = {row: in_subprocess(_peak_memory, config, row) for row in ROWS}
    base_s, base_m = seconds[ROWS[0]], max(memory[ROWS[0]], 1)
    print("| window | s / window | × sigmoid | ms / pair | peak MiB | × sigmoid | teacher forwards |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for row in ROWS:
        print(f"| {row} | {seconds[row]:.3f} | {seconds[row] / base_s:.2f} | "
              f"{seconds[row] / args.num_examples * 1e3:.1f} | {memory[row] / 2**20:.0f} | "
              f"{memory[row] / base_m:.2f} | {forwards[row]} |")
    print("\n| part | + s / window | × sigmoid | + peak MiB | × sigmoid |\n| --- | --- | --- | --- | --- |")
    for above, row in zip(ROWS, ROWS[1:], strict=False):
        extra_s, extra_m = seconds[row] - seconds[above], memory[row] - memory[above]
        print(f"| {PARTS[row]} | {extra_s:+.3f} | {extra_s / base_s:+.2f} | {extra_m / 2**20:+.0f} | "
              f"{extra_m / base_m:+.2f} |")
    whole = ROWS[-1]
    print(f"recipe ÷ sigmoid only: time {seconds[whole] / base_s:.2f}, peak memory {memory[whole] / base_m:.2f}; "
          f"teacher forwards per window {forwards[whole]} (= {args.splits} microbatches)", flush=True)


if __name__ == "__main__":
    main()
