"""The map-style loader: a `Source` (built-in, CSV, folder, indexed local shards) read by one global plan per epoch.

Every usable sample once per epoch whatever the workers, ranks and shards, `len()` microbatches on every rank, and
a position that continues at any world size. The main process sends each planned microbatch's sample indices to
the workers as tasks (`MapTasks`), so they start once per loader; indexing problems are recorded once per epoch,
by rank 0. docs/data.md#epochs.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from naflexclip.data import remote
from naflexclip.data.chunk_fetch import ChunkFetcher, fetched_tasks
from naflexclip.data.chunk_order import ORDER_VERSION, ChunkedRecipe
from naflexclip.data.loader import NaFlexLoader, logger, shut_down_workers
from naflexclip.data.microbatch import MicrobatchBuilder
from naflexclip.data.samples import SkipSample
from naflexclip.data.schedule import ScheduledBatch, build_global_plan, epoch_order, worker_batches
from naflexclip.data.shard_order import ShardRecipe
from naflexclip.data.source import RawSample, Source, skip_record

# what a worker is sent for one planned microbatch: the plan's entry, its samples' indices, its seed key
Task = tuple[ScheduledBatch, list[int], tuple[int, ...]]


class MapTasks(Dataset):
    """What the workers of a map-style loader do: build a planned microbatch from its samples' indices. The tasks
    come from the main process (`EpochTasks`), so the workers need nothing of an epoch and are kept across epochs.
    A worker never raises: its error is an item, raised by the loader as one DataError naming the source."""

    def __init__(self, source: Source, builder: MicrobatchBuilder) -> None:
        self.source, self.builder = source, builder
        self._pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None

    def _loads(self, indices: list[int]) -> list[RawSample | SkipSample]:
        """The samples, read `source.parallel_reads` at a time (object storage: a request each)."""
        parallel = getattr(self.source, "parallel_reads", 1)
        if parallel <= 1 or len(indices) < 2:
            return [self._load(i) for i in indices]
        if self._pool is None or self._pool[0] != os.getpid():  # threads do not survive a fork
            self._pool = os.getpid(), concurrent.futures.ThreadPoolExecutor(parallel)
        return list(self._pool[1].map(self._load, indices))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None}

    def _load(self, index: int) -> RawSample | SkipSample:
        try:
            raw: RawSample | SkipSample = self.source.load(index)
        except SkipSample as skip:
            raw = skip
        raw.notes = raw.notes + remote.take_notes()  # object storage reads retried for it
        return raw

    def __getitem__(self, task: Task | tuple[ScheduledBatch, list[int], tuple[int, ...], list[Any]]
                    ) -> dict[str, Any]:
        planned, indices, seed_key = task[:3]
        try:
            where = [self.source.describe(i) for i in indices]  # (a shard's index is read here, once, first)
            # read already from fetched chunks (`chunk_fetch`), or here
            raws = task[3] if len(task) > 3 else self._loads(indices)  # type: ignore[misc]
            samples = list(zip(raws, where, strict=True))
            notes = [note for raw, _ in samples for note in raw.notes]
            return self.builder.build(planned, samples, notes, seed_key)
        except Exception as exc:  # noqa: BLE001 - reported by the main process as one DataError
            return {"error": f"{type(exc).__name__}: {exc}"}


class EpochTasks:
    """The DataLoader's sampler: the tasks of the iteration about to start (set by the loader before each one)."""

    def __init__(self) -> None:
        self.tasks: Iterator[Task] = iter(())

    def __iter__(self) -> Iterator[Task]:
        return self.tasks


