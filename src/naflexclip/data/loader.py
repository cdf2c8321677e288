"""The NaFlex loader: source -> decode -> timm NaFlex transform -> token-budget microbatches, in workers.

`build_loader` plans one epoch with the token-budget schedule (same plan on every rank), then
torch DataLoader workers build the planned microbatches round-robin (worker w builds batches
w, w+K, ...), which the DataLoader returns in plan order. Bad samples are dropped from their
microbatch and counted by reason; the counts ride back to the main process inside each item and
are summed in `NaFlexLoader.skip_counts`. A worker never raises: it sends its error as an item and
the main process raises one `DataError` that names the data source.

Map-style sources (synthetic, CSV, folder) are split by rank from one per-epoch permutation;
resuming with `start_batch` is exact whatever the worker count. WebDataset shards are split by
(rank, worker) slot - by shard when there are enough shards, else by sample - each slot cycling
its shards with a per-pass shuffle buffer; resume is exact for the same world size and workers.
"""

from __future__ import annotations

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
)
from naflexclip.data.samples import SkipSample, decode_caption, decode_image
from naflexclip.data.schedule import (
    ScheduledBatch,
    build_schedule,
    rank_sample_order,
    samples_per_rank,
    worker_batches,
)

logger = logging.getLogger("naflexclip.data")


class _EpochBatches(IterableDataset):
    """One rank's epoch of planned microbatches; each DataLoader worker builds its share."""

    def __init__(self, loader: NaFlexLoader) -> None:
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
        self.start_batch = loader.start_batch
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
    def _build(self, planned: ScheduledBatch, raws: list[RawSample | SkipSample], skipped: Counter) -> dict:
        random.seed(hash((self.seed, self.epoch, self.rank, planned.index)))  # augment RNG, resumable
        draft = lambda hw: self.transform.target_hw(hw, planned.seq_len)
        pixels, texts, labels, keys = [], [], [], []
        for raw in raws:
            try:
                if isinstance(raw, SkipSample):
                    raise raw
                image = raw.image if isinstance(raw.image, Image.Image) else decode_image(raw.image, draft)
                caption = decode_caption(raw.caption)
                pixels.append(self.transform(image, planned.seq_len))
            except SkipSample as skip:
                skipped[skip.reason] += 1
                continue
            texts.append(caption)
            keys.append(raw.key)
            if raw.labels is not None:
                labels.append(raw.labels)
        item: dict[str, Any] = {"batch_index": planned.index, "skipped": dict(skipped)}
        skipped.clear()
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

    # -- map-style sources ---------------------------------------------------------------------
    def _load(self, index: int) -> RawSample | SkipSample:
        try:
            return self.source.load(int(index))
        except SkipSample as skip:
            return skip

    def _map_batches(self, worker_id: int) -> Iterator[dict[str, Any]]:
        skipped: Counter = Counter()
        for planned in worker_batches(self.schedule, worker_id, self.num_workers, self.start_batch):
            indices = self.order[planned.offset: planned.offset + planned.batch_size]
            yield self._build(planned, [self._load(i) for i in indices], skipped)

    # -- WebDataset shards ---------------------------------------------------------------------
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
        skipped: Counter = Counter()
        reported: Counter = Counter()
        for planned in self.schedule:
            if planned.index % self.num_workers != stream_id:
                continue
            raws = list(itertools.islice(stream, planned.batch_size))
            if planned.index < self.start_batch:
                continue  # consumed undecoded: the stream's place is restored
            skipped.update(log.counts - reported)
            reported = Counter(log.counts)
            yield self._build(planned, raws, skipped)
        if log.counts - reported:
            yield {"empty": True, "batch_index": -1, "skipped": dict(log.counts - reported)}


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


