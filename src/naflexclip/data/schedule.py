"""Token-budget batch schedule: per-epoch (seq_len, batch_size) plans shared by every rank and worker.

A `TokenBudget` sizes each microbatch (a drawn sequence length; `max_tokens // seq_len` rows rounded down to a
multiple of `divisor`, at least 1). `build_global_plan` cuts one global epoch order (`epoch_order`) into steps of
one microbatch per rank; `build_schedule` plans one rank's share of a stream; DataLoader workers take a plan's
batches round-robin. docs/data.md#batches-a-token-budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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

    def one_pair_windows(self, microbatches_per_window: int) -> tuple[str, bool] | None:
        """When a window of `microbatches_per_window` microbatches (--accum-freq x ranks) drawn at some length holds
        one pair (its contrastive loss is 0: no negative): the one line saying why, naming the flags that size it,
        and whether every length does (nothing can be learned). None when no window is one pair."""
        drawn = [s for i, s in enumerate(self.seq_lens) if self.probs is None or self.probs[i] > 0]
        single = [s for s in drawn if self.batch_size(s) * microbatches_per_window < 2]
        if not single:
            return None
        held = [self.max_tokens // s for s in single]
        shown = ", ".join(f"{n} image{'s' if n > 1 else ''} of {s} patches" for n, s in zip(held, single, strict=True))
        rounded = f", which --naflex-batch-divisor {self.divisor} rounds down to 1" if max(held) > 1 else ""
        needed = max(2, self.divisor) * max(single)
        fix = f"raise --naflex-max-tokens-per-batch to {needed}"
        if max(held) > 1:
            fix += f" or lower --naflex-batch-divisor to {min(held)}"
        every = len(single) == len(drawn)
        which = "every window is" if every else "a window drawn at that length is"
        return (f"--naflex-max-tokens-per-batch {self.max_tokens} holds {shown} (--naflex-seq-lens){rounded}: with "
                f"{microbatches_per_window} microbatch{'es' if microbatches_per_window > 1 else ''} per window "
                f"(--accum-freq x ranks) {which} one pair, with no negative to contrast (a CLIP loss of 0); "
                f"{fix}, or raise --accum-freq"), every

    def at_longest(self) -> TokenBudget:
        """Every microbatch at the longest sequence length (evaluation: one deterministic size)."""
        return TokenBudget((max(self.seq_lens),), self.max_tokens, None, self.divisor)


@dataclass(frozen=True)
class PatchSizes:
    """OpenCLIP's `--naflex-patch-sizes` / `--naflex-patch-size-probs` (timm's NaFlex loader's `patch_size_choices`):
    each training microbatch's patch size, drawn with weights `probs` (uniform when None; normalised, as there) from
    (seed, epoch, rank, microbatch index) alone, so a resume, any worker count and any read order give the same
    sizes. The plan is unchanged: a microbatch keeps its sequence length (patches per image) at any patch size, as in
    timm, where a smaller patch covers a smaller image."""

    sizes: tuple[int, ...]
    probs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.sizes or any(int(s) != s or s < 1 for s in self.sizes):
            raise ValueError(f"--naflex-patch-sizes must be positive integers, got {' '.join(map(str, self.sizes))}")
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"--naflex-patch-sizes must not repeat a size, got {' '.join(map(str, self.sizes))}")
        if self.probs is not None:
            shown = " ".join(f"{p:g}" for p in self.probs)
            if len(self.probs) != len(self.sizes):
                raise ValueError(f"--naflex-patch-size-probs needs one weight per --naflex-patch-sizes entry "
                                 f"({len(self.sizes)}), got {len(self.probs)}: {shown}")
            if any(p < 0 or not math.isfinite(p) for p in self.probs) or not sum(self.probs) > 0:
                raise ValueError(f"--naflex-patch-size-probs must be finite and >= 0 with a positive sum, got {shown}")

    @functools.cached_property
    def cdf(self) -> np.ndarray:
        weights = np.ones(len(self.sizes)) if self.probs is None else np.asarray(self.probs, dtype=np.float64)
        cdf = weights.cumsum()
        return cdf / cdf[-1]

    def draw(self, seed: int, epoch: int, rank: int, index: int) -> int:
        """The patch size of microbatch `index` of `rank` in `epoch`."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        u = _rng(seed, epoch, 0x9A7C, rank, index).random()
        return self.sizes[int(np.searchsorted(self.cdf, u, side="right"))]