class MapLoader(NaFlexLoader):
    """One rank's epochs of a map-style `source`: `samples_per_epoch` of its usable samples (a fresh
    random subset each epoch when fewer than all; default all). With a shard `recipe` (`shard_order`), the
    epoch's order is the recipe's: a mixture, resampled shards, or a shard set too large for one permutation.
    With a `chunked` recipe (shards read in chunks, `chunk_order`), a shuffled epoch is its chunked order, its
    rows dealt to the ranks by stride; a checkpoint written before that order (no `order_version` in its state)
    continues on the one it was written with. The other arguments are `NaFlexLoader`'s."""

    indexed = True

    def __init__(self, source: Source, *, samples_per_epoch: int | None = None, recipe: ShardRecipe | None = None,
                 chunked: ChunkedRecipe | None = None, **kwargs: Any) -> None:
        self.source, self.recipe, self.chunked = source, recipe, chunked
        self.order_version = ORDER_VERSION if chunked is not None else 1
        self._loader: DataLoader | None = None  # made at the first iteration; its workers serve every epoch
        if chunked is not None:
            samples_per_epoch = chunked.epoch_samples()
        elif recipe is not None:
            samples_per_epoch = recipe.epoch_samples()
        super().__init__(name=source.name, samples_per_epoch=samples_per_epoch or len(source), **kwargs)

    @property
    def planned_sources(self) -> dict[str, int]:
        """Samples each `::` source contributes to this epoch, as planned (a mixture or resampled shards)."""
        if self.recipe is None or len(self.recipe.shards.source_names) < 2:
            return {}
        return self.order.source_counts()

    @property
    def is_chunked(self) -> bool:
        """This epoch is read in chunks (`chunk_order`)."""
        return self.chunked is not None and self.shuffle and self.order_version >= ORDER_VERSION

    def _plan(self, epoch: int, sample_position: int | None, start_batch: int) -> None:
        if self.is_chunked:
            assert self.chunked is not None
            self.order = self.chunked.order(seed=self.seed, epoch=epoch)
        elif self.recipe is not None:
            self.order = self.recipe.order(seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        else:
            order = epoch_order(len(self.source), seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                                group_size=self.source.group_size)
            self.order = order[: self.samples_per_epoch]  # --train-num-samples below the usable count
        rest = sample_position is not None  # only the rest of the epoch, re-planned at another world size
        self.plan = build_global_plan(len(self.order), self.world_size, self.budget, seed=self.seed, epoch=epoch,
                                      start_step=start_batch if rest else 0, start_sample=sample_position or 0,
                                      interleaved=self.is_chunked)
        self.schedule = self.plan.rank_batches(self.rank)

    @property
    def num_batches(self) -> int:
        return self.plan.num_steps

    def close(self) -> None:
        super().close()
        self._end_tasks()
        loader, self._loader = self._loader, None
        if loader is not None:
            shut_down_workers(loader)

    def _fetch(self, first: int) -> Iterator[dict[str, Any]]:
        try:
            yield from super()._fetch(first)
        finally:  # an iteration that stops early lets go of what was read ahead for it (fetched chunks)
            self._end_tasks()

    def _end_tasks(self) -> None:
        tasks = getattr(self, "_tasks", None)
        if tasks is not None and hasattr(tasks.tasks, "close"):
            tasks.tasks.close()

    def _dataloader(self, first: int) -> DataLoader:
        if self._loader is None:
            self._tasks = EpochTasks()
            self._map_tasks = MapTasks(self.source, self.builder)
            self._loader = self.data_loader(self._map_tasks, self._tasks, persistent=True)
        order, key = self.order, (self.seed, self.epoch, self.rank)
        batches = worker_batches(self.schedule, 0, 1, first)  # (lazily: an epoch may hold millions)
        fetch = self.is_chunked and self.chunked is not None and self.chunked.memory and \
            getattr(self.source, "parallel_reads", 1) > 1  # remote shards: read by chunk, here
        if fetch:
            batches = list(batches)  # the fetcher plans the whole epoch's chunks
        tasks = ((b, b.samples(order), (*key, b.index)) for b in batches)
        if fetch:
            assert self.chunked is not None
            fetcher = ChunkFetcher(self.source, order, batches, self.chunked.memory)
            if fetcher.peak > fetcher.memory:
                need = -(-fetcher.peak >> 20)
                logger.warning("data %s (%s) epoch %d rank %d: the chunked order keeps up to %d MiB of chunks in use "
                               "at once, over --fetch-memory %d MiB: a chunk that does not fit is read sample by "
                               "sample (a request each); raise --fetch-memory to %d", self.split, self.name,
                               self.epoch + 1, self.rank, need, fetcher.memory >> 20, need)
            tasks = fetched_tasks(fetcher, tasks, self._map_tasks._loads)
        self._tasks.tasks = tasks
        return self._loader

    def _epoch_start_records(self) -> list[dict[str, Any]]:
        if self.rank != 0:
            return []
        records = list(self.source.index_skips)
        for index in self.order[len(self.order) - self.plan.dropped:].tolist():
            source, key, line = self.source.describe(index)
            records.append(skip_record(source, key, line, "epoch_remainder", "fewer samples than ranks"))
        return records

    def _sample_position_at(self, planned: int) -> int | None:
        return self.plan.step_start(planned)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "order_version": self.order_version}

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """As `NaFlexLoader.load_state_dict`; the run continues on the order its state was written with (a state
        from before chunked orders has no `order_version`: version 1)."""
        first = state[0] if isinstance(state, list) else state
        if self.chunked is not None:
            self.order_version = min(ORDER_VERSION, int(first.get("order_version", 1)))
        super().load_state_dict(state)

    def _shard_versions(self) -> dict[str, str]:
        versions: dict[str, str] = {}
        for part in getattr(self.source, "sources", [self.source]):
            versions.update(part.shard_versions() if hasattr(part, "shard_versions") else {})
        return versions

    def _pin_shard_versions(self, saved: dict[str, str]) -> None:
        changed = [c for part in getattr(self.source, "sources", [self.source]) if hasattr(part, "pin_versions")
                   for c in part.pin_versions(saved)]
        if changed and self.rank == 0:
            url, was, now = changed[0]
            logger.warning("data %s (%s): %d shard%s changed since the checkpoint, read as shard_changed (never "
                           "its new data), e.g. %s: version %s, now %s", self.split, self.name, len(changed),
                           "" if len(changed) == 1 else "s", url, was, now)
