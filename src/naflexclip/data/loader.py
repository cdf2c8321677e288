"""The NaFlex loader: source -> decode -> timm NaFlex transform -> token-budget microbatches, in workers.

`build_loader` plans one epoch, the same plan on every rank, and torch DataLoader workers build
the planned microbatches round-robin (worker w builds batches w, w+K, ...), which the DataLoader
returns in plan order. Map-style sources (built-in, CSV, folder, indexed local shards) follow one
global plan (`schedule.build_global_plan`): one permutation of the usable samples per epoch, cut into
steps of one microbatch per rank, so an epoch is every usable sample once whatever the workers, ranks
and shards. Bad samples are left out of their microbatch; every skip rides back to the main process
inside its item as a record (source, key, line, reason), and a microbatch left empty is covered by
splitting a neighbour on the same rank (`NaFlexLoader.__iter__`), so every rank yields the planned
number of microbatches. A worker never raises: it sends its error as an item and the main process
raises one `DataError` that names the data source.

Streams that cannot be indexed (`pipe:`, URLs, compressed tars) are split by (rank, worker) slot - by
shard when there are enough shards, else by sample - each slot cycling its shards with a per-pass
shuffle buffer; there, resume is exact for the same world size and workers.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.filters import _shuffle

from naflexclip.data.config import DataConfig
from naflexclip.data.processing import make_processing
from naflexclip.data.readers import (
    CsvSource,
    DataError,
    FolderSource,
    RawSample,
    ShardReadLog,
    SyntheticSource,
    ZeroShotSource,
    check_shards,
    count_shard_samples,
    expand_shards,
    shard_samples,
    skip_record,
)
from naflexclip.data.samples import SkipSample, decode_caption, decode_image
from naflexclip.data.schedule import (
    ScheduledBatch,
    build_global_plan,
    build_schedule,
    epoch_order,
    samples_per_rank,
    worker_batches,
)
from naflexclip.data.shard_index import IndexedShardSource, is_indexable

logger = logging.getLogger("naflexclip.data")
# an item is emitted once the item this many places later has arrived: an empty microbatch is then covered
# by splitting a neighbour on either side of it (held host memory: this many microbatches)
HOLD_BACK = 2
# the epoch's last microbatches are all held until the end, so empty ones there are covered too
END_HOLD = 4


class _EpochBatches(IterableDataset):
    """One rank's epoch of planned microbatches; each DataLoader worker builds its share (round-robin)."""

    def __init__(self, loader: NaFlexLoader, first_item: int) -> None:
        super().__init__()
        self.source = loader.source
        self.shard_urls = loader.shard_urls
        self.source_name = loader.source_name
        self.schedule = loader.schedule
        self.order = loader.order
        self.patch_size = loader.patch_size
        self.context_length = loader.context_length
        self.seed, self.epoch = loader.seed, loader.epoch
        self.rank, self.world_size = loader.rank, loader.world_size
        self.start_batch = first_item
        self.num_workers = max(1, loader.num_workers)
        self.shuffle = loader.shuffle
        self.shuffle_buffer = loader.shuffle_buffer
        self.processing = make_processing(loader.hf_processor, loader.patch_size, loader.augment)
        self.transform = self.processing.transform

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker_id = info.id if info is not None else 0
        try:
            if self.source is not None:
                yield from self._map_batches(worker_id)
            else:
                yield from self._stream_batches(worker_id)
        except Exception as exc:  # noqa: BLE001 - reported by the main process as one DataError
            yield {"error": f"{type(exc).__name__}: {exc}"}

    # -- building one microbatch -------------------------------------------------------------
    def _build(self, planned: ScheduledBatch, raws: list[RawSample | SkipSample], where: list[tuple],
               skips: list[dict[str, Any]]) -> dict:
        """Decode and collate `raws` (`where[i]`: (source, key, line) for the skip log); bad ones are left out."""
        random.seed(hash((self.seed, self.epoch, self.rank, planned.index)))  # augment RNG, resumable
        draft = lambda hw: self.transform.target_hw(hw, planned.seq_len)
        pixels, texts, labels, keys = [], [], [], []
        for raw, (source, key, line) in zip(raws, where, strict=True):
            try:
                if isinstance(raw, SkipSample):
                    raise raw
                image = raw.image if isinstance(raw.image, Image.Image) else decode_image(raw.image, draft)
                caption = decode_caption(raw.caption)
                pixels.append(self.transform(image, planned.seq_len))
            except SkipSample as skip:
                skips.append(skip_record(source, key, line, skip.reason, str(skip)))
                continue
            texts.append(caption)
            keys.append(raw.key)
            if raw.labels is not None:
                labels.append(raw.labels)
        item: dict[str, Any] = {"batch_index": planned.index, "skips": list(skips)}
        skips.clear()
        if not pixels:
            item["empty"] = True
            return item
        item["image"] = self.processing.collate(pixels, planned.seq_len, self.patch_size)
        item["text"] = self.processing.tokenize(texts, self.context_length)
        item["keys"] = keys
        item["seq_len"] = planned.seq_len
        item["num_tokens"] = int(item["image"]["patch_valid"].sum())
        if labels:
            item["labels"] = {k: torch.tensor([lab[k] for lab in labels]) for k in labels[0]}
        return item

    # -- map-style sources (built-in, CSV, folder, indexed shards) ------------------------------
    def _load(self, index: int) -> RawSample | SkipSample:
        try:
            return self.source.load(int(index))
        except SkipSample as skip:
            return skip

    def _map_batches(self, worker_id: int) -> Iterator[dict[str, Any]]:
        for planned in worker_batches(self.schedule, worker_id, self.num_workers, self.start_batch):
            indices = self.order[planned.offset: planned.offset + planned.batch_size]
            where = [self.source.describe(int(i)) for i in indices]
            yield self._build(planned, [self._load(i) for i in indices], where, [])

    # -- WebDataset streams that cannot be indexed ------------------------------------------------
    def _slot_stream(self, slot: int, num_slots: int, log: ShardReadLog) -> Iterator[RawSample]:
        urls = list(self.shard_urls)
        if self.shuffle:
            random.Random(hash((self.seed, self.epoch))).shuffle(urls)
        by_shard = len(urls) >= num_slots
        for pass_index in itertools.count():
            pass_seed = hash((self.seed, self.epoch, pass_index, slot))
            # a slot keeps its shards for the whole epoch; a wrap-around pass only reorders them
            mine = urls[slot::num_slots] if by_shard else list(urls)
            if self.shuffle and pass_index > 0:
                random.Random(pass_seed).shuffle(mine)
            samples = (raw for url in mine for raw in shard_samples(url, log))
            if not by_shard:  # fewer shards than slots: every slot reads all, keeps every num_slots-th
                samples = (raw for k, raw in enumerate(samples) if k % num_slots == slot)
            if self.shuffle and self.shuffle_buffer > 1:
                # the buffer drains at the end of each pass, so a pass never leaks into the next
                samples = _shuffle(samples, self.shuffle_buffer, self.shuffle_buffer, random.Random(pass_seed))
            produced = 0
            for raw in samples:
                produced += 1
                yield raw
            if produced == 0:
                if by_shard:
                    by_shard = False  # this slot's shards are empty; share all shards instead
                    continue
                raise DataError(f"no sample could be read from the shards of {self.source_name!r}")

    def _stream_batches(self, worker_id: int) -> Iterator[dict[str, Any]]:
        # stream v feeds batches with index % K == v; after a resume at start_batch, worker w
        # builds batches start_batch + w + jK, all fed by stream (start_batch + w) % K
        stream_id = (self.start_batch + worker_id) % self.num_workers
        log = ShardReadLog()
        stream = _read_ahead(self._slot_stream(self.rank * self.num_workers + stream_id,
                                               self.world_size * self.num_workers, log))
        reported = 0
        for planned in self.schedule:
            if planned.index % self.num_workers != stream_id:
                continue
            raws = list(itertools.islice(stream, planned.batch_size))
            if planned.index < self.start_batch:
                continue  # consumed undecoded: the stream's place is restored
            new, reported = log.records[reported:], len(log.records)
            where = [(raw.key.rsplit(":", 1)[0], raw.key.rsplit(":", 1)[-1], None) for raw in raws]
            yield self._build(planned, raws, where, list(new))
        if len(log.records) > reported:
            yield {"empty": True, "batch_index": -1, "skips": log.records[reported:]}


