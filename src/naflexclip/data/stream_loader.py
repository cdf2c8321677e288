"""The streamed loader: WebDataset shards that cannot be indexed (`pipe:`, compressed tars, URLs not ending in `.tar`).

An epoch is `samples_per_epoch` samples split by (rank, worker) slot: by shard when there are at least as many
shards as slots, else by sample. Each slot cycles its shards, with a per-pass shuffle buffer, so a sample can
repeat or be missed within an epoch; resume is exact for the same world size and workers.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import webdataset as wds
from torch.utils.data import DataLoader

from naflexclip.data.loader import NaFlexLoader, WorkerEpoch
from naflexclip.data.schedule import build_schedule, samples_per_rank
from naflexclip.data.shards import DEFAULT_MEMBER_KEYS, MemberKeys, ShardReadLog, shard_samples
from naflexclip.data.source import DataError, RawSample

_RESAMPLED = 0x2E5A


class StreamEpoch(WorkerEpoch):
    """A worker's planned microbatches of a streamed epoch, filled from its slot's stream in plan order."""

    def __init__(self, loader: StreamLoader, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.urls, self.name, self.shuffle = loader.urls, loader.name, loader.shuffle
        self.buffer = loader.shuffle_buffer if loader.shuffle else 0
        self.rank, self.world_size = loader.rank, loader.world_size
        self.resampled, self.shard_weights = loader.resampled, loader.shard_weights
        self.member_keys = loader.member_keys

    def _resampled_stream(self, slot: int, log: ShardReadLog) -> Iterator[RawSample]:
        """Shards drawn with replacement, each read whole through the shuffle buffer, for as long as needed."""
        seed, epoch, _ = self.seed_key
        rng = random.Random(hash((seed, epoch, slot, _RESAMPLED)))  # ints only: the same hash in every process
        empty_in_row = 0
        for draw in itertools.count():
            url = rng.choices(self.urls, weights=self.shard_weights)[0]
            samples: Iterator[RawSample] = shard_samples(url, log, self.member_keys)
            if self.buffer > 1:
                samples = wds.shuffle(self.buffer, self.buffer, rng=random.Random(hash((seed, epoch, slot, draw))))(
                    samples)
            produced = 0
            for raw in samples:
                produced += 1
                yield raw
            empty_in_row = 0 if produced else empty_in_row + 1
            if empty_in_row > 10 * len(self.urls) + 100:
                raise DataError(f"no sample could be read from the shards of {self.name!r}")

    def _slot_stream(self, slot: int, num_slots: int, log: ShardReadLog) -> Iterator[RawSample]:
        if self.resampled:
            yield from self._resampled_stream(slot, log)
            return
        seed, epoch, _ = self.seed_key
        urls = list(self.urls)
        if self.shuffle:
            random.Random(hash((seed, epoch))).shuffle(urls)
        by_shard = len(urls) >= num_slots
        for pass_index in itertools.count():
            pass_seed = hash((seed, epoch, pass_index, slot))
            # a slot keeps its shards for the whole epoch; a wrap-around pass only reorders them
            mine = urls[slot::num_slots] if by_shard else list(urls)
            if self.shuffle and pass_index > 0:
                random.Random(pass_seed).shuffle(mine)
            samples = (raw for url in mine for raw in shard_samples(url, log, self.member_keys))
            if not by_shard:  # fewer shards than slots: every slot reads all, keeps every num_slots-th
                samples = (raw for k, raw in enumerate(samples) if k % num_slots == slot)
            if self.buffer > 1:  # the buffer drains at the end of each pass, so a pass never leaks into the next
                samples = wds.shuffle(self.buffer, self.buffer, rng=random.Random(pass_seed))(samples)
            produced = 0
            for raw in samples:
                produced += 1
                yield raw
            if produced == 0:
                if by_shard:
                    by_shard = False  # this slot's shards are empty; share all shards instead
                    continue
                raise DataError(f"no sample could be read from the shards of {self.name!r}")

    def batches(self, worker_id: int) -> Iterator[dict[str, Any]]:
        # stream v feeds planned microbatches with index % K == v; continuing at `first`, worker w builds
        # first + w + jK, all fed by stream (first + w) % K
        stream_id = (self.first + worker_id) % self.workers
        log = ShardReadLog()
        stream = _read_ahead(self._slot_stream(self.rank * self.workers + stream_id,
                                               self.world_size * self.workers, log))
        reported = 0
        for planned in self.schedule.strided(stream_id, self.workers):
            raws = list(itertools.islice(stream, planned.batch_size))
            if planned.index < self.first:
                continue  # consumed undecoded: the stream's place is restored
            records, reported = log.records[reported:], len(log.records)
            samples = [(raw, (raw.key.rpartition(":")[0], raw.key.rpartition(":")[2], None)) for raw in raws]
            yield self.builder.build(planned, samples, records, (*self.seed_key, planned.index))
        if len(log.records) > reported:
            yield {"skips": log.records[reported:]}  # problems found after the last microbatch was filled


def _read_ahead(items: Iterator[RawSample]) -> Iterator[RawSample]:
    """Yield each item only once the next one is read, so a shard's read error is logged with its last sample."""
    previous = next(items, None)
    for item in items:
        yield previous
        previous = item
    if previous is not None:
        yield previous


class StreamLoader(NaFlexLoader):
    """One rank's epochs of `samples_per_epoch` samples streamed from the shards `urls` (`name`: the shard spec);
    `shuffle_buffer`: samples in each slot's shuffle buffer; `member_keys`: a sample's image and caption members;
    `resampled`: each slot draws its shards with replacement (weights `shard_weights`, OpenCLIP's
    `ResampledShards2`), from (seed, epoch, slot). The other arguments are `NaFlexLoader`'s."""

    indexed = False

    def __init__(self, urls: list[str], *, shuffle_buffer: int, member_keys: MemberKeys = DEFAULT_MEMBER_KEYS,
                 resampled: bool = False, shard_weights: list[float] | None = None, **kwargs: Any) -> None:
        self.urls, self.shuffle_buffer, self.member_keys = urls, shuffle_buffer, member_keys
        self.resampled, self.shard_weights = resampled, shard_weights
        super().__init__(**kwargs)

    def _plan(self, epoch: int, sample_position: int | None, start_batch: int) -> None:
        # each rank plans its share of the epoch's samples
        self.schedule = build_schedule(samples_per_rank(self.samples_per_epoch, self.world_size), self.budget,
                                       seed=self.seed, epoch=epoch)

    @property
    def num_batches(self) -> int:
        return len(self.schedule)

    def _dataloader(self, first: int) -> DataLoader:
        # a stream's position lives in its workers' iterators: they start over with each epoch
        return self.data_loader(StreamEpoch(self, schedule=self.schedule, first=first, workers=self.workers,
                                            builder=self.builder, seed_key=(self.seed, self.epoch, self.rank)))