@dataclass(frozen=True)
class ScheduledBatch:
    """One planned microbatch: its index in the epoch's plan, patch budget per image and row count.

    `offset`: where its samples start in the epoch's sample order (the global order for a global plan,
    this rank's share for a stream); `stride`: how far apart its samples are there (an interleaved plan's: the
    world size).
    """

    index: int
    seq_len: int
    batch_size: int
    offset: int
    stride: int = 1

    def positions(self) -> np.ndarray:
        """Its samples' positions in the epoch's sample order (int64)."""
        return self.offset + self.stride * np.arange(self.batch_size, dtype=np.int64)

    def samples(self, order: Any) -> list[int]:
        """Its samples' ids in `order` (an epoch's order, sliceable)."""
        return order[self.offset: self.offset + self.batch_size * self.stride: self.stride].tolist()


def _rng(seed: int, epoch: int, tag: int, *more: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, tag, *more]))


def samples_per_rank(num_samples: int, world_size: int) -> int:
    """Samples each rank sees per epoch: ceil(N / world_size); short ranks wrap around (<= R-1 repeats)."""
    return math.ceil(num_samples / world_size)


DRAW_CHUNK = 1 << 20  # sequence lengths drawn at a time


class SeqLenDraws:
    """The epoch's per-step sequence lengths, drawn in order from (seed, epoch) alone, so step i's length never
    depends on where a plan starts. Drawn in vectorised chunks (the same values as one `choice` per step) and kept
    as one byte per step: the index into `budget.seq_lens`."""

    def __init__(self, budget: TokenBudget, seed: int, epoch: int) -> None:
        if len(budget.seq_lens) > 255:
            raise ValueError(f"--naflex-seq-lens takes at most 255 lengths, got {len(budget.seq_lens)}")
        self.budget = budget
        self.lens = np.asarray(budget.seq_lens, dtype=np.int64)
        self.rows = np.asarray([budget.batch_size(s) for s in budget.seq_lens], dtype=np.int64)
        self.rng = _rng(seed, epoch, 0x5EC) if len(self.lens) > 1 else None
        self.cdf = None
        if budget.probs is not None and self.rng is not None:
            weights = np.asarray(budget.probs, dtype=np.float64) / float(sum(budget.probs))
            self.cdf = weights.cumsum()
            self.cdf /= self.cdf[-1]
        self.choices = np.zeros(0, dtype=np.uint8)

    def first(self, n: int) -> np.ndarray:
        """Indices (uint8) into `budget.seq_lens` of steps [0, n)."""
        if self.rng is None:
            return np.zeros(n, dtype=np.uint8)
        if len(self.choices) < n:
            parts, have = [self.choices], len(self.choices)
            target = max(n, 2 * have, 256)
            while have < target:  # in bounded chunks: the float draws never outgrow the byte per step
                k = min(target - have, DRAW_CHUNK)
                if self.cdf is None:
                    more = self.rng.integers(0, len(self.lens), size=k)
                else:
                    more = np.searchsorted(self.cdf, self.rng.random(k), side="right")
                parts.append(more.astype(np.uint8))
                have += k
            self.choices = np.concatenate(parts)
        return self.choices[:n]

    def __call__(self, i: int) -> int:
        return int(self.lens[self.first(i + 1)[i]])


PREFIX_EVERY = 256  # a plan keeps the running row count every this many steps; offsets in between are summed


