"""LiT window benchmark: a window with the image tower locked (`--lock-image`) against the unlocked window.

Both variants take the same N examples split into the same n microbatches, on one model initialisation, in
train mode, through `accumulate_gradients` (the `cache` method by default). The locked window forwards the image
tower once per microbatch without gradient (a feature source); the unlocked one forwards it, replays it and
backpropagates through it. Printed per variant: seconds per window (median), peak memory of one window over the
state before it (.grad buffers included; CPU: peak RSS growth, CUDA: max allocated) and image-tower forwards per
window (a forward hook); then the locked ÷ unlocked ratios. Each variant runs in a fresh process (a process's
peak RSS cannot be reset).

    python benchmarks/locked.py                                   # base, N=4 in n=2, CPU-sized
    python benchmarks/locked.py --model base --num-examples 256 --splits 4 --seq-lens 256 --device cuda
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time
from collections.abc import Callable

import torch

from naflexclip import accumulate_gradients, create_loss, create_model
from naflexclip.batch import split_batch, to_device
from naflexclip.train.precision import create_precision
from naflexclip.verify import random_naflex_batch

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


def _measure(config: dict, variant: str, queue: mp.Queue) -> None:
    """In a fresh process: peak memory of one window over the state before it (CPU: the first window's RSS
    growth, its .grad buffers included; CUDA: max allocated in the second), image forwards, median seconds."""
    step, device = _setup(config, variant)
    if device.type == "cuda":
        step()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forwards = step()
        memory = torch.cuda.max_memory_allocated() - base
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        forwards = step()
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times = []
    for _ in range(config["repeats"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    queue.put((statistics.median(times), memory, forwards))


def _in_subprocess(target: Callable[..., None], *args: object) -> object:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base")
    parser.add_argument("--num-examples", type=int, default=4)
    parser.add_argument("--splits", type=int, default=2, help="microbatches per window")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[64], help="patch budgets of the images")
    parser.add_argument("--method", default="cache", choices=("cache", "replay"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "amp_bf16", "amp"))
    args = parser.parse_args()
    config = vars(args)
    print(f"### {args.model}, N = {args.num_examples} in n = {args.splits}, seq lens {args.seq_lens}, {args.method}, "
          f"{args.device}, {args.precision}, median of {args.repeats}", flush=True)
    seconds, memory, forwards = {}, {}, {}
    for variant in VARIANTS:
        seconds[variant], memory[variant], forwards[variant] = _in_subprocess(_measure, config, variant)
    print("| window | s / window | peak memory (MiB) | image-tower forwards |\n| --- | --- | --- | --- |")
    for variant in VARIANTS:
        label = "--lock-image" if variant == "locked" else "unlocked"
        print(f"| {label} | {seconds[variant]:.3f} | {memory[variant] / 2**20:.0f} | {forwards[variant]} |")
    print(f"locked ÷ unlocked: time {seconds['locked'] / seconds['unlocked']:.2f}, peak memory "
          f"{memory['locked'] / max(memory['unlocked'], 1):.2f}, image-tower forwards "
          f"{forwards['locked']}/{forwards['unlocked']}")


if __name__ == "__main__":
    main()