def _read_ahead(items: Iterator[RawSample]) -> Iterator[RawSample]:
    """Yield each item only once the next one is read, so a shard's read error is logged with its last sample."""
    previous = next(items, None)
    for item in items:
        yield previous
        previous = item
    if previous is not None:
        yield previous


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)  # workers parallelise across processes, not inside one


def _split_rows(item: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A collated microbatch cut into `parts` consecutive microbatches of nearly equal rows (larger first)."""
    rows = item["text"].shape[0]
    bounds = [0]
    for r in range(parts):
        bounds.append(bounds[-1] + rows // parts + (1 if r < rows % parts else 0))
    pieces = []
    for lo, hi in itertools.pairwise(bounds):
        image = {k: v[lo:hi] for k, v in item["image"].items()}
        piece = {**item, "image": image, "text": item["text"][lo:hi], "keys": item["keys"][lo:hi],
                 "num_tokens": int(image["patch_valid"].sum())}
        if "labels" in item:
            piece["labels"] = {k: v[lo:hi] for k, v in item["labels"].items()}
        pieces.append(piece)
    return pieces


class NaFlexLoader:
    """Iterable over one epoch of NaFlex microbatches for one rank.

    Each item: {"image": {"patches": float32 [B, L, P*P*3], "patch_coord": long [B, L, 2] (row, col),
    "patch_valid": bool [B, L]}, "text": long [B, T], "seq_len": L, "num_tokens": int,
    "batch_index": int, "keys": list[str] (sample ids), and "labels" for the zero-shot loader}.
    B varies from batch to batch; L is the batch's scheduled sequence length.

    Map-style sources (built-in, CSV, folder, indexed local shards) follow one global plan: one
    permutation of the usable samples per epoch, cut into steps of one microbatch per rank
    (`schedule.build_global_plan`), so every usable sample is read exactly once per epoch whatever the
    workers and ranks, and every rank has `len()` microbatches. A sample found broken at decode time
    leaves its microbatch smaller; a microbatch left with no sample takes rows from its neighbour on the
    same rank (the microbatch before it, or the next one), so the rank still yields `len()` microbatches,
    none empty. Only a rank with fewer usable samples than microbatches cannot: in training that is a
    DataError; an evaluation split then yields fewer microbatches.

    Every skip is a record (source, key, line, reason, detail, split, epoch) in `skip_records` (drained by the
    caller) and counted by reason in `skip_counts` (the loader's lifetime). Problems found by indexing
    (missing files, malformed rows, missing shards...) are recorded once per epoch, by rank 0.
    `state_dict()`/`load_state_dict()` resume mid-epoch exactly, with any number of workers.
    """

    def __init__(
        self,
        *,
        source: Any,
        shard_urls: list[str] | None,
        source_name: str,
        num_source_samples: int,
        split: str,
        patch_size: int,
        context_length: int,
        seq_lens: tuple[int, ...],
        seq_len_probs: tuple[float, ...] | None,
        max_tokens: int,
        divisor: int,
        fixed_seq_len: int | None,
        augment: bool,
        shuffle: bool,
        shuffle_buffer: int,
        num_workers: int,
        seed: int,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        pin_memory: bool = False,
        hf_processor: str | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.source, self.shard_urls, self.source_name = source, shard_urls, source_name
        self.num_source_samples = num_source_samples
        self.split, self.patch_size, self.context_length = split, patch_size, context_length
        self.seq_lens, self.seq_len_probs = seq_lens, seq_len_probs
        self.max_tokens, self.divisor, self.fixed_seq_len = max_tokens, divisor, fixed_seq_len
        self.augment, self.shuffle, self.shuffle_buffer = augment, shuffle, shuffle_buffer
        self.num_workers, self.seed = num_workers, seed
        self.rank, self.world_size = rank, world_size
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.hf_processor = hf_processor
        make_processing(hf_processor, patch_size, augment)  # a bad processor fails here, not in a worker
        self.skip_counts: Counter = Counter()
        self.skip_records: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        self.set_epoch(epoch, start_batch)

    @property
    def indexed(self) -> bool:
        """True for map-style sources (exactly-once epochs); False for streamed shards."""
        return self.source is not None

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Plan `epoch` (plan and sample order from seed and epoch), starting at microbatch `start_batch`.

        After `load_state_dict`, the call for the saved epoch and microbatch continues at the saved place.
        """
        pending = self._pending
        if pending is not None and (pending["epoch"], pending["next_batch"]) == (epoch, start_batch):
            # a resume loaded by load_state_dict stays in force until this epoch is iterated
            self._plan(epoch, start_batch, pending.get("sample_position") if pending["remap"] else None)
            self._resume = {k: int(pending[k]) for k in ("item", "piece", "owed", "fetched")}
            self.position = start_batch
            self._sample_position = pending.get("sample_position")
            self._origin = (self._resume, self.position, self._sample_position)
            return
        self._pending = None
        self._plan(epoch, start_batch, None)
        self._resume = {"item": start_batch, "piece": 0, "owed": 0, "fetched": start_batch}
        self.position = start_batch
        self._sample_position = self.plan.step_start(start_batch) if self.source is not None else None
        self._origin = (self._resume, self.position, self._sample_position)  # where every iteration starts

    def _plan(self, epoch: int, start_batch: int, sample_position: int | None) -> None:
        self.epoch = epoch
        self._first_index = start_batch if sample_position is not None else 0
        self.dropped: list[int] = []
        self.order = None
        if self.source is None:  # a stream: each rank plans its share of --train-num-samples
            self.schedule = build_schedule(
                samples_per_rank(self.num_source_samples, self.world_size), self.seq_lens, self.max_tokens,
                probs=self.seq_len_probs, divisor=self.divisor, seed=self.seed, epoch=epoch,
                fixed_seq_len=self.fixed_seq_len,
            )
        else:
            order = epoch_order(len(self.source), seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                                group_size=getattr(self.source, "group_size", 1))
            self.order = order[: self.num_source_samples]  # --train-num-samples below the usable count
            self.plan = build_global_plan(
                len(self.order), self.world_size, self.seq_lens, self.max_tokens, probs=self.seq_len_probs,
                divisor=self.divisor, seed=self.seed, epoch=epoch, fixed_seq_len=self.fixed_seq_len,
                start_step=start_batch if sample_position is not None else 0,
                start_sample=sample_position or 0,
            )
            self.schedule = self.plan.rank_batches(self.rank)
            if self.plan.dropped:
                self.dropped = self.order[len(self.order) - self.plan.dropped:].tolist()
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch must be in [0, {self.num_batches}], got {start_batch}")
        self.start_batch = start_batch

    @property
    def num_batches(self) -> int:
        """Planned microbatches this epoch on this rank (the same on every rank)."""
        return self.schedule[-1].index + 1 if self.schedule else self._first_index

    @property
    def num_samples(self) -> int:
        """Planned samples this epoch on this rank (sum of planned batch sizes)."""
        return sum(b.batch_size for b in self.schedule)

    def __len__(self) -> int:
        return self.num_batches

    # -- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands in the epoch; `load_state_dict` + `set_epoch(epoch, next_batch)` resume it.

        `sample_position`: when not None, every microbatch before `next_batch` is done and nothing after
        it is, on this rank, and the samples trained so far are exactly the epoch's global order up to that
        position — a place that does not depend on workers or world size. If it is not None on every rank,
        the epoch can continue at another world size (see `can_remap`).
        """
        position = self._sample_position
        return {
            "split": self.split, "epoch": self.epoch, "next_batch": self.position, **self._resume,
            "sample_position": position, "num_batches": self.num_batches, "seed": self.seed,
            "world_size": self.world_size, "rank": self.rank, "workers": self.num_workers,
            "skip_counts": dict(self.skip_counts),
        }

    @staticmethod
    def can_remap(states: list[dict[str, Any]]) -> bool:
        """True when the ranks' saved states (one per rank) name one global sample position, so the epoch
        can continue exactly at any world size."""
        positions = {s.get("sample_position") for s in states}
        nexts = {s.get("next_batch") for s in states}
        return len(positions) == 1 and None not in positions and len(nexts) == 1

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continue where `state_dict()` was taken: one rank's state, or the list of every rank's states.
        It takes effect now and stays in force for `set_epoch(epoch, next_batch)` until iterated.

        Same world size: this rank's own state (exact, also mid-split). Another world size: only when
        `can_remap(states)`; the rest of the epoch is re-planned from the global sample position.
        Any number of workers either way.
        """
        states = state if isinstance(state, list) else [state]
        first = states[0]
        saved_world = int(first.get("world_size", self.world_size))  # older checkpoints: this world size
        mine = next((s for s in states if s.get("rank", 0) == self.rank), None)
        if saved_world == self.world_size and (len(states) == self.world_size or len(states) == 1):
            mine = mine or first  # an older checkpoint: one state for every rank
            remap, pending = False, dict(mine)
        elif self.can_remap(states):
            remap = True
            pending = {**first, "item": first["next_batch"], "piece": 0, "owed": 0, "fetched": first["next_batch"]}
        else:
            raise ValueError(f"the data position was saved at world size {saved_world} mid-way through a "
                             f"microbatch split, so it cannot be re-mapped to world size {self.world_size}")
        pending.setdefault("item", pending["next_batch"])
        pending.setdefault("piece", 0)
        pending.setdefault("owed", 0)
        pending.setdefault("fetched", pending["next_batch"])
        self.skip_counts = Counter((mine or {}).get("skip_counts", {}))
        self._pending = {**pending, "remap": remap}
        self.set_epoch(int(pending["epoch"]), int(pending["next_batch"]))

    def summary(self) -> str:
        """One line: skipped samples by reason over the loader's lifetime."""
        if not self.skip_counts:
            return f"data {self.split} ({self.source_name}): no samples skipped"
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skip_counts.items()))
        return f"data {self.split} ({self.source_name}): skipped {sum(self.skip_counts.values())} ({reasons})"

    # -- iteration ----------------------------------------------------------------------------------
    def _dataloader(self, first_item: int) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs = {"prefetch_factor": 2, "worker_init_fn": _worker_init}
        return DataLoader(
            _EpochBatches(self, first_item), batch_size=None, num_workers=self.num_workers,
            pin_memory=self.pin_memory, persistent_workers=False, **kwargs,
        )

    def _record(self, records: list[dict[str, Any]], epoch_skips: Counter) -> None:
        for record in records:
            record = {**record, "split": self.split, "epoch": self.epoch}
            self.skip_records.append(record)
            self.skip_counts[record["reason"]] += 1
            epoch_skips[record["reason"]] += 1

    def _epoch_start_records(self) -> list[dict[str, Any]]:
        """Skips known before decoding (indexing, the plan's remainder): rank 0 records them once per epoch."""
        if self.rank != 0 or self.source is None:
            return []
        records = list(getattr(self.source, "index_skips", []))
        for index in self.dropped:
            source, key, line = self.source.describe(index)
            records.append(skip_record(source, key, line, "epoch_remainder", "fewer samples than ranks"))
        return records

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The epoch's microbatches from the resume point. Item j is emitted once item j + HOLD_BACK has
        arrived (the last END_HOLD items: at the end), cut into min(owed + 1, rows) pieces, where `owed`
        counts the empty items not yet covered; that rule depends on item positions only, so a resume
        replays it exactly."""
        self._pending = None
        self._resume, self.position, self._sample_position = self._origin
        resume = self._resume
        epoch_skips: Counter = Counter()
        if resume == {"item": 0, "piece": 0, "owed": 0, "fetched": 0}:
            self._record(self._epoch_start_records(), epoch_skips)
        num_yielded = num_samples = 0
        owed = resume["owed"]
        fetched = resume["fetched"]
        buffer: collections.deque = collections.deque()  # fetched non-empty items, not yet emitted
        empties: list[int] = []  # indices of fetched empty items
        iterator = iter(self._dataloader(resume["item"]))

        def emit(item: dict[str, Any]) -> Iterator[dict[str, Any]]:
            nonlocal owed, num_yielded, num_samples
            index, rows = item["batch_index"], item["text"].shape[0]
            parts = min(owed + 1, rows)
            # replay state: owed at this item's start, before the empties it will count again
            replay_owed = owed - sum(1 for e in empties if e >= index)
            skip = resume["piece"] if index == resume["item"] else 0
            owed -= parts - 1
            if skip == 0:  # an item's skips are logged with its first piece: never twice after a resume
                self._record(item.pop("skips"), epoch_skips)
            for q, piece in enumerate(_split_rows(item, parts) if parts > 1 else [item]):
                if q < skip:
                    continue
                self._resume = {"item": index, "piece": q + 1, "owed": replay_owed, "fetched": fetched}
                # clean: the samples done are exactly the epoch's order up to the next item to emit, and
                # nothing after it was logged; that place is the same for any workers and world size
                ahead = buffer[0]["batch_index"] if buffer else fetched
                clean = self.source is not None and owed == 0 and q + 1 == parts and all(e < ahead for e in empties)
                self._sample_position = self.plan.step_start(ahead) if clean else None
                self.position += 1
                piece["batch_index"] = self.position - 1
                num_yielded += 1
                num_samples += piece["text"].shape[0]
                yield piece

        try:
            for item in iterator:
                if "error" in item:
                    raise DataError(f"data source {self.source_name!r} ({self.split}): {item['error']}")
                index = item["batch_index"]
                if index < 0 or (item.get("empty") and index >= fetched):  # a replay logs nothing twice
                    self._record(item.pop("skips"), epoch_skips)
                if index < 0:
                    continue
                fetched = max(fetched, index + 1)
                if item.get("empty"):
                    owed += 1
                    empties.append(index)
                else:
                    buffer.append(item)
                while (buffer and buffer[0]["batch_index"] <= index - HOLD_BACK
                       and buffer[0]["batch_index"] < self.num_batches - END_HOLD):
                    yield from emit(buffer.popleft())
            while buffer:
                yield from emit(buffer.popleft())
        finally:
            del iterator  # shuts the workers down, also when the consumer stops early
        self._log_epoch(num_yielded, num_samples, epoch_skips)
        if num_yielded == 0 and self.num_batches > self.start_batch:
            raise DataError(f"no usable samples in data source {self.source_name!r} ({self.split}): "
                            f"{_reasons(epoch_skips) or 'nothing read'}")
        # only training ranks must run equally many microbatches (they meet every window); an evaluation
        # runs on its own, so there the broken samples just make it shorter (counted and logged above)
        if owed > 0 and self.split == "train":
            raise DataError(
                f"data source {self.source_name!r} ({self.split}) epoch {self.epoch}: rank {self.rank} has "
                f"{owed} microbatch(es) fewer usable samples than its {self.num_batches} planned microbatches "
                f"(skipped: {_reasons(epoch_skips)}); raise --naflex-max-tokens-per-batch or fix the data")

    def _log_epoch(self, num_batches: int, num_samples: int, skips: Counter) -> None:
        line = (f"data {self.split} epoch {self.epoch} rank {self.rank}: {num_batches} batches, {num_samples} "
                f"samples (planned {self.num_batches - self.start_batch} batches)")
        if skips:
            logger.warning("%s; skipped %d (%s)", line, sum(skips.values()), _reasons(skips))
        else:
            logger.info(line)


def _reasons(counts: Counter) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def _source_for(cfg: DataConfig, split: str) -> tuple[Any, list[str] | None, str, int]:
    """(map source or None, shard urls of a stream or None, name for messages, samples per epoch)."""
    resolved = cfg.source(split)
    if resolved is None:
        flag = "--train-data" if split == "train" else "--val-data"
        raise ValueError(f"split {split!r} has no data: {flag} is not set")
    kind, path = resolved
    requested = cfg.train_num_samples if split == "train" else cfg.val_num_samples
    flag = f"--{split}-num-samples"
    if kind == "synthetic":
        size = cfg.synthetic_train_size if split == "train" else cfg.synthetic_val_size
        group_size = cfg.synthetic_shape_group_size if split == "train" else 1
        source = SyntheticSource(cfg.synthetic_seed, split, size, group_size)
    else:
        assert path is not None
        if kind == "csv":
            source = CsvSource(path, cfg.csv_img_key, cfg.csv_caption_key, cfg.csv_separator)
        elif kind == "folder":
            source = FolderSource(path)
        else:
            urls = expand_shards(path)
            check_shards(urls, path)
            if not all(is_indexable(u) for u in urls):  # pipe:, URLs, compressed: streamed
                num = requested or count_shard_samples(urls)
                if num < 1:
                    raise DataError(f"no samples found in shards {path!r}; pass {flag} for remote shards")
                return None, urls, path, num
            source = IndexedShardSource(path, urls, cfg.shard_index_dir)
        if len(source) == 0:
            reasons = Counter(r["reason"] for r in getattr(source, "index_skips", []))
            raise DataError(f"data source {path!r} has no usable samples ({_reasons(reasons) or 'empty'})")
    if requested is not None and requested > len(source):
        # an epoch longer than the data would put copies of one pair into the same window, as each
        # other's negatives; a shorter one takes a fresh random subset of the usable samples each epoch
        raise DataError(f"{flag} {requested} is more than the {len(source)} usable samples of {source.name!r}; "
                        f"an epoch reads each sample once: omit {flag} or pass at most {len(source)}")
    return source, None, source.name, requested or len(source)


def build_loader(
    cfg: DataConfig,
    *,
    split: str,
    patch_size: int,
    context_length: int,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    start_batch: int = 0,
    device_pin: bool = False,
) -> NaFlexLoader:
    """The loader for `split` ("train": schedule drawn per batch, shuffled, optional augment;
    "val": every batch at max(--naflex-seq-lens), source order, deterministic eval transform).

    `start_batch` resumes mid-epoch: the loader yields exactly the batches from that index on that
    an uninterrupted epoch would have yielded.
    """
    source, urls, name, num = _source_for(cfg, split)
    train = split == "train"
    if urls is not None and rank == 0:
        logger.warning("data %s (%s): shards that cannot be indexed (pipe:, URLs, compressed) are streamed; an epoch "
                       "is %d samples split by (rank, worker) slot, so a sample can repeat or be missed in it",
                       split, name, num)
    return NaFlexLoader(
        source=source, shard_urls=urls, source_name=name, num_source_samples=num, split=split,
        patch_size=patch_size, context_length=context_length, seq_lens=cfg.naflex_seq_lens,
        seq_len_probs=cfg.naflex_seq_len_probs, max_tokens=cfg.naflex_max_tokens_per_batch,
        divisor=cfg.naflex_batch_divisor, fixed_seq_len=None if train else max(cfg.naflex_seq_lens),
        augment=cfg.augment and train, shuffle=train, shuffle_buffer=cfg.shuffle_buffer,
        num_workers=cfg.workers, seed=cfg.seed, epoch=epoch, rank=rank, world_size=world_size,
        start_batch=start_batch, pin_memory=device_pin, hf_processor=cfg.hf_processor,
    )


def build_zero_shot_loader(
    cfg: DataConfig, *, patch_size: int, context_length: int, num_samples: int = 500,
) -> NaFlexLoader:
    """Single-object synthetic validation images with "labels": {"shape", "colour", "size"}: long [B].

    Batches at max(--naflex-seq-lens), deterministic eval transform, fixed order; one process.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    source = ZeroShotSource(cfg.synthetic_seed, num_samples)
    return NaFlexLoader(
        source=source, shard_urls=None, source_name=source.name, num_source_samples=num_samples,
        split="zeroshot", patch_size=patch_size, context_length=context_length,
        seq_lens=cfg.naflex_seq_lens, seq_len_probs=None, max_tokens=cfg.naflex_max_tokens_per_batch,
        divisor=cfg.naflex_batch_divisor, fixed_seq_len=max(cfg.naflex_seq_lens), augment=False,
        shuffle=False, shuffle_buffer=0, num_workers=cfg.workers, seed=cfg.seed, hf_processor=cfg.hf_processor,
    )


def iter_epoch_indices(loader: NaFlexLoader) -> list[list[int]]:
    """Map-style only: the dataset indices each planned batch of the epoch reads, in order (for tests)."""
    if loader.order is None:
        raise ValueError(f"{loader.source_name!r} is a stream; it has no index plan")
    return [loader.order[b.offset: b.offset + b.batch_size].tolist() for b in loader.schedule]