@dataclass(frozen=True)
class _Steps:
    """Steps of one size rule, compactly: step i (0-based) runs at `lens[choice[i]]` with `rows[choice[i]]` rows per
    rank; `prefix[k]` is the rows per rank of the steps before step k*PREFIX_EVERY; positions start at `start`,
    `per_step` ranks share each step. O(1 byte) per step."""

    choice: np.ndarray
    prefix: np.ndarray
    lens: np.ndarray
    rows: np.ndarray
    start: int
    per_step: int

    @classmethod
    def build(cls, draws: SeqLenDraws, first: int, total: int, per_step: int, start: int) -> tuple[_Steps, int]:
        """The steps from draw `first` on whose `per_step` x rows fit in `total` samples; also the samples left."""
        chunks, prefix, done, n = [], [0], 0, first
        chunk = min(DRAW_CHUNK, max(4 * PREFIX_EVERY, int(total / (per_step * draws.rows.mean())) // 8
                                    // PREFIX_EVERY * PREFIX_EVERY))
        while True:
            choice = draws.first(n + chunk)[n:]
            consumed = done + np.cumsum(draws.rows[choice] * per_step)
            fit = int(np.searchsorted(consumed, total, side="right"))
            chunks.append(choice[:fit].copy())  # a copy: the draws reallocate as they grow
            steps_so_far = sum(len(c) for c in chunks)
            rows_before = np.concatenate([[done // per_step], consumed[:fit] // per_step])
            base = steps_so_far - fit  # step number of this chunk's first step
            for k in range(len(prefix), steps_so_far // PREFIX_EVERY + 1):
                prefix.append(int(rows_before[k * PREFIX_EVERY - base]))
            if fit < len(choice):
                done = int(consumed[fit - 1]) if fit else done
                break
            done = int(consumed[-1])
            n += chunk
        choices = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
        return cls(choices, np.asarray(prefix, np.int64), draws.lens, draws.rows, start, per_step), total - done

    def __len__(self) -> int:
        return len(self.choice)

    def rows_before(self, i: int) -> int:
        """Rows per rank of steps [0, i)."""
        k = i // PREFIX_EVERY
        return int(self.prefix[k]) + int(self.rows[self.choice[k * PREFIX_EVERY: i]].sum())

    def offset(self, i: int) -> int:
        """Global position where step i starts."""
        return self.start + self.per_step * self.rows_before(i)

    def end(self) -> int:
        return self.offset(len(self))

    def total_rows(self) -> int:
        return int(np.bincount(self.choice, minlength=len(self.rows)) @ self.rows)


class Schedule(Sequence):
    """One rank's planned microbatches (index = `first_index` + position) as `ScheduledBatch` views of a plan's
    compact steps: `rank`'s rows of each regular step, then the explicit `tail` (seq_len, size, offset) steps.
    `stride` > 1 (an interleaved plan): a step's rows are dealt to the ranks by stride, not in contiguous runs."""

    def __init__(self, first_index: int, steps: _Steps, rank: int, tail: list[tuple[int, int, int]],
                 stride: int = 1) -> None:
        self.first_index, self.steps, self.rank, self.tail = first_index, steps, rank, tail
        self.stride = stride

    def __len__(self) -> int:
        return len(self.steps) + len(self.tail)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        steps = self.steps
        if i >= len(steps):
            seq_len, size, offset = self.tail[i - len(steps)]
            return ScheduledBatch(self.first_index + i, seq_len, size, offset, self.stride)
        c = steps.choice[i]
        size = int(steps.rows[c])
        first = self.rank if self.stride > 1 else self.rank * size
        return ScheduledBatch(self.first_index + i, int(steps.lens[c]), size, steps.offset(i) + first, self.stride)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and list(self) == list(other)

    def total(self) -> int:
        """Planned samples (the sum of the batch sizes)."""
        return self.steps.total_rows() + sum(size for _, size, _ in self.tail)

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
    steps, left = _Steps.build(draws, 0, num_samples, 1, 0)
    tail = [(draws(len(steps)), left, num_samples - left)] if left else []
    return Schedule(0, steps, 0, tail)


def samples_for_image_tokens(num_tokens: int, budget: TokenBudget, *, seed: int) -> int:
    """OpenCLIP's --naflex-num-train-image-tokens: the samples of an epoch whose microbatches hold `num_tokens`
    image tokens (rows x sequence length), counted as OpenCLIP's NaFlexBatchScheduler plans them for one process:
    each microbatch's length drawn (here from (seed, epoch 0), as `SeqLenDraws`), its rows those of the token budget,
    or of the tokens left once fewer than --naflex-max-tokens-per-batch are (at least 1), until none are left. Every
    epoch is this many samples, at any world size."""
    if num_tokens < 1:
        raise ValueError(f"--naflex-num-train-image-tokens must be >= 1, got {num_tokens}")
    draws = SeqLenDraws(budget, seed, 0)
    full_tokens = draws.rows * draws.lens  # a whole microbatch's tokens at each length
    samples, done, i = 0, 0, 0
    while num_tokens - done >= budget.max_tokens:  # whole microbatches, a chunk of draws at a time
        chunk = max(256, (num_tokens - done) // int(full_tokens.min()) + 1)
        choice = draws.first(i + chunk)[i:].astype(np.int64)
        before = done + np.concatenate([[0], np.cumsum(full_tokens[choice])[:-1]])  # tokens before each one
        whole = int(np.searchsorted(before, num_tokens - budget.max_tokens, side="right"))
        samples += int(draws.rows[choice[:whole]].sum())
        done, i = done + int(full_tokens[choice[:whole]].sum()), i + whole
    while done < num_tokens:  # fewer tokens left than a microbatch holds: its rows are those of what is left
        seq_len = draws(i)
        rows = max(1, (num_tokens - done) // seq_len // budget.divisor * budget.divisor)
        samples, done, i = samples + rows, done + rows * seq_len, i + 1
    return samples


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
    """An epoch's steps from step `start_step` and global sample position `start_sample` on: the regular `steps`
    (every rank `rows` rows at the step's length; about one byte per step), then the `tail`, the epoch's uneven
    end as explicit (seq_len, per-rank sizes, offset) steps. `dropped`: samples no step can take (an epoch, or a
    re-planned rest of one, with fewer samples than ranks). Its size does not grow with the number of ranks; a
    rank's microbatches are computed from it arithmetically."""

    regular: _Steps
    tail: tuple[tuple[int, tuple[int, ...], int], ...]
    world_size: int
    num_samples: int
    start_sample: int
    dropped: int
    start_step: int = 0
    interleaved: bool = False  # rank r takes a step's positions offset + r, offset + r + world_size, ...

    @property
    def num_steps(self) -> int:
        """Steps of the whole epoch (one microbatch per rank each), also those before `start_step`."""
        return self.start_step + len(self.regular) + len(self.tail)

    @functools.cached_property
    def steps(self) -> tuple[PlannedStep, ...]:
        """Every step as a `PlannedStep` (for inspection: O(steps x ranks))."""
        regular = self.regular
        out = [PlannedStep(self.start_step + i, int(regular.lens[regular.choice[i]]),
                           (int(regular.rows[regular.choice[i]]),) * self.world_size, regular.offset(i))
               for i in range(len(regular))]
        out += [PlannedStep(self.start_step + len(regular) + j, seq_len, sizes, offset)
                for j, (seq_len, sizes, offset) in enumerate(self.tail)]
        return tuple(out)

    def rank_batches(self, rank: int) -> Schedule:
        """Rank `rank`'s microbatches; `offset` (and `stride`) index the epoch's global order."""
        if self.interleaved:  # a step's sizes differ by at most one, larger first: the strides cover its positions
            tail = [(seq_len, sizes[rank], offset + rank) for seq_len, sizes, offset in self.tail]
            return Schedule(self.start_step, self.regular, rank, tail, self.world_size)
        tail = [(seq_len, sizes[rank], offset + sum(sizes[:rank])) for seq_len, sizes, offset in self.tail]
        return Schedule(self.start_step, self.regular, rank, tail)

    def step_start(self, index: int) -> int:
        """Global sample position where microbatch `index` starts (the epoch's end for index == last + 1)."""
        i = index - self.start_step
        if 0 <= i < len(self.regular):
            return self.regular.offset(i)
        if 0 <= i - len(self.regular) < len(self.tail):
            return self.tail[i - len(self.regular)][2]
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
    interleaved: bool = False,
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
    `interleaved`: each step's positions are dealt to the ranks by stride (rank r takes offset + r, offset + r + R,
    ...), so a rank reads the positions of one residue mod R (`chunk_order`'s streams); else in contiguous runs.
    """
    if num_samples < 0 or not 0 <= start_sample <= num_samples:
        raise ValueError(f"need 0 <= start_sample <= num_samples, got {start_sample}, {num_samples}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    draws = SeqLenDraws(budget, seed, epoch)
    regular, rest = _Steps.build(draws, start_step, num_samples - start_sample, world_size, start_sample)
    tail: list[tuple[int, tuple[int, ...], int]] = []
    dropped = 0
    if rest >= world_size:  # the epoch's tail, split evenly
        tail.append((draws(start_step + len(regular)), even_sizes(rest, world_size), num_samples - rest))
    elif rest and len(regular):  # fewer samples than ranks: fold them into the previous step
        last = len(regular) - 1
        prev_len, prev_offset = int(regular.lens[regular.choice[last]]), regular.offset(last)
        total = int(regular.rows[regular.choice[last]]) * world_size + rest
        regular = dataclasses.replace(regular, choice=regular.choice[:last])
        fit = next((s for s in sorted(budget.seq_lens, reverse=True) if world_size * budget.batch_size(s) >= total),
                   None)
        if fit is not None:
            tail.append((fit, even_sizes(total, world_size), prev_offset))
        elif total >= 2 * world_size:
            parts = even_sizes(total, 2 * world_size)
            first = tuple(parts[0::2])
            if interleaved:  # a whole number of rows per rank first, so the next step keeps each rank's residue
                first = (total // world_size // 2,) * world_size
                parts = first + even_sizes(total - sum(first), world_size)
            second = tuple(parts[world_size:]) if interleaved else tuple(parts[1::2])
            tail += [(prev_len, first, prev_offset), (prev_len, second, prev_offset + sum(first))]
        else:  # every length allows one row only: the last step's first ranks take a second row
            tail.append((prev_len, even_sizes(total, world_size), prev_offset))
    elif rest:
        dropped = rest
    return GlobalPlan(regular, tuple(tail), world_size, num_samples, start_sample, dropped, start_step, interleaved)


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
