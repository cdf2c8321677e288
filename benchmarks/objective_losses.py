"""The objectives' losses at scale, against the plain tiled loss: distillation and several positives (SigLIP+).

Each variant is one forward + backward over `N` random float32 features in a fresh process (peak RSS growth and
seconds, as `window_loss.py`'s `loss` part):

- `distill`: `DistillLoss` (clip: OpenCLIP's DistillClipLoss; siglip: soft-label BCE) with a teacher of the same
  width against the plain `ClipLoss`/`SigLipLoss`;
- `multi`: `MultiPositiveLoss` (clip: multi-positive InfoNCE; siglip: SigLIP+ symmetric) over `N` images with
  `--captions` captions each (`M = captions · N` texts) against the plain loss over `N` pairs.

    python benchmarks/objective_losses.py --sizes 4096 16384
    python benchmarks/objective_losses.py --sizes 16384 --kinds siglip --variants multi    # SigLIP+ vs SigLIP
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from window_loss import GIB, _features, _peak_rss, _run_fresh


def _step(kind: str, variant: str, n: int, dim: int, tile: int, threads: int, captions: int) -> dict[str, float]:
    from naflexclip.loss import DistillLoss, MultiPositiveLoss, create_loss

    torch.set_num_threads(threads)
    image, text = _features(n, dim)
    scale = torch.tensor(14.0, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True) if kind == "siglip" else None
    extra: tuple[Any, ...] = ()
    loss_fn: Any = create_loss(kind, tile)
    if variant == "distill":
        teacher_image, teacher_text = (t.detach() for t in _features(n, dim, seed=1))
        extra = (teacher_image, teacher_text, torch.tensor(20.0), torch.tensor(-8.0))
        loss_fn = DistillLoss(kind, 1.0, tile)
    elif variant == "multi":
        text = _features(n * captions, dim, seed=2)[1]
        groups = torch.arange(n)
        extra = (groups, groups.repeat_interleave(captions))
        loss_fn = MultiPositiveLoss(kind, "symmetric", tile)
    before = _peak_rss()
    start = time.perf_counter()
    value = loss_fn(image, text, scale, bias, *extra)
    value.sum().backward()
    return {"growth": _peak_rss() - before, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dim", type=int, default=16, help="feature dimension (the tiny preset's embed_dim)")
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--captions", type=int, default=2, help="captions per image of the multi-positive case")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", nargs="+", default=["clip", "siglip"], choices=("clip", "siglip"))
    parser.add_argument("--variants", nargs="+", default=["distill", "multi"], choices=("distill", "multi"))
    args = parser.parse_args()
    print(f"D={args.dim}, float32, {args.threads} thread(s), tile {args.tile}; multi: {args.captions} captions/image")
    print(f"{'loss':6} {'variant':8} {'N':>6} | {'plain GiB':>9} {'plain s':>8} | {'GiB':>7} {'s':>8} | "
          f"{'memory ×':>8} {'time ×':>7}")
    for kind in args.kinds:
        for n in args.sizes:
            plain = _run_fresh(_step, kind, "plain", n, args.dim, args.tile, args.threads, args.captions)
            for variant in args.variants:
                ours = _run_fresh(_step, kind, variant, n, args.dim, args.tile, args.threads, args.captions)
                print(f"{kind:6} {variant:8} {n:>6} | {plain['growth'] / GIB:9.3f} {plain['seconds']:8.2f} | "
                      f"{ours['growth'] / GIB:7.3f} {ours['seconds']:8.2f} | "
                      f"{ours['growth'] / max(plain['growth'], 1):8.2f} {ours['seconds'] / plain['seconds']:7.2f}")


if __name__ == "__main__":
    main()