class NaFlexLoader:
    """Iterable over one epoch of NaFlex microbatches for one rank.

    Each item: {"image": {"patches": float32 [B, L, P*P*3], "patch_coord": long [B, L, 2] (row, col),
    "patch_valid": bool [B, L]}, "text": long [B, T], "seq_len": L, "num_tokens": int,
    "batch_index": int, "keys": list[str] (sample ids), and "labels" for the zero-shot loader}.
    B varies from batch to batch; L is the batch's scheduled sequence length. `len()` is the
    epoch's planned batch count (a batch whose every sample is bad is dropped, so an epoch may
    yield fewer); iteration starts at `start_batch`. `skip_counts` sums skipped samples by
    reason over the loader's lifetime.
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
        self.set_epoch(epoch, start_batch)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Plan `epoch` (schedule and sample order from seed and epoch), starting at `start_batch`."""
        self.epoch = epoch
        per_rank = samples_per_rank(self.num_source_samples, self.world_size)
        self.schedule = build_schedule(
            per_rank, self.seq_lens, self.max_tokens, probs=self.seq_len_probs, divisor=self.divisor,
            seed=self.seed, epoch=epoch, fixed_seq_len=self.fixed_seq_len,
        )
        if not 0 <= start_batch <= len(self.schedule):
            raise ValueError(f"start_batch must be in [0, {len(self.schedule)}], got {start_batch}")
        self.start_batch = start_batch
        self.position = start_batch
        self.order = None
        if self.source is not None:
            self.order = rank_sample_order(
                self.num_source_samples, rank=self.rank, world_size=self.world_size,
                seed=self.seed, epoch=epoch, shuffle=self.shuffle, group_size=getattr(self.source, "group_size", 1),
            )

    @property
    def num_batches(self) -> int:
        """Planned microbatches this epoch on this rank (the same on every rank)."""
        return len(self.schedule)

    @property
    def num_samples(self) -> int:
        """Planned samples this epoch on this rank (sum of planned batch sizes)."""
        return sum(b.batch_size for b in self.schedule)

    def __len__(self) -> int:
        return self.num_batches

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: rebuild with `epoch=...` and `start_batch=next_batch` to resume exactly."""
        return {
            "split": self.split, "epoch": self.epoch, "next_batch": self.position,
            "num_batches": self.num_batches, "seed": self.seed, "world_size": self.world_size,
            "workers": self.num_workers, "skip_counts": dict(self.skip_counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position `state_dict()` recorded (same seed, world size and workers)."""
        self.skip_counts = Counter(state.get("skip_counts", {}))
        self.set_epoch(int(state["epoch"]), int(state["next_batch"]))

    def summary(self) -> str:
        """One line: skipped samples by reason over the loader's lifetime."""
        if not self.skip_counts:
            return f"data {self.split} ({self.source_name}): no samples skipped"
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skip_counts.items()))
        return f"data {self.split} ({self.source_name}): skipped {sum(self.skip_counts.values())} ({reasons})"

    def _dataloader(self) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs = {"prefetch_factor": 2, "worker_init_fn": _worker_init}
        return DataLoader(
            _EpochBatches(self), batch_size=None, num_workers=self.num_workers,
            pin_memory=self.pin_memory, persistent_workers=False, **kwargs,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch_skips: Counter = Counter()
        num_batches = num_samples = 0
        iterator = iter(self._dataloader())
        try:
            for item in iterator:
                if "error" in item:
                    raise DataError(f"data source {self.source_name!r} ({self.split}): {item['error']}")
                skipped = item.pop("skipped")
                epoch_skips.update(skipped)
                self.skip_counts.update(skipped)
                if item["batch_index"] >= 0:
                    self.position = item["batch_index"] + 1
                if item.get("empty"):
                    continue
                num_batches += 1
                num_samples += item["text"].shape[0]
                yield item
        finally:
            del iterator  # shuts the workers down, also when the consumer stops early
        self._log_epoch(num_batches, num_samples, epoch_skips)
        if num_batches == 0 and self.num_batches > self.start_batch:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(epoch_skips.items())) or "nothing read"
            raise DataError(f"no usable samples in data source {self.source_name!r} ({self.split}): {reasons}")

    def _log_epoch(self, num_batches: int, num_samples: int, skips: Counter) -> None:
        line = (f"data {self.split} epoch {self.epoch}: {num_batches} batches, {num_samples} samples "
                f"(planned {self.num_batches - self.start_batch} batches)")
        if skips:
            reasons = ", ".join(f"{k}={v}" for k, v in sorted(skips.items()))
            logger.warning("%s; skipped %d bad samples (%s)", line, sum(skips.values()), reasons)
        else:
            logger.info(line)


def _source_for(cfg: DataConfig, split: str) -> tuple[Any, list[str] | None, str, int]:
    """(map source or None, shard urls or None, name for messages, samples per epoch)."""
    resolved = cfg.source(split)
    if resolved is None:
        flag = "--train-data" if split == "train" else "--val-data"
        raise ValueError(f"split {split!r} has no data: {flag} is not set")
    kind, path = resolved
    if kind == "synthetic":
        size = cfg.synthetic_train_size if split == "train" else cfg.synthetic_val_size
        group_size = cfg.synthetic_shape_group_size if split == "train" else 1
        source = SyntheticSource(cfg.synthetic_seed, split, size, group_size)
        return source, None, source.name, size
    assert path is not None
    if kind == "csv":
        source = CsvSource(path, cfg.csv_img_key, cfg.csv_caption_key, cfg.csv_separator)
    elif kind == "folder":
        source = FolderSource(path)
    else:
        urls = expand_shards(path)
        check_shards(urls, path)
        requested = cfg.train_num_samples if split == "train" else cfg.val_num_samples
        num = requested or count_shard_samples(urls)
        if num < 1:
            raise DataError(f"no samples found in shards {path!r}; pass --{split}-num-samples for remote shards")
        return None, urls, path, num
    if len(source) == 0:
        raise DataError(f"data source {path!r} has no samples")
    return source, None, source.name, len(source)


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



