"""Chunks of remote shards fetched ahead, in the order the rank's plan reads them, each in one ranged request.

A rank's main process knows its microbatches of the epoch (`chunk_order.ChunkOrder`, the interleaved plan), so it
knows which chunk each of its samples is in, when it is first needed and when for the last time. `ChunkFetcher`
requests the chunks in first-use order, `IN_FLIGHT` at a time, while what it holds and has asked for stays within
`--fetch-memory`; a chunk is dropped at its last use. A remote read of a shard's sample (`remote.read_spans`) that
falls in a held chunk is served from it (`remote.range_cache`, while the epoch is read), so the samples are read in
the main process and handed to the workers, which only decode. Every chunk read goes through `remote.read_range`:
retries counted as `read_retry` notes, the pinned version checked, a failure raised to each of its samples' reads.
docs/data.md#the-chunked-order.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

from naflexclip.data import remote
from naflexclip.data.chunk_order import ChunkOrder
from naflexclip.data.schedule import ScheduledBatch

IN_FLIGHT = 32  # chunk requests at once: an epoch starts with a chunk of each stream (64), latency bounds each


def chunk_range(source: Any, order: ChunkOrder, c: int) -> tuple[str, str | None, int, int] | None:
    """(url, pinned version, start, end) of the bytes chunk `c` spans in its shard; None when it is not a remote
    tar shard's, or its shard cannot be read (its samples' reads say why)."""
    shard, first, count = order.chunk_span(c)
    first_id = int(order.shards.starts[shard]) + first
    if hasattr(source, "offsets") and hasattr(source, "shard_ids"):  # every shard indexed at startup
        if shard in source.changed:
            return None
        url, version = source.urls[shard], source.versions[shard]
        rows = source.offsets[first_id: first_id + count]
    elif hasattr(source, "bounds") and hasattr(source, "locate"):  # planned from sizes.json
        url = source.urls[shard]
        index = source.locate(int(source.bounds[shard]))[2]
        if index.status != "ok" and index.status != "truncated":
            return None
        version, rows = index.version, index.offsets[first: first + count]
    else:
        return None
    if not remote.is_remote(url) or not len(rows):
        return None
    starts, sizes = rows[:, 0::2], rows[:, 1::2]
    present = starts >= 0
    if not present.any():
        return None
    return url, version, int(starts[present].min()), int((starts + sizes)[present].max())


class ChunkFetcher:
    """The chunks of a rank's microbatches from some point on, fetched ahead within `memory` bytes (see the
    module's docstring). Opened as a `remote.range_cache` while the epoch's samples are read; `close()` ends it."""

    def __init__(self, source: Any, order: ChunkOrder, batches: list[ScheduledBatch], memory: int) -> None:
        self.source, self.order, self.memory = source, order, memory
        self.batch_chunks = [np.unique(order.chunk_of(b.positions())).tolist() for b in batches]
        self.uses = Counter(c for chunks in self.batch_chunks for c in chunks)
        self.first_use = list(dict.fromkeys(c for chunks in self.batch_chunks for c in chunks))
        self.ranges = {c: chunk_range(source, order, c) for c in self.first_use}
        self.peak = _peak_bytes(self.batch_chunks, {c: _size(span) for c, span in self.ranges.items()})
        self.next = 0  # the next chunk of `first_use` to request
        self.held: dict[int, concurrent.futures.Future] = {}
        self.by_sample: set[int] = set()  # needed when the budget was full: their samples are read one by one
        self.by_url: dict[tuple[str, str | None], list[tuple[int, int, int]]] = {}  # sorted (start, end, chunk)
        self.bytes_held = self.most_held = 0
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(IN_FLIGHT)

    def _request(self, c: int) -> bool:
        """Request chunk `c` if the budget allows (True: it is held or asked for, or has no range to fetch)."""
        span = self.ranges[c]
        if span is None or c in self.held:
            return True
        url, version, start, end = span
        if self.bytes_held + end - start > self.memory:
            return False
        self.held[c] = self.pool.submit(remote.read_range, url, start, end, version)
        bisect.insort(self.by_url.setdefault((url, version), []), (start, end, c))
        self.bytes_held += end - start
        self.most_held = max(self.most_held, self.bytes_held)
        return True

    def ahead(self, batch: int) -> None:
        """Request batch `batch`'s chunks (one that does not fit the budget now is read sample by sample for the
        rest of the epoch: no byte is fetched twice), then the next ones by first use while the budget allows."""
        with self.lock:
            for c in self.batch_chunks[batch]:
                if c not in self.by_sample and not self._request(c):
                    self.by_sample.add(c)
            while self.next < len(self.first_use):
                c = self.first_use[self.next]
                if c not in self.by_sample and self.uses[c] > 0 and not self._request(c):
                    break
                self.next += 1

    def done(self, batch: int) -> None:
        """Batch `batch`'s samples are read: a chunk at its last use is dropped."""
        with self.lock:
            for c in self.batch_chunks[batch]:
                self.uses[c] -= 1
                if self.uses[c] == 0 and c in self.held:
                    url, version, start, end = self.ranges[c]  # type: ignore[misc]
                    self.by_url[(url, version)].remove((start, end, c))
                    del self.held[c]
                    self.bytes_held -= end - start

    def get(self, url: str, version: str | None, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of `url` from a held chunk (waiting for its request), else None (read it alone).
        A chunk whose request failed raises its error (`remote.Unreachable`, `remote.Changed`)."""
        with self.lock:
            spans = self.by_url.get((url, version), [])
            i = bisect.bisect_right(spans, (start, float("inf"), 0)) - 1
            if i < 0 or spans[i][1] < end:
                return None
            chunk_start, _, c = spans[i]
            future = self.held[c]
        data = future.result()
        return data[start - chunk_start: end - chunk_start]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _size(span: tuple[str, str | None, int, int] | None) -> int:
    return 0 if span is None else span[3] - span[2]


def _peak_bytes(batch_chunks: list[list[int]], sizes: dict[int, int]) -> int:
    """The most bytes of chunks in use at once (from a chunk's first batch to its last) over the batches."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, chunks in enumerate(batch_chunks):
        for c in chunks:
            first.setdefault(c, k)
            last[c] = k
    change = np.zeros(len(batch_chunks) + 1, np.int64)
    for c, k in first.items():
        change[k] += sizes[c]
        change[last[c] + 1] -= sizes[c]
    return int(np.cumsum(change).max(initial=0))


def fetched_tasks(fetcher: ChunkFetcher, tasks: Iterator[tuple[ScheduledBatch, list[int], tuple[int, ...]]],
                  load: Any) -> Iterator[tuple[ScheduledBatch, list[int], tuple[int, ...], list[Any]]]:
    """`tasks` with their samples read (`load(indices)`) from the fetched chunks, in this process."""
    try:
        with remote.range_cache(fetcher):
            for k, (planned, indices, seed_key) in enumerate(tasks):
                fetcher.ahead(k)
                raws = load(indices)
                fetcher.done(k)
                yield planned, indices, seed_key, raws
    finally:
        fetcher.close()
