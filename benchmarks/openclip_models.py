"""OpenCLIP names as NaFlex models against open_clip's own:

(a) loading a ViT-B-16-size checkpoint file: `naflexclip.create_model(NAME, pretrained=FILE)` (what `train --model
    NAME --pretrained FILE` builds) against `open_clip.create_model_and_transforms(NAME, pretrained=FILE)`: wall time
    and peak resident memory over the process's after imports;
(b) one forward + backward of the NaFlex model at the name's native grid (the NaFlex dict input, as training feeds
    it) against open_clip's fixed-size model on the same images and captions: time and peak resident memory over
    the state before the step.

Loads and memory: each variant in its own spawned process (its peak memory is its own), loads alternating; step
times: both models in one process, their steps alternating (a shared machine's load hits both alike). Medians of
`--repeats`, with the ratio ours / open_clip. CPU, `--threads` threads. The checkpoint is open_clip's
random-init model of NAME (the file's size, not its values, is what loading costs); nothing is downloaded.

    python benchmarks/openclip_models.py --model ViT-B-16 --batch-size 4 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import in_subprocess  # noqa: E402

VARIANTS = ("naflexclip", "open_clip")


def _rss() -> int:
    """This process's resident memory now, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak resident memory while the block runs, sampled every millisecond, over the resident memory before it."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, _rss())
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _load(variant: str, name: str, file: str, threads: int, queue: Any) -> None:
    import torch

    torch.set_num_threads(threads)
    import open_clip

    import naflexclip

    with PeakRss() as memory:
        start = time.perf_counter()
        if variant == "naflexclip":
            naflexclip.create_model(name, pretrained=file)
        else:
            open_clip.create_model_and_transforms(name, pretrained=file)
        seconds = time.perf_counter() - start
    queue.put((seconds, memory.growth))


def _inputs(batch: int, image_size: int, context_length: int, vocab: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, 3, image_size, image_size, generator=generator)
    tokens = torch.randint(1, vocab - 1, (batch, context_length), generator=generator)
    tokens[:, 20] = vocab - 1  # an end-of-text for argmax pooling
    return pixels, tokens


def _as_naflex(pixels: Any, patch: int) -> dict[str, Any]:
    """The images as NaFlex dicts of their full grid ((ph, pw, C) patches, row-major), as the loaders give them."""
    import torch

    b, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    patches = pixels.reshape(b, c, gh, patch, gw, patch).permute(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, -1)
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    coord = torch.stack([rows.flatten(), cols.flatten()], dim=-1).expand(b, -1, -1).contiguous()
    return {"patches": patches.contiguous(), "patch_coord": coord, "patch_valid": torch.ones(b, gh * gw, dtype=bool)}


def _build(variant: str, name: str, batch: int) -> Any:
    """The model (train mode) and a closure running one forward + backward of the CLIP loss on a fixed batch."""
    import open_clip
    import torch
    import torch.nn.functional as F

    import naflexclip

    torch.manual_seed(0)
    if variant == "naflexclip":
        model = naflexclip.create_model(name)
        image_size = model.config.image.pos_embed_grid_size[0] * model.image_patch_size
    else:
        model = open_clip.create_model(name, output_dict=True)
        size = model.visual.image_size
        image_size = size[0] if isinstance(size, (tuple, list)) else size
    model.train()
    pixels, tokens = _inputs(batch, image_size, model.context_length, model.vocab_size)
    image = _as_naflex(pixels, model.image_patch_size) if variant == "naflexclip" else pixels
    labels = torch.arange(batch)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(image=image, text=tokens)
        logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
        ((F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2).backward()

    return model, step


def _step_time(name: str, batch: int, threads: int, repeats: int, queue: Any) -> None:
    """Both models in one process, their steps alternating: a load change on a shared machine hits both alike."""
    import torch

    torch.set_num_threads(threads)
    steps = {variant: _build(variant, name, batch)[1] for variant in VARIANTS}
    for step in steps.values():
        step()  # warm-up: .grad buffers and allocator caches
    seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(repeats):
        for variant, step in steps.items():
            start = time.perf_counter()
            step()
            seconds[variant].append(time.perf_counter() - start)
    queue.put({variant: statistics.median(values) for variant, values in seconds.items()})


def _step_memory(variant: str, name: str, batch: int, threads: int, queue: Any) -> None:
    """Peak resident memory of one step over the state before it (model, inputs and warm .grad buffers)."""
    import torch

    torch.set_num_threads(threads)
    model, step = _build(variant, name, batch)
    step()
    model.zero_grad(set_to_none=True)
    with PeakRss() as memory:
        step()
    queue.put(memory.growth)


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ViT-B-16", help="an OpenCLIP model name")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="load runs per variant; timed steps per process")
    args = parser.parse_args()
    import open_clip
    import torch

    variants = VARIANTS
    with tempfile.TemporaryDirectory() as tmp:
        file = str(Path(tmp) / f"{args.model}.pt")
        torch.save(open_clip.create_model(args.model).state_dict(), file)
        size = os.path.getsize(file)
        loads: dict[str, list[tuple[float, int]]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant in variants:
                loads[variant].append(in_subprocess(_load, variant, args.model, file, args.threads))
    print("loads measured; timing the steps", file=sys.stderr, flush=True)
    step_time = in_subprocess(_step_time, args.model, args.batch_size, args.threads, args.repeats)
    print("steps timed; measuring their memory", file=sys.stderr, flush=True)
    step_memory = {variant: in_subprocess(_step_memory, variant, args.model, args.batch_size, args.threads)
                   for variant in variants}
    load = {v: (statistics.median(s for s, _ in runs), statistics.median(m for _, m in runs))
            for v, runs in loads.items()}
    print(f"{args.model}: checkpoint {_gib(size)}; CPU, {args.threads} threads; forward+backward batch "
          f"{args.batch_size} at the native grid; medians of {args.repeats}")
    print(f"{'':34}{'naflexclip':>14}{'open_clip':>14}{'ratio':>8}")
    rows = [
        ("load time (--pretrained FILE)", load["naflexclip"][0], load["open_clip"][0], "s"),
        ("load peak memory growth", load["naflexclip"][1], load["open_clip"][1], "GiB"),
        ("forward+backward time", step_time["naflexclip"], step_time["open_clip"], "s"),
        ("forward+backward peak memory", step_memory["naflexclip"], step_memory["open_clip"], "GiB"),
    ]
    for label, ours, theirs, unit in rows:
        shown = (f"{ours:.2f} s", f"{theirs:.2f} s") if unit == "s" else (_gib(ours), _gib(theirs))
        print(f"{label:34}{shown[0]:>14}{shown[1]:>14}{ours / theirs:>7.2f}x")


if __name__ == "__main__":
    main()
