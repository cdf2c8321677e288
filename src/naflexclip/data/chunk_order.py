"""Chunked epoch orders over shards: an epoch's samples in an order that reads each shard in large pieces.

A *chunk* is a run of consecutive samples of one tar shard, about `--fetch-chunk-size` bytes: a shard of B bytes
and S samples is cut into n = clip(ceil(B / size), 1, S) chunks of S/n samples (rounded: `shard_chunks`). The
epoch's slots (a `ShardRecipe`'s: plain, a mixture, resampled) become chunks, and then, from (seed, epoch) alone:

1. the chunks are permuted;
2. their samples, in that order, are cut into C = min(--fetch-streams, chunks) *streams* of N/C samples (a chunk
   the cut falls in belongs to two neighbouring streams);
3. each stream's samples are shuffled in blocks of `WINDOW_CHUNKS` chunks' worth of samples;
4. global position t is sample t // C of stream t mod C.

Every sample of the slots is at one position, so an epoch is still a permutation of its planned samples, a source's
share is the recipe's exactly, and a global position means the same at any world size. With the plan's rows dealt
to ranks by stride (`schedule.build_global_plan(interleaved=True)`: rank r of R takes the positions r mod R of every
step), rank r reads only the streams s = r mod gcd(R, C): when R divides C, each chunk's samples go to one rank.
docs/data.md#the-chunked-order.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np

from naflexclip.data.shard_order import BlockOrder, ShardRecipe

ORDER_VERSION = 2  # 1: every sample shuffled over the epoch (a permutation, or `shard_order`'s blocks); 2: chunked
WINDOW_CHUNKS = 2  # a stream's samples are shuffled in blocks of this many chunks' worth
_TAG_CHUNKS, _TAG_SUBSET, _TAG_WINDOW = 0xC4C5, 0xC5B5, 0xC3D0


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([k & 0xFFFFFFFF for k in key]))


def shard_chunks(sample_counts: np.ndarray, shard_bytes: np.ndarray | None, chunk_bytes: int) -> np.ndarray:
    """Chunks per shard: ceil(bytes / chunk_bytes), at least 1 and at most its samples (1 where bytes are unknown:
    `shard_bytes` None or < 0)."""
    sample_counts = np.asarray(sample_counts, np.int64)
    if shard_bytes is None:
        return np.ones(len(sample_counts), np.int64)
    wanted = -(-np.asarray(shard_bytes, np.int64) // max(1, chunk_bytes))
    return np.clip(wanted, 1, np.maximum(sample_counts, 1)).astype(np.int64)


class ChunkOrder:
    """An epoch's order of sample ids (see the module's docstring), from a recipe's slots and its shards' chunks.

    `len()`, `order[a:b]` and `take(positions)` as a `BlockOrder`'s; `chunk_of(positions)` the chunk each position
    reads, `chunk_span(c)` that chunk's (shard, first sample in the shard, samples)."""

    def __init__(self, slots: BlockOrder, chunks_per_shard: np.ndarray, *, streams: int, seed: int,
                 epoch: int) -> None:
        self.shards, self.seed, self.epoch = slots.shards, seed, epoch
        self._slot_shards, self._slot_counts = slots.slot_shards, slots.slot_counts
        sizes = slots.shards.sizes
        shard, first, count = [], [], []
        full = self._slot_counts >= sizes[self._slot_shards]
        whole = self._slot_shards[full]
        n = chunks_per_shard[whole]
        if len(whole):  # every chunk of each slot that takes its whole shard, vectorised
            chunk_shard = np.repeat(whole, n)
            j = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
            per = chunks_per_shard[chunk_shard]
            s = sizes[chunk_shard]
            lo, hi = j * s // per, (j + 1) * s // per
            shard.append(chunk_shard)
            first.append(lo)
            count.append(hi - lo)
        for k in np.flatnonzero(~full).tolist():  # a slot cut short: a fresh random subset of the shard's chunks
            h, want = int(self._slot_shards[k]), int(self._slot_counts[k])
            per, s = int(chunks_per_shard[h]), int(sizes[h])
            lo = np.arange(per, dtype=np.int64) * s // per
            hi = (np.arange(per, dtype=np.int64) + 1) * s // per
            pick = _rng(seed, epoch, _TAG_SUBSET, k).permutation(per)
            sizes_picked = hi[pick] - lo[pick]
            took = np.minimum(sizes_picked, np.maximum(0, want - (np.cumsum(sizes_picked) - sizes_picked)))
            keep = took > 0
            shard.append(np.full(int(keep.sum()), h, np.int64))
            first.append(lo[pick][keep])
            count.append(took[keep])
        cat = (lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64))
        shard_a, first_a, count_a = cat(shard), cat(first), cat(count)
        perm = _rng(seed, epoch, _TAG_CHUNKS).permutation(len(shard_a))
        self.chunk_shard, self.chunk_first, self.chunk_count = shard_a[perm], first_a[perm], count_a[perm]
        self.chunk_ends = np.cumsum(self.chunk_count).astype(np.int64)
        self.total = int(self.chunk_ends[-1]) if len(self.chunk_ends) else 0
        self.streams = max(1, min(streams, len(self.chunk_count)))
        mean_chunk = self.total / max(1, len(self.chunk_count))
        self.window = max(1, round(WINDOW_CHUNKS * mean_chunk))  # samples shuffled together in a stream
        self._starts = slots.shards.starts
        self._windows: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return self.total

    def source_counts(self) -> dict[str, int]:
        """Samples each source contributes to this epoch, by source name."""
        counts = np.bincount(self.shards.source_ids[self._slot_shards], weights=self._slot_counts,
                             minlength=len(self.shards.source_names))
        return {name: int(c) for name, c in zip(self.shards.source_names, counts, strict=True)}

    def _stream_length(self, s: np.ndarray) -> np.ndarray:
        return self.total // self.streams + (s < self.total % self.streams)

    def _stream_start(self, s: np.ndarray) -> np.ndarray:
        return s * (self.total // self.streams) + np.minimum(s, self.total % self.streams)

    def _window(self, s: int, b: int) -> np.ndarray:
        key = (s, b)
        if key not in self._windows:
            length = int(self._stream_length(np.asarray(s)))
            size = min(self.window, length - b * self.window)
            self._windows[key] = _rng(self.seed, self.epoch, _TAG_WINDOW, s, b).permutation(size)
            while len(self._windows) > 4 * self.streams:  # a step reads about one window of each stream
                self._windows.popitem(last=False)
        return self._windows[key]

    def _flat(self, positions: np.ndarray) -> np.ndarray:
        """Each position's place in the permuted chunks' samples laid end to end."""
        positions = np.asarray(positions, np.int64)
        if len(positions) and (positions.min() < 0 or positions.max() >= self.total):
            raise IndexError(f"positions outside [0, {self.total})")
        s, j = positions % self.streams, positions // self.streams
        b = j // self.window
        inner = np.empty_like(j)
        keys, group = np.unique(s * (self.total // self.window + 1) + b, return_inverse=True)
        by_group = np.argsort(group, kind="stable")
        bounds = np.searchsorted(group[by_group], np.arange(len(keys) + 1))
        for g in range(len(keys)):  # each (stream, window) the positions fall in
            rows = by_group[bounds[g]:bounds[g + 1]]
            sg, bg = int(s[rows[0]]), int(b[rows[0]])
            inner[rows] = self._window(sg, bg)[j[rows] - bg * self.window]
        return self._stream_start(s) + b * self.window + inner

    def chunk_of(self, positions: np.ndarray) -> np.ndarray:
        """The chunk (an index into `chunk_shard`, ...) each position's sample is in."""
        return np.searchsorted(self.chunk_ends, self._flat(positions), side="right").astype(np.int64)

    def take(self, positions: np.ndarray) -> np.ndarray:
        """The sample ids at `positions` (int64)."""
        flat = self._flat(positions)
        c = np.searchsorted(self.chunk_ends, flat, side="right")
        within = flat - (self.chunk_ends[c] - self.chunk_count[c])
        return self._starts[self.chunk_shard[c]] + self.chunk_first[c] + within

    def chunk_span(self, c: int) -> tuple[int, int, int]:
        """Chunk `c`'s shard, its first sample within the shard and its samples."""
        return int(self.chunk_shard[c]), int(self.chunk_first[c]), int(self.chunk_count[c])

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, slice):
            return int(self.take(np.asarray([index]))[0])
        return self.take(np.arange(*index.indices(self.total), dtype=np.int64))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_windows": collections.OrderedDict()}


class ChunkedRecipe:
    """How a shard source's epochs are chunked: its `recipe` (which slots an epoch draws), each shard's chunk count
    (`shard_chunks`) and the stream count C (`--fetch-streams`)."""

    def __init__(self, recipe: ShardRecipe, chunks_per_shard: np.ndarray, streams: int, memory: int = 0) -> None:
        """`memory`: bytes a rank holds fetched chunks in (`chunk_fetch`; 0: samples are read one by one)."""
        if streams < 1:
            raise ValueError(f"--fetch-streams must be >= 1, got {streams}")
        self.recipe, self.chunks_per_shard, self.streams = recipe, np.asarray(chunks_per_shard, np.int64), streams
        self.memory = memory

    def epoch_samples(self) -> int:
        return self.recipe.epoch_samples()

    def order(self, *, seed: int, epoch: int) -> ChunkOrder:
        slots = self.recipe.order(seed=seed, epoch=epoch, shuffle=True)
        return ChunkOrder(slots, self.chunks_per_shard, streams=self.streams, seed=seed, epoch=epoch)


def same_chunk_pairs(chunks: np.ndarray) -> float:
    """The share of a microbatch's sample pairs that come from one chunk (`chunks`: each row's chunk id)."""
    n = len(chunks)
    if n < 2:
        return 0.0
    _, counts = np.unique(chunks, return_counts=True)
    return float((counts * (counts - 1)).sum() / (n * (n - 1)))


def source_shard_bytes(source: Any) -> np.ndarray:
    """Bytes of each shard of a tar shard source, as chunks are cut from them: an indexed shard's up to its last
    sample's data, a listed one's size (the listing's, or the file's), -1 where unknown."""
    if hasattr(source, "offsets") and hasattr(source, "shard_ids"):  # every shard indexed at startup
        starts, sizes = source.offsets[:, 0::2], source.offsets[:, 1::2]
        ends = np.where(starts >= 0, starts + sizes, 0).max(axis=1, initial=0)
        found = np.full(len(source.urls), -1, np.int64)
        np.maximum.at(found, source.shard_ids, ends)
        return found
    # planned from sizes.json
    return np.asarray([_listed_bytes(url, source.pins) for url in source.urls], np.int64)


def _listed_bytes(url: str, pins: dict[str, dict[str, Any]]) -> int:
    if url in pins:
        return int(pins[url]["size"])
    try:
        return os.path.getsize(url)
    except OSError:
        return -1
