"""Epoch orders over shards at LAION scale: plain, weighted `::` mixtures and `--dataset-resampled`.

An epoch is a sequence of *slots* (a shard and how many of its samples it gives) cut into blocks of `BLOCK_SLOTS`
whose samples are one permutation, computed a block at a time from O(slots) arrays and from (seed, epoch) alone,
so every rank and worker computes the same order and a global position resumes at any world size.
docs/data.md#shard-lists-at-laion-scale and #mixtures-and-resampling-openclips-flags.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

BLOCK_SLOTS = 64  # shards whose samples are shuffled together
_TAG_SLOTS, _TAG_SUBSET, _TAG_BLOCK, _TAG_DRAW = 0x5107, 0x5B5E, 0xB10C, 0x2E5A


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([k & 0xFFFFFFFF for k in key]))


@dataclass(frozen=True)
class ShardSet:
    """Usable samples per shard (`sizes`), and the `::`-joined source each shard belongs to (`source_ids`,
    indexing `source_names`). Sample ids are numbered shard by shard: shard k's start at `starts[k]`."""

    sizes: np.ndarray
    source_ids: np.ndarray
    source_names: tuple[str, ...]

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    def source_sizes(self) -> np.ndarray:
        return np.bincount(self.source_ids, weights=self.sizes, minlength=len(self.source_names)).astype(np.int64)


class BlockOrder:
    """An epoch's order of sample ids, computed a block of slots at a time (see the module's docstring).

    `len()` is the sum of the slot counts; `order[a:b]` gives the ids at positions [a, b) as int64."""

    def __init__(self, shards: ShardSet, slot_shards: np.ndarray, slot_counts: np.ndarray, *, seed: int,
                 epoch: int, shuffle: bool, block_slots: int = BLOCK_SLOTS) -> None:
        self.shards, self.seed, self.epoch, self.shuffle = shards, seed, epoch, shuffle
        self.slot_shards, self.slot_counts = slot_shards.astype(np.int64), slot_counts.astype(np.int64)
        self.block_slots = block_slots
        per_block = np.add.reduceat(self.slot_counts, np.arange(0, len(self.slot_counts), block_slots)) \
            if len(self.slot_counts) else np.zeros(0, np.int64)
        self.block_ends = np.cumsum(per_block).astype(np.int64)
        self._starts = shards.starts
        self._blocks: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self.block_ends[-1]) if len(self.block_ends) else 0

    def source_counts(self) -> dict[str, int]:
        """Samples each source contributes to this epoch, by source name."""
        counts = np.bincount(self.shards.source_ids[self.slot_shards], weights=self.slot_counts,
                             minlength=len(self.shards.source_names))
        return {name: int(c) for name, c in zip(self.shards.source_names, counts, strict=True)}

    def _block(self, b: int) -> np.ndarray:
        if b in self._blocks:
            return self._blocks[b]
        parts = []
        for k in range(b * self.block_slots, min((b + 1) * self.block_slots, len(self.slot_counts))):
            shard, count = int(self.slot_shards[k]), int(self.slot_counts[k])
            size = int(self.shards.sizes[shard])
            if count >= size:
                take = np.arange(size, dtype=np.int64)
            elif self.shuffle:  # a fresh random subset of the shard
                take = _rng(self.seed, self.epoch, _TAG_SUBSET, k).permutation(size)[:count]
            else:
                take = np.arange(count, dtype=np.int64)
            parts.append(self._starts[shard] + take)
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if self.shuffle:
            ids = ids[_rng(self.seed, self.epoch, _TAG_BLOCK, b).permutation(len(ids))]
        self._blocks[b] = ids
        while len(self._blocks) > 2:  # a slice spans at most two neighbouring blocks at a time
            self._blocks.popitem(last=False)
        return ids

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, slice):
            return int(self[index:index + 1][0])
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("a BlockOrder slice takes step 1")
        out = []
        b = int(np.searchsorted(self.block_ends, start, side="right"))
        while start < stop:
            block_start = int(self.block_ends[b - 1]) if b else 0
            block = self._block(b)
            end = min(stop, int(self.block_ends[b]))
            out.append(block[start - block_start: end - block_start])
            start, b = end, b + 1
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_blocks": collections.OrderedDict()}


