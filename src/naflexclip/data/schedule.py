"""Token-budget batch schedule: per-epoch (seq_len, batch_size) plans shared by every rank and worker.

A `TokenBudget` says how microbatches are sized: for each step a sequence length is drawn from its
`seq_lens` (weights `probs`), and the batch size is `max_tokens // seq_len` rounded down to a multiple of
`divisor` (at least 1). `build_global_plan` cuts one global per-epoch order (`epoch_order`) into steps of
one microbatch per rank, so every position is read once and all ranks step through the same number of
microbatches; `build_schedule` plans one rank's share of a stream. DataLoader workers take a plan's batches
round-robin (worker w owns batches w, w+K, ...), which torch's DataLoader hands back in plan order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenBudget:
    """How microbatches are sized (`DataConfig.token_budget()` gives the one of the `--naflex-*` flags).

    `seq_lens`: sequence lengths (patches per image) a microbatch can be drawn at; `probs`: their weights
    (uniform when None); `max_tokens`: patches per microbatch, so `max_tokens // seq_len` rows, rounded down
    to a multiple of `divisor` (at least 1).
    """

    seq_lens: tuple[int, ...]
    max_tokens: int
    probs: tuple[float, ...] | None = None
    divisor: int = 1

    def __post_init__(self) -> None:
        if not self.seq_lens or any(s < 1 for s in self.seq_lens):
            raise ValueError(f"--naflex-seq-lens must be positive integers, got {self.seq_lens}")
        if len(set(self.seq_lens)) != len(self.seq_lens):
            raise ValueError(f"--naflex-seq-lens must not repeat a length, got {self.seq_lens}")
        if self.probs is not None:
            if len(self.probs) != len(self.seq_lens):
                raise ValueError(f"--naflex-seq-len-probs needs one weight per --naflex-seq-lens entry "
                                 f"({len(self.seq_lens)}), got {self.probs}")
            if any(p < 0 or not math.isfinite(p) for p in self.probs) or sum(self.probs) <= 0:
                raise ValueError(f"--naflex-seq-len-probs must be non-negative with a positive sum, got {self.probs}")
        if self.max_tokens < max(self.seq_lens):
            raise ValueError(f"--naflex-max-tokens-per-batch must be >= the largest --naflex-seq-lens "
                             f"({max(self.seq_lens)}), got {self.max_tokens}")
        if self.divisor < 1:
            raise ValueError(f"--naflex-batch-divisor must be >= 1, got {self.divisor}")

    def batch_size(self, seq_len: int) -> int:
        """Rows that fit `max_tokens` at `seq_len`, rounded down to a multiple of `divisor`, at least 1."""
        rows = self.max_tokens // seq_len
        return max(1, rows // self.divisor * self.divisor)

    def at_longest(self) -> TokenBudget:
        """Every microbatch at the longest sequence length (evaluation: one deterministic size)."""
        return TokenBudget((max(self.seq_lens),), self.max_tokens, None, self.divisor)


@dataclass(frozen=True)
class ScheduledBatch:
    """One planned microbatch: its index in the epoch's plan, patch budget per image and row count.

    `offset`: where its samples start in the epoch's sample order (the global order for a global plan,
    this rank's share for a stream).
    """

    index: int
    seq_len: int
    batch_size: int
    offset: int


def _rng(seed: int, epoch: int, tag: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, tag]))


def samples_per_rank(num_samples: int, world_size: int) -> int:
    """Samples each rank sees per epoch: ceil(N / world_size); short ranks wrap around (<= R-1 repeats)."""
    return math.ceil(num_samples / world_size)


def _seq_len_draws(budget: TokenBudget, seed: int, epoch: int) -> Callable[[int], int]:
    """`seq_len_of(i)`: microbatch/step i's sequence length, drawn in order from (seed, epoch) alone, so step i's
    length never depends on where a plan starts."""
    if len(budget.seq_lens) == 1:
        return lambda i: budget.seq_lens[0]
    rng = _rng(seed, epoch, 0x5EC)
    weights = None if budget.probs is None else np.asarray(budget.probs, dtype=np.float64) / float(sum(budget.probs))
    draws: list[int] = []

    def seq_len_of(i: int) -> int:
        while len(draws) <= i:
            draws.append(int(budget.seq_lens[int(rng.choice(len(budget.seq_lens), p=weights))]))
        return draws[i]

    return seq_len_of


def build_schedule(num_samples: int, budget: TokenBudget, *, seed: int = 0, epoch: int = 0) -> list[ScheduledBatch]:
    """Plan one rank's epoch of `num_samples` samples as token-budget microbatches.

    The sum of batch sizes is exactly `num_samples`; only the last batch may be smaller.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    seq_len_of = _seq_len_draws(budget, seed, epoch)
    schedule: list[ScheduledBatch] = []
    offset = 0
    while offset < num_samples:
        seq_len = seq_len_of(len(schedule))
        size = min(budget.batch_size(seq_len), num_samples - offset)
        schedule.append(ScheduledBatch(len(schedule), seq_len, size, offset))
        offset += size
    return schedule


def worker_batches(
    schedule: list[ScheduledBatch], worker_id: int, num_workers: int, start_batch: int = 0
) -> list[ScheduledBatch]:
    """The batches worker `worker_id` of `num_workers` builds, from `start_batch` on (round-robin)."""
    num_workers = max(1, num_workers)
    return [b for b in schedule if b.index >= start_batch and (b.index - start_batch) % num_workers == worker_id]


