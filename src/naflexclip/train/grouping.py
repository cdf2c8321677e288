"""How an epoch's microbatches group into accumulation windows, one optimizer step each.

The one rule both the loop's grouping and its step counts (lr schedule, progress bar) use, so they cannot
disagree: `--accum-freq` microbatches per window, and an epoch's tail of fewer joins the epoch's last window
instead of taking a step of its own (docs/accumulation.md, "Windows at an epoch's end").
"""

from __future__ import annotations


def window_sizes(num_microbatches: int, accum_freq: int) -> list[int]:
    """Microbatches in each window of `num_microbatches` consecutive ones: `accum_freq` each, the last one also
    holding the remainder, so every window has `accum_freq` to `2·accum_freq − 1` microbatches (fewer than
    `accum_freq` in all make one window). Grouping the microbatches left after any window gives the remaining
    windows unchanged, so a resume at a window boundary continues the same windows."""
    if num_microbatches < 0:
        raise ValueError(f"the number of microbatches must be >= 0, got {num_microbatches}")
    if accum_freq < 1:
        raise ValueError(f"--accum-freq must be >= 1, got {accum_freq}")
    full, rest = divmod(num_microbatches, accum_freq)
    if full == 0:
        return [rest] if rest else []
    return [accum_freq] * (full - 1) + [accum_freq + rest]
