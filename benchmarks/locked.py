"""LiT window benchmark: a window with the image tower locked (`--lock-image`) against the unlocked window.

Both variants take the same N examples split into the same n microbatches, on one model initialisation, in
train mode, through `accumulate_gradients` (the `cache` method by default). The locked window forwards the image
tower once per microbatch without gradient (a feature source); the unlocked one forwards it, replays it and
backpropagates through it. Printed per variant: seconds per window (median; the variants alternate round by
round in one process), peak memory of one window over the state before it (.grad buffers included; CPU: peak RSS
growth in a fresh process per variant, since a process's peak RSS cannot be reset; CUDA: max allocated) and
image-tower forwards per window (a forward hook); then the locked ÷ unlocked ratios.

    python benchmarks/locked.py                                   # base, N=8 in n=2, 144 patches: CPU-sized
    python benchmarks/locked.py --model base --num-examples 256 --splits 4 --seq-lens 256 --device cuda
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from collections.abc import Callable

import torch
from measure import alternating_medians, in_subprocess, window_memory

from naflexclip import accumulate_gradients, create_loss, create_model
from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.batch import split_batch, to_device
from naflexclip.models.precision import create_precision

VARIANTS = ("unlocked", "locked")


def _setup(config: dict, variant: str) -> tuple[Callable[[], int], torch.device]:
    """The model (locked or not, same weights), the microbatches and a `step()` returning image forwards."""
    torch.manual_seed(0)
    torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    model = create_model(config["model"])
    if variant == "locked":
        model.lock_image_tower()
    model = model.to(device).train()
    loss_fn = create_loss("clip")
    n, num = config["splits"], config["num_examples"]
    batch = random_naflex_batch(num, patch_size=model.image_patch_size, context_length=model.context_length,
                                seq_lens=tuple(config["seq_lens"]), generator=torch.Generator().manual_seed(0),
                                dtype=torch.float32)
    sizes = [len(part) for part in torch.arange(num).tensor_split(n)]
    microbatches = [to_device(mb, device) for mb in split_batch(batch, sizes)]
    autocast = create_precision(config["precision"], device).autocast
    calls: list[int] = []
    model.visual.register_forward_hook(lambda *_: calls.append(1))

    def step() -> int:
        calls.clear()
        model.zero_grad(set_to_none=False)
        accumulate_gradients(model, loss_fn, microbatches, method=config["method"], autocast=autocast)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return len(calls)

    return step, device


def _time_all(config: dict, queue: mp.Queue) -> None:
    """Median seconds per window of both variants, alternating round by round in one process, and the image-tower
    forwards of each."""
    steps = {variant: _setup(config, variant)[0] for variant in VARIANTS}
    queue.put(alternating_medians(steps, config["repeats"], torch.device(config["device"])))


def _peak_memory(config: dict, variant: str, queue: mp.Queue) -> None:
    """Peak memory of one window over the state before it, in a fresh process (`measure.window_memory`)."""
    step, device = _setup(config, variant)
    queue.put(window_memory(step, device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base")
    parser.add_argument("--num-examples", type=int, default=8)
    parser.add_argument("--splits", type=int, default=2, help="microbatches per window")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[144], help="patch budgets of the images")
    parser.add_argument("--method", default="cache", choices=("cache", "replay"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "amp_bf16", "amp"))
    args = parser.parse_args()
    config = vars(args)
    print(f"### {args.model}, N = {args.num_examples} in n = {args.splits}, seq lens {args.seq_lens}, {args.method}, "
          f"{args.device}, {args.precision}, median of {args.repeats}", flush=True)
    seconds, forwards = in_subprocess(_time_all, config)
    memory = {variant: in_subprocess(_peak_memory, config, variant) for variant in VARIANTS}
    print("| window | s / window | peak memory (MiB) | image-tower forwards |\n| --- | --- | --- | --- |")
    for variant in VARIANTS:
        label = "--lock-image" if variant == "locked" else "unlocked"
        print(f"| {label} | {seconds[variant]:.3f} | {memory[variant] / 2**20:.0f} | {forwards[variant]} |")
    print(f"locked ÷ unlocked: time {seconds['locked'] / seconds['unlocked']:.2f}, peak memory "
          f"{memory['locked'] / max(memory['unlocked'], 1):.2f}, image-tower forwards "
          f"{forwards['locked']}/{forwards['unlocked']}")


if __name__ == "__main__":
    main()
