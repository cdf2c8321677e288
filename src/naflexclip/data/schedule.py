"""Token-budget batch schedule: per-epoch (seq_len, batch_size) plans shared by every rank and worker.

A `TokenBudget` says how microbatches are sized: for each step a sequence length is drawn from its
`seq_lens` (weights `probs`), and the batch size is `max_tokens // seq_len` rounded down to a multiple of
`divisor` (at least 1). `build_global_plan` cuts one global per-epoch order (`epoch_order`) into steps of
one microbatch per rank, so every position is read once and all ranks step through the same number of
microbatches; `build_schedule` plans one rank's share of a stream. DataLoader workers take a plan's batches
round-robin (worker w owns batches w, w+K, ...), which torch's DataLoader hands back in plan order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
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


class SeqLenDraws:
    """The epoch's per-step sequence lengths, drawn in order from (seed, epoch) alone, so step i's length never
    depends on where a plan starts. Drawn in vectorised chunks (the same values as one `choice` per step)."""

    def __init__(self, budget: TokenBudget, seed: int, epoch: int) -> None:
        self.budget = budget
        self.lens = np.asarray(budget.seq_lens, dtype=np.int64)
        self.rows = np.asarray([budget.batch_size(s) for s in budget.seq_lens], dtype=np.int64)
        self.rng = _rng(seed, epoch, 0x5EC) if len(self.lens) > 1 else None
        self.cdf = None
        if budget.probs is not None and self.rng is not None:
            weights = np.asarray(budget.probs, dtype=np.float64) / float(sum(budget.probs))
            self.cdf = weights.cumsum()
            self.cdf /= self.cdf[-1]
        self.choices = np.zeros(0, dtype=np.int64)

    def first(self, n: int) -> np.ndarray:
        """Indices into `budget.seq_lens` of steps [0, n)."""
        if self.rng is None:
            return np.zeros(n, dtype=np.int64)
        if len(self.choices) < n:
            k = max(n - len(self.choices), len(self.choices), 256)
            if self.cdf is None:
                more = self.rng.integers(0, len(self.lens), size=k)
            else:
                more = np.searchsorted(self.cdf, self.rng.random(k), side="right")
            self.choices = np.concatenate([self.choices, more.astype(np.int64)])
        return self.choices[:n]

    def __call__(self, i: int) -> int:
        return int(self.lens[self.first(i + 1)[i]])


def _steps_until(draws: SeqLenDraws, first: int, total: int, per_step: int) -> tuple[np.ndarray, np.ndarray]:
    """(choices, cumulative samples) of steps first, first+1, ... until `per_step` x rows reach `total` (or one
    more than the steps that fit)."""
    n = int(total / (per_step * draws.rows.mean())) + 16
    while True:
        choices = draws.first(first + n)[first:]
        consumed = np.cumsum(draws.rows[choices] * per_step)
        if len(consumed) and consumed[-1] >= total:
            return choices, consumed
        n *= 2


class Schedule(Sequence):
    """One rank's planned microbatches as arrays (index = `first_index` + position): `ScheduledBatch` views."""

    def __init__(self, first_index: int, seq_lens: np.ndarray, sizes: np.ndarray, offsets: np.ndarray) -> None:
        self.first_index, self.seq_lens, self.sizes, self.offsets = first_index, seq_lens, sizes, offsets

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return ScheduledBatch(self.first_index + i, int(self.seq_lens[i]), int(self.sizes[i]), int(self.offsets[i]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and list(self) == list(other)

    def total(self) -> int:
        """Planned samples (the sum of the batch sizes)."""
        return int(self.sizes.sum())

    def strided(self, start: int, step: int) -> Iterator[ScheduledBatch]:
        """The batches with index start, start + step, ... (those in the schedule)."""
        first = start - self.first_index
        if first < 0:
            first += (-first + step - 1) // step * step
        for i in range(first, len(self), step):
            yield self[i]


def build_schedule(num_samples: int, budget: TokenBudget, *, seed: int = 0, epoch: int = 0) -> Schedule:
    """Plan one rank's epoch of `num_samples` samples as token-budget microbatches.

    The sum of batch sizes is exactly `num_samples`; only the last batch may be smaller.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    draws = SeqLenDraws(budget, seed, epoch)
    if num_samples == 0:
        return Schedule(0, *(np.zeros(0, np.int64),) * 3)
    choices, consumed = _steps_until(draws, 0, num_samples, 1)
    n = int(np.searchsorted(consumed, num_samples, side="left")) + 1
    sizes = draws.rows[choices[:n]].copy()
    offsets = np.concatenate([[0], consumed[: n - 1]]).astype(np.int64)
    sizes[-1] = num_samples - offsets[-1]
    return Schedule(0, draws.lens[choices[:n]], sizes, offsets)


def worker_batches(schedule: Sequence[ScheduledBatch], worker_id: int, num_workers: int, start_batch: int = 0
                   ) -> Iterator[ScheduledBatch]:
    """The batches worker `worker_id` of `num_workers` builds, from `start_batch` on (round-robin)."""
    num_workers = max(1, num_workers)
    if isinstance(schedule, Schedule):
        return schedule.strided(start_batch + worker_id, num_workers)
    return iter([b for b in schedule
                 if b.index >= start_batch and (b.index - start_batch) % num_workers == worker_id])


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
    """An epoch's steps from step `start_step` and global sample position `start_sample` on, as arrays: step
    `start_step + i` runs at `seq_lens[i]` from global position `offsets[i]`, every rank taking `rows[i]` rows,
    except the last `len(tail)` steps, whose per-rank sizes are `tail` (the epoch's uneven end). `dropped`:
    samples no step can take (an epoch, or a re-planned rest of one, with fewer samples than ranks). Its size
    is O(steps), whatever the number of ranks; a rank's microbatches are computed from it arithmetically."""

    seq_lens: np.ndarray
    rows: np.ndarray
    offsets: np.ndarray
    tail: tuple[tuple[int, ...], ...]
    world_size: int
    num_samples: int
    start_sample: int
    dropped: int
    start_step: int = 0

    @property
    def num_steps(self) -> int:
        """Steps of the whole epoch (one microbatch per rank each), also those before `start_step`."""
        return self.start_step + len(self.seq_lens)

    @functools.cached_property
    def steps(self) -> tuple[PlannedStep, ...]:
        """Every step as a `PlannedStep` (for inspection: O(steps x ranks))."""
        n, regular = len(self.seq_lens), len(self.seq_lens) - len(self.tail)
        return tuple(PlannedStep(self.start_step + i, int(self.seq_lens[i]),
                                 (int(self.rows[i]),) * self.world_size if i < regular else self.tail[i - regular],
                                 int(self.offsets[i])) for i in range(n))

    def rank_batches(self, rank: int) -> Schedule:
        """Rank `rank`'s microbatches; `offset` indexes the epoch's global order."""
        sizes = self.rows.copy()
        offsets = self.offsets + rank * self.rows
        regular = len(self.rows) - len(self.tail)
        for j, tail in enumerate(self.tail):
            sizes[regular + j] = tail[rank]
            offsets[regular + j] = self.offsets[regular + j] + sum(tail[:rank])
        return Schedule(self.start_step, self.seq_lens, sizes, offsets)

    def step_start(self, index: int) -> int:
        """Global sample position where microbatch `index` starts (the epoch's end for index == last + 1)."""
        if self.start_step <= index < self.num_steps:
            return int(self.offsets[index - self.start_step])
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
    draws = SeqLenDraws(budget, seed, epoch)
    left = num_samples - start_sample
    empty = np.zeros(0, np.int64)
    if left == 0:
        return GlobalPlan(empty, empty, empty, (), world_size, num_samples, start_sample, 0, start_step)
    choices, consumed = _steps_until(draws, start_step, left, world_size)
    full = int(np.searchsorted(consumed, left, side="right"))  # steps every rank can fill
    seq_lens = list(draws.lens[choices[:full]])
    rows = list(draws.rows[choices[:full]])
    offsets = list(start_sample + np.concatenate([[0], consumed[: full - 1]])) if full else []
    rest = left - (int(consumed[full - 1]) if full else 0)
    tail: list[tuple[int, ...]] = []
    dropped = 0
    if rest >= world_size:  # the epoch's tail, split evenly
        seq_lens.append(draws.lens[choices[full]])
        rows.append(0)
        offsets.append(num_samples - rest)
        tail.append(even_sizes(rest, world_size))
    elif rest and full:  # fewer samples than ranks: fold them into the previous step
        prev_len, prev_offset = int(seq_lens.pop()), int(offsets.pop())
        total = int(rows.pop()) * world_size + rest
        fit = next((s for s in sorted(budget.seq_lens, reverse=True) if world_size * budget.batch_size(s) >= total),
                   None)
        if fit is not None:
            seq_lens += [fit]
            rows += [0]
            offsets += [prev_offset]
            tail.append(even_sizes(total, world_size))
        elif total >= 2 * world_size:
            parts = even_sizes(total, 2 * world_size)
            first = tuple(parts[0::2])
            seq_lens += [prev_len, prev_len]
            rows += [0, 0]
            offsets += [prev_offset, prev_offset + sum(first)]
            tail += [first, tuple(parts[1::2])]
        else:  # every length allows one row only: the last step's first ranks take a second row
            seq_lens += [prev_len]
            rows += [0]
            offsets += [prev_offset]
            tail.append(even_sizes(total, world_size))
    elif rest:
        dropped = rest
    return GlobalPlan(np.asarray(seq_lens, np.int64), np.asarray(rows, np.int64), np.asarray(offsets, np.int64),
                      tuple(tail), world_size, num_samples, start_sample, dropped, start_step)


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