def _cut(slot_shards: np.ndarray, slot_counts: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots up to exactly `total` samples (the last one cut short)."""
    ends = np.cumsum(slot_counts)
    n = int(np.searchsorted(ends, total, side="left")) + 1 if total else 0
    counts = slot_counts[:n].copy()
    if n:
        counts[-1] -= int(ends[n - 1]) - total
    return slot_shards[:n], counts


def plain_order(shards: ShardSet, *, seed: int, epoch: int, shuffle: bool, num_samples: int | None = None,
                block_slots: int = BLOCK_SLOTS) -> BlockOrder:
    """Every shard once (a shuffled order when `shuffle`), cut at `num_samples` (a fresh subset each epoch)."""
    order = _rng(seed, epoch, _TAG_SLOTS).permutation(len(shards.sizes)) if shuffle else np.arange(len(shards.sizes))
    order = order[shards.sizes[order] > 0]
    slots = _cut(order, shards.sizes[order], int(shards.sizes.sum()) if num_samples is None else num_samples)
    return BlockOrder(shards, *slots, seed=seed, epoch=epoch, shuffle=shuffle, block_slots=block_slots)


def mixture_counts(source_sizes: np.ndarray, factors: tuple[float, ...], num_samples: int | None) -> list[int]:
    """Samples per source per epoch: proportional to factor x usable samples, summing to `num_samples` (default:
    the rounded sum of factor x samples), by largest remainder (ties to the first source)."""
    weights = [Fraction(f) * int(n) for f, n in zip(factors, source_sizes, strict=True)]
    total_weight = sum(weights)
    if total_weight == 0:
        raise ValueError("--train-data-upsampling-factors give every source with samples a factor of 0")
    total = round(total_weight) if num_samples is None else num_samples
    quotas = [total * w / total_weight for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_order(shards: ShardSet, factors: tuple[float, ...], *, seed: int, epoch: int,
                  num_samples: int | None = None, block_slots: int = BLOCK_SLOTS) -> BlockOrder:
    """Each source's exact share of the epoch (`mixture_counts`), its slots interleaved in proportion."""
    counts = mixture_counts(shards.source_sizes(), factors, num_samples)
    all_shards, all_counts, keys, sources = [], [], [], []
    for s, wanted in enumerate(counts):
        mine = np.flatnonzero((shards.source_ids == s) & (shards.sizes > 0))
        if wanted and not len(mine):
            raise ValueError(f"source {shards.source_names[s]!r} of --train-data has no usable samples")
        slot_shards, slot_counts, left, p = [], [], wanted, 0
        while left > 0:  # whole passes in fresh orders; the last one cut short
            order = mine[_rng(seed, epoch, _TAG_SLOTS, s, p).permutation(len(mine))]
            got, cnt = _cut(order, shards.sizes[order], min(left, int(shards.sizes[order].sum())))
            slot_shards.append(got)
            slot_counts.append(cnt)
            left -= int(cnt.sum())
            p += 1
        if not slot_shards:
            continue
        cnt = np.concatenate(slot_counts)
        before = np.cumsum(cnt) - cnt
        all_shards.append(np.concatenate(slot_shards))
        all_counts.append(cnt)
        keys.append((before + cnt / 2) / wanted)  # where in its own stream a slot falls: interleave by it
        sources.append(np.full(len(cnt), s))
    if not all_shards:
        return BlockOrder(shards, np.zeros(0, np.int64), np.zeros(0, np.int64), seed=seed, epoch=epoch, shuffle=True,
                          block_slots=block_slots)
    key, source = np.concatenate(keys), np.concatenate(sources)
    merged = np.lexsort((source, key))
    return BlockOrder(shards, np.concatenate(all_shards)[merged], np.concatenate(all_counts)[merged], seed=seed,
                      epoch=epoch, shuffle=True, block_slots=block_slots)


def resampled_order(shards: ShardSet, factors: tuple[float, ...] | None, *, seed: int, epoch: int,
                    num_samples: int, block_slots: int = BLOCK_SLOTS) -> BlockOrder:
    """Shards drawn with replacement, weight = the factor of the shard's source (uniform without factors), until
    `num_samples` samples; each drawn shard contributes all its samples (the last one a random subset)."""
    weights = np.ones(len(shards.sizes)) if factors is None else np.asarray(factors, np.float64)[shards.source_ids]
    weights = np.where(shards.sizes > 0, weights, 0.0)
    if not weights.sum() > 0:
        raise ValueError("no shard with usable samples has a positive --train-data-upsampling-factors weight")
    cdf = np.cumsum(weights / weights.sum())
    cdf /= cdf[-1]
    rng = _rng(seed, epoch, _TAG_DRAW)
    mean = float((weights * shards.sizes).sum() / weights.sum())
    drawn = np.zeros(0, np.int64)
    while int(shards.sizes[drawn].sum()) < num_samples:
        more = np.searchsorted(cdf, rng.random(int(num_samples / mean) + 16), side="right")
        drawn = np.concatenate([drawn, np.minimum(more, len(cdf) - 1)])
    slots = _cut(drawn, shards.sizes[drawn], num_samples)
    return BlockOrder(shards, *slots, seed=seed, epoch=epoch, shuffle=True, block_slots=block_slots)


@dataclass(frozen=True)
class ShardRecipe:
    """How an epoch is drawn from a shard set: plain, a mixture (`factors`) or `resampled`; `num_samples`: the
    epoch's samples (None: every shard once for plain; the planned shares for a mixture)."""

    shards: ShardSet
    factors: tuple[float, ...] | None = None
    resampled: bool = False
    num_samples: int | None = None
    block_slots: int = BLOCK_SLOTS  # shards (or Parquet row groups) whose samples are shuffled together

    def epoch_samples(self) -> int:
        """Samples of every epoch."""
        if self.resampled:
            return self.num_samples or int(self.shards.sizes.sum())
        if self.factors is not None:
            return sum(mixture_counts(self.shards.source_sizes(), self.factors, self.num_samples))
        return int(self.shards.sizes.sum()) if self.num_samples is None else self.num_samples

    def order(self, *, seed: int, epoch: int, shuffle: bool) -> BlockOrder:
        if self.resampled:
            return resampled_order(self.shards, self.factors, seed=seed, epoch=epoch,
                                   num_samples=self.epoch_samples(), block_slots=self.block_slots)
        if self.factors is not None:
            return mixture_order(self.shards, self.factors, seed=seed, epoch=epoch, num_samples=self.num_samples,
                                 block_slots=self.block_slots)
        return plain_order(self.shards, seed=seed, epoch=epoch, shuffle=shuffle, num_samples=self.num_samples,
                           block_slots=self.block_slots)
