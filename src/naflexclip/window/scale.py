"""The scale policy: the one loss multiplier `s(W)` of a window, from the sizes of every microbatch in it
(`--naflex-loss-scale`, `--batch-size`; docs/accumulation.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence

SCALE_MODES = ("none", "linear", "sqrt")


def window_loss_scale(
    batch_sizes: Sequence[int], reference_batch_size: int | None, mode: str
) -> float:
    """The one loss multiplier `s(W)` of a window, from the sizes of *every* microbatch in it.

    batch_sizes: all ranks' microbatch sizes (length `R·n`); reference_batch_size: `B_ref`
    (`--batch-size`); mode: `none` → 1, `linear` → mean size / B_ref, `sqrt` → its square root.
    """
    if mode not in SCALE_MODES:
        raise ValueError(f"unknown loss scale mode {mode!r}; choose one of {SCALE_MODES}")
    if len(batch_sizes) == 0:
        raise ValueError("empty window: batch_sizes=[] has no microbatches")
    for size in batch_sizes:
        if size < 1:
            raise ValueError(f"microbatch size {size} < 1 in window batch_sizes={list(batch_sizes)}")
    if mode == "none":
        return 1.0
    if reference_batch_size is None or reference_batch_size <= 0:
        raise ValueError(
            f"loss scale mode {mode!r} needs a positive reference batch size (--batch-size), "
            f"got {reference_batch_size!r}"
        )
    # mean microbatch size over the whole window / B_ref: one number for every microbatch in it
    linear = sum(batch_sizes) / (len(batch_sizes) * reference_batch_size)
    return linear if mode == "linear" else math.sqrt(linear)