# -- the global plan: one permutation, R microbatches per step, every sample once ----------------------


@dataclass(frozen=True)
class PlannedStep:
    """One step of the global plan: every rank runs one microbatch at `seq_len`.

    `sizes[r]`: rows of rank r's microbatch (all >= 1); rank r reads the epoch order from
    `offset + sum(sizes[:r])`. `index`: the microbatch index on every rank.
    """

    index: int
    seq_len: int
    sizes: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class GlobalPlan:
    """An epoch's steps from step `start_step` and global sample position `start_sample` on; `dropped`: samples
    no step can take (an epoch, or a re-planned rest of one, with fewer samples than ranks)."""

    steps: tuple[PlannedStep, ...]
    num_samples: int
    start_sample: int
    dropped: int
    start_step: int = 0

    @property
    def num_steps(self) -> int:
        """Steps of the whole epoch (one microbatch per rank each), also those before `start_step`."""
        return self.steps[-1].index + 1 if self.steps else self.start_step

    def rank_batches(self, rank: int) -> list[ScheduledBatch]:
        """Rank `rank`'s microbatches; `offset` indexes the epoch's global order."""
        return [ScheduledBatch(s.index, s.seq_len, s.sizes[rank], s.offset + sum(s.sizes[:rank])) for s in self.steps]

    def step_start(self, index: int) -> int:
        """Global sample position where microbatch `index` starts (the epoch's end for index == last + 1)."""
        for step in self.steps:
            if step.index == index:
                return step.offset
        return self.num_samples - self.dropped


def even_sizes(total: int, parts: int) -> tuple[int, ...]:
    """`total` split into `parts` sizes that differ by at most one, larger first."""
    return tuple(total // parts + (1 if r < total % parts else 0) for r in range(parts))


def build_global_plan(
    num_samples: int,
    world_size: int,
    budget: TokenBudget,
    *,
    seed: int = 0,
    epoch: int = 0,
    start_step: int = 0,
    start_sample: int = 0,
) -> GlobalPlan:
    """Plan an epoch of `num_samples` samples (positions in one global order) over `world_size` ranks.

    Step i draws its sequence length from (seed, epoch, i) alone and gives every rank
    `budget.batch_size(seq_len)` rows, so every rank runs the same number of microbatches and every
    position is read once. The epoch's tail (fewer than a full step) is split evenly over the ranks;
    when it has fewer samples than ranks it is merged into the step before (one step at the longest
    sequence length that holds it, else two steps at that step's length; when every sequence length
    allows a single row, that step's first ranks take two rows, one over the token budget, rather than
    leave a sample out). Only fewer samples than ranks in all are left out, counted in `dropped`.
    `start_step`/`start_sample` plan the rest of an epoch resumed at that microbatch and position,
    at any world size: with the same world size the steps equal the uninterrupted plan's.
    """
    if num_samples < 0 or not 0 <= start_sample <= num_samples:
        raise ValueError(f"need 0 <= start_sample <= num_samples, got {start_sample}, {num_samples}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    seq_len_of = _seq_len_draws(budget, seed, epoch)
    steps: list[PlannedStep] = []
    offset, index, dropped = start_sample, start_step, 0
    while offset < num_samples:
        seq_len = seq_len_of(index)
        rows = budget.batch_size(seq_len)
        left = num_samples - offset
        if left >= world_size * rows:
            sizes = (rows,) * world_size
        elif left >= world_size:
            sizes = even_sizes(left, world_size)
        elif steps:  # fewer samples than ranks: fold them into the previous step
            prev = steps.pop()
            total = sum(prev.sizes) + left
            fit = next((s for s in sorted(budget.seq_lens, reverse=True) if world_size * budget.batch_size(s) >= total),
                       None)
            if fit is not None:
                steps.append(PlannedStep(prev.index, fit, even_sizes(total, world_size), prev.offset))
            elif total >= 2 * world_size:
                parts = even_sizes(total, 2 * world_size)
                first = tuple(parts[0::2])
                steps.append(PlannedStep(prev.index, prev.seq_len, first, prev.offset))
                steps.append(PlannedStep(prev.index + 1, prev.seq_len, tuple(parts[1::2]), prev.offset + sum(first)))
            else:  # every length allows one row only: the last step's first ranks take a second row
                steps.append(PlannedStep(prev.index, prev.seq_len, even_sizes(total, world_size), prev.offset))
            break
        else:
            dropped = left
            break
        steps.append(PlannedStep(index, seq_len, sizes, offset))
        offset += sum(sizes)
        index += 1
    return GlobalPlan(tuple(steps), num_samples, start_sample, dropped, start_step)


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool, group_size: int = 1) -> np.ndarray:
    """The epoch's global order of dataset indices (int64): one permutation, the same on every rank and worker.

    `group_size` > 1 shuffles groups of that many consecutive indices and keeps each group together.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    if group_size == 1:
        return _rng(seed, epoch, 0x5A3).permutation(num_samples).astype(np.int64)
    groups = _rng(seed, epoch, 0x5A3).permutation(-(-num_samples // group_size))
    order = (groups[:, None] * group_size + np.arange(group_size)).ravel()
    return order[order < num_samples].astype(np.int64)
