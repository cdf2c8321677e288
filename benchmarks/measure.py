"""What the benchmark scripts share: running one measurement in a fresh process (so peak memory is its own),
timing a step with its peak memory, writing figures as they are measured, and the arguments of a benchmark that
runs windows of generated microbatches."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def in_subprocess(target: Callable[..., None], *args: object) -> object:
    """Run `target(*args, queue)` in a spawned process and return what it put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def window_memory(step: Callable[[], object], device: torch.device) -> int:
    """Peak memory of one window over the state before it, for a fresh process (CPU: the first window's peak RSS
    growth, its .grad buffers included, since a process's peak RSS cannot be reset; CUDA: max allocated during
    the second window, over the first's .grad buffers)."""
    if device.type == "cuda":
        step()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = peak_rss()
    step()
    return peak_rss() - base


def alternating_medians(steps: dict[str, Callable[[], object]], repeats: int, device: torch.device
                        ) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds of each step, the steps alternating round by round (a change in the machine's load hits
    them alike), after one untimed round (warm-up: kernels, .grad buffers), and what each step returned then."""
    first = {name: step() for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}, first


def add_window_arguments(parser: argparse.ArgumentParser, model: str, seq_len: int) -> None:
    """The arguments of a benchmark of windows of generated microbatches (`GeneratedWindow`) through
    `accumulate_gradients`: towers, image size, microbatch size, device, precision, threads, budget, output."""
    parser.add_argument("--model", default=model)
    parser.add_argument("--seq-len", type=int, default=seq_len, help="patches per image (a square grid)")
    parser.add_argument("--microbatch-tokens", type=int, default=65536, help="image tokens per microbatch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default=None, choices=("fp32", "amp_bf16"),
                        help="default: amp_bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip a measurement that would not finish in this")
    parser.add_argument("--out", default=None, help="append results.jsonl / results.md here as they are measured")


def window_precision(args: argparse.Namespace) -> tuple[torch.device, str, Callable[[], Any]]:
    """From `add_window_arguments`' values: the device, the precision's name and its autocast; sets the threads."""
    from naflexclip.models.precision import create_precision

    device = torch.device(args.device)
    precision = args.precision or ("amp_bf16" if device.type == "cuda" else "fp32")
    torch.set_num_threads(args.threads)
    return device, precision, create_precision(precision, device).autocast


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_and_peak(step: Callable[[], object], device: torch.device, repeats: int, warmup: bool = True
                  ) -> tuple[float, int | None]:
    """Median seconds of `step` over `repeats` runs and its peak memory over the state before it (CUDA: max
    allocated during one run, which is also the first timed one when `warmup` is False; CPU: None, a process's
    peak RSS cannot be reset). `warmup`: one untimed run first (compiles, autotunes, allocates .grad buffers)."""
    if warmup:
        step()
        synchronize(device)
    peak = None
    seconds = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device) - base
        if warmup:
            seconds.clear()  # the memory run is not timed when there was a warm-up: repeats are the timed runs
    for _ in range(repeats - len(seconds)):
        start = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), peak


def mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.0f}"


class Results:
    """Where one benchmark's figures go as they are measured: printed, and under an output folder appended to
    `results.jsonl` (one JSON object per figure, tagged with the step) and `results.md` (the printed lines),
    so a step stopped by its time limit keeps what it measured. Records are tagged with the step of
    benchmarks/gpu_checks.py that runs the benchmark ($GPU_CHECKS_STEP), else with `step`."""

    def __init__(self, out: str | Path | None, step: str, markdown: str | Path | None = None) -> None:
        self.step = os.environ.get("GPU_CHECKS_STEP") or step
        self.out = Path(out) if out else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
        self.markdown = [self.out / "results.md"] if self.out else []
        if markdown:  # one more file the lines go to (a benchmark's own --out)
            Path(markdown).parent.mkdir(parents=True, exist_ok=True)
            self.markdown.append(Path(markdown))

    def line(self, text: str) -> None:
        print(text, flush=True)
        for path in self.markdown:
            with open(path, "a") as f:
                f.write(text + "\n")

    def record(self, text: str | None = None, **fields: Any) -> None:
        """One figure: `fields` as a JSON line (with `step`), `text` as its human-readable line."""
        if text is not None:
            self.line(text)
        if self.out:
            with open(self.out / "results.jsonl", "a") as f:
                f.write(json.dumps({"step": self.step, **fields}, default=str) + "\n")

    def skip(self, what: str, reason: str) -> None:
        """One line for something not measured, and why."""
        self.record(f"skipped: {what}: {reason}", kind="skipped", what=what, reason=reason)


class GeneratedWindow(Sequence):
    """A window's NaFlex microbatches, each made on the device when it is read, from its index: the same tensors
    at every read (the window reads each microbatch more than once), so a window of 262,144 images never exists
    whole. Square grids of `seq_len` patches (a perfect square), random pixels, and random caption tokens that
    fill the context and end in the highest id (open_clip's end-of-text); `rows` images per microbatch, each with
    `captions` captions (more than one: a grouped microbatch, `image_group` / `text_group` ids global over the
    window)."""

    def __init__(self, num_examples: int, rows: int, seq_len: int, model: torch.nn.Module, device: torch.device,
                 seed: int = 0, captions: int = 1) -> None:
        side = math.isqrt(seq_len)
        if side * side != seq_len:
            raise ValueError(f"--seq-len must be a perfect square (a square grid of patches), got {seq_len}")
        self.sizes = [len(part) for part in torch.arange(num_examples).split(rows)]
        self.side, self.device, self.seed, self.captions = side, device, seed, captions
        self.starts = [sum(self.sizes[:index]) for index in range(len(self.sizes))]
        self.patch_dim = model.image_patch_size**2 * 3
        self.context_length, self.vocab_size = model.context_length, model.vocab_size
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1)
        self.coords = grid.reshape(1, seq_len, 2).to(device)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        if not 0 <= index < len(self.sizes):
            raise IndexError(index)
        rows, seq_len = self.sizes[index], self.side * self.side
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + index)
        patches = torch.randn(rows, seq_len, self.patch_dim, generator=gen, device=self.device)
        text = torch.randint(1, self.vocab_size - 1, (rows * self.captions, self.context_length), generator=gen,
                             device=self.device)
        text[:, -1] = self.vocab_size - 1
        image = {"patches": patches, "patch_coord": self.coords.expand(rows, -1, -1),
                 "patch_valid": torch.ones(rows, seq_len, dtype=torch.bool, device=self.device)}
        if self.captions == 1:
            return {"image": image, "text": text}
        groups = torch.arange(self.starts[index], self.starts[index] + rows, device=self.device)
        return {"image": image, "text": text, "image_group": groups,
                "text_group": groups.repeat_interleave(self.captions)}
