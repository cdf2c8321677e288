"""Build the loader a data config asks for: `build_loader` (train and val splits), `build_zero_shot_loader`."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from naflexclip.data.config import DataConfig
from naflexclip.data.loader import NaFlexLoader
from naflexclip.data.map_loader import MapLoader
from naflexclip.data.microbatch import MicrobatchBuilder
from naflexclip.data.readers import (
    CsvSource,
    DataError,
    FolderSource,
    Source,
    SyntheticSource,
    ZeroShotSource,
    check_shards,
    count_shard_samples,
    expand_shards,
)
from naflexclip.data.samples import reasons_line
from naflexclip.data.shard_index import IndexedShardSource, is_indexable
from naflexclip.data.stream_loader import StreamLoader

logger = logging.getLogger("naflexclip.data")


def _map_source(cfg: DataConfig, split: str, kind: str, path: str | None, urls: list[str]) -> Source:
    if kind == "synthetic":
        size = cfg.synthetic_train_size if split == "train" else cfg.synthetic_val_size
        group_size = cfg.synthetic_shape_group_size if split == "train" else 1
        return SyntheticSource(cfg.synthetic_seed, split, size, group_size)
    assert path is not None
    if kind == "csv":
        source: Source = CsvSource(path, cfg.csv_img_key, cfg.csv_caption_key, cfg.csv_separator)
    elif kind == "folder":
        source = FolderSource(path)
    else:
        source = IndexedShardSource(path, urls, cfg.shard_index_dir, cfg.member_keys())
    if len(source) == 0:
        reasons = Counter(r["reason"] for r in source.index_skips)
        raise DataError(f"data source {path!r} has no usable samples ({reasons_line(reasons) or 'empty'})")
    return source


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
    """The loader for `split` ("train": sequence lengths drawn per step, shuffled, optional augment;
    "val": every microbatch at max(--naflex-seq-lens), source order, deterministic eval transform).

    `start_batch` resumes mid-epoch: the loader yields exactly the microbatches from that position on that
    an uninterrupted epoch would have yielded.
    """
    resolved = cfg.source(split)
    if resolved is None:
        flag = "--train-data" if split == "train" else "--val-data"
        raise ValueError(f"split {split!r} has no data: {flag} is not set")
    kind, path = resolved
    train = split == "train"
    if train and (cfg.dataset_resampled or cfg.train_data_upsampling_factors is not None):
        raise DataError("--dataset-resampled and --train-data-upsampling-factors are not supported yet")
    requested = cfg.train_num_samples if train else cfg.val_num_samples
    flag = f"--{split}-num-samples"
    common: dict[str, Any] = dict(
        split=split, budget=cfg.token_budget() if train else cfg.token_budget().at_longest(),
        builder=MicrobatchBuilder(patch_size=patch_size, context_length=context_length, augment=cfg.augment and train,
                                  hf_processor=cfg.hf_processor, json_caption=cfg.json_caption(),
                                  max_image_pixels=cfg.max_image_pixels),
        seed=cfg.seed, shuffle=train, workers=cfg.workers, rank=rank, world_size=world_size, pin_memory=device_pin,
    )
    urls = expand_shards(path) if kind == "webdataset" and path is not None else []
    if urls:
        check_shards(urls, path)
    loader: NaFlexLoader
    if not all(is_indexable(u) for u in urls):  # pipe:, URLs, compressed: streamed
        num = requested or count_shard_samples(urls)
        if num < 1:
            raise DataError(f"no samples found in shards {path!r}; pass {flag} for remote shards")
        if rank == 0:
            logger.warning("data %s (%s): shards that cannot be indexed (pipe:, URLs, compressed) are streamed; an "
                           "epoch is %d samples split by (rank, worker) slot, so a sample can repeat or be missed in "
                           "it", split, path, num)
        loader = StreamLoader(urls, name=path, samples_per_epoch=num, shuffle_buffer=cfg.shuffle_buffer,
                              member_keys=cfg.member_keys(), **common)
    else:
        source = _map_source(cfg, split, kind, path, urls)
        if requested is not None and requested > len(source):
            # an epoch longer than the data would put copies of one pair into the same window, as each
            # other's negatives; a shorter one takes a fresh random subset of the usable samples each epoch
            raise DataError(f"{flag} {requested} is more than the {len(source)} usable samples of {source.name!r}; "
                            f"an epoch reads each sample once: omit {flag} or pass at most {len(source)}")
        loader = MapLoader(source, samples_per_epoch=requested, **common)
    if epoch or start_batch:
        loader.set_epoch(epoch, start_batch)
    return loader


def build_zero_shot_loader(
    cfg: DataConfig, *, patch_size: int, context_length: int, num_samples: int = 500,
) -> NaFlexLoader:
    """Single-object synthetic validation images with "labels": {"shape", "colour", "size"}: long [B].

    Microbatches at max(--naflex-seq-lens), deterministic eval transform, fixed order; one process.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    builder = MicrobatchBuilder(patch_size=patch_size, context_length=context_length, hf_processor=cfg.hf_processor)
    return MapLoader(ZeroShotSource(cfg.synthetic_seed, num_samples), split="zeroshot",
                     budget=cfg.token_budget().at_longest(), builder=builder, seed=cfg.seed, shuffle=False,
                     workers=cfg.workers)

