"""Token-budget batch schedule: per-epoch (seq_len, batch_size) plan shared by every rank and worker.

For each microbatch a sequence length is drawn from `seq_lens` (weights `probs`), and the batch
size is `max_tokens // seq_len` rounded down to a multiple of `divisor` (at least 1); the last
batch of an epoch takes what is left. The plan depends only on (seed, epoch, samples per rank),
so every rank computes the same one and all ranks step through the same number of microbatches.
DataLoader workers take the plan's batches round-robin (worker w owns batches w, w+K, ...), which
torch's DataLoader hands back in plan order, so no sample is duplicated or dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScheduledBatch:
    """One planned microbatch: its position in the epoch, patch budget per image and row count.

    `offset`: where its samples start in this rank's sample order for the epoch.
    """

    index: int
    seq_len: int
    batch_size: int
    offset: int


def _rng(seed: int, epoch: int, tag: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, tag]))


def batch_size_for(seq_len: int, max_tokens: int, divisor: int = 1) -> int:
    """Rows that fit `max_tokens` at `seq_len`, rounded down to a multiple of `divisor`, at least 1."""
    rows = max_tokens // seq_len
    return max(1, rows // divisor * divisor)


def samples_per_rank(num_samples: int, world_size: int) -> int:
    """Samples each rank sees per epoch: ceil(N / world_size); short ranks wrap around (<= R-1 repeats)."""
    return math.ceil(num_samples / world_size)


def build_schedule(
    num_samples: int,
    seq_lens: tuple[int, ...],
    max_tokens: int,
    *,
    probs: tuple[float, ...] | None = None,
    divisor: int = 1,
    seed: int = 0,
    epoch: int = 0,
    fixed_seq_len: int | None = None,
) -> list[ScheduledBatch]:
    """Plan one rank's epoch of `num_samples` samples as token-budget microbatches.

    `fixed_seq_len` (evaluation) uses that one length for every batch instead of drawing.
    The sum of batch sizes is exactly `num_samples`; only the last batch may be smaller.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    rng = _rng(seed, epoch, 0x5EC)
    weights = None
    if probs is not None:
        total = float(sum(probs))
        weights = np.asarray(probs, dtype=np.float64) / total
    schedule: list[ScheduledBatch] = []
    offset = 0
    while offset < num_samples:
        if fixed_seq_len is not None:
            seq_len = fixed_seq_len
        else:
            seq_len = int(seq_lens[int(rng.choice(len(seq_lens), p=weights))])
        size = min(batch_size_for(seq_len, max_tokens, divisor), num_samples - offset)
        schedule.append(ScheduledBatch(len(schedule), seq_len, size, offset))
        offset += size
    return schedule


def rank_sample_order(
    num_samples: int, *, rank: int, world_size: int, seed: int, epoch: int, shuffle: bool, group_size: int = 1
) -> np.ndarray:
    """Dataset indices this rank reads this epoch, in order (int64, length ceil(N / world_size)).

    One permutation of all N indices (same on every rank: it depends on seed and epoch only),
    padded by wrapping to a multiple of world_size, then strided by rank. `group_size` > 1 shuffles
    groups of that many consecutive indices and keeps each group's indices next to each other, so a
    group lands in one window (across ranks when strided: the window is global).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not shuffle:
        order = np.arange(num_samples)
    elif group_size == 1:
        order = _rng(seed, epoch, 0x5A3).permutation(num_samples)
    else:
        groups = _rng(seed, epoch, 0x5A3).permutation(-(-num_samples // group_size))
        order = (groups[:, None] * group_size + np.arange(group_size)).ravel()
        order = order[order < num_samples]
    per_rank = samples_per_rank(num_samples, world_size)
    pad = per_rank * world_size - num_samples
    if pad:
        order = np.concatenate([order, np.resize(order, pad)])
    return order[rank::world_size].astype(np.int64)


def worker_batches(
    schedule: list[ScheduledBatch], worker_id: int, num_workers: int, start_batch: int = 0
) -> list[ScheduledBatch]:
    """The batches worker `worker_id` of `num_workers` builds, from `start_batch` on (round-robin)."""
    num_workers = max(1, num_workers)
    return [b for b in schedule[start_batch:] if (b.index - start_batch) % num_workers == worker_id]
