"""Build the loader a data config asks for: `build_loader` (train and val splits), `build_zero_shot_loader`."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from naflexclip.data import remote
from naflexclip.data.chunk_order import ChunkedRecipe, shard_chunks, source_shard_bytes
from naflexclip.data.data_config import DEFAULT_IMAGE_KEY, DataConfig, split_keys
from naflexclip.data.folders import FolderSource
from naflexclip.data.joined_sources import JoinedSources
from naflexclip.data.loader import NaFlexLoader
from naflexclip.data.map_loader import MapLoader
from naflexclip.data.microbatch import MicrobatchBuilder
from naflexclip.data.parquet_source import BLOCK_ROW_GROUPS, ParquetSource, is_parquet
from naflexclip.data.readers import SyntheticSource, ZeroShotSource
from naflexclip.data.sample_inputs import SampleInputs
from naflexclip.data.samples import reasons_line
from naflexclip.data.shard_index import is_indexable
from naflexclip.data.shard_order import ShardRecipe, ShardSet, mixture_counts
from naflexclip.data.shard_sources import IndexedShardSource, SizedShardSource
from naflexclip.data.shards import check_shards, count_shard_samples, expand_shards, read_sizes
from naflexclip.data.source import EITHER_DATA_FLAG, DataError, Source
from naflexclip.data.stream_loader import StreamLoader
from naflexclip.data.tables import CsvSource
from naflexclip.processing.naflex_transform import Processing, default_processing
from naflexclip.settings import settings_of

logger = logging.getLogger("naflexclip.data")
_DEFAULT_SHUFFLE_BUFFER = settings_of(DataConfig)["shuffle_buffer"].default
NONE_LISTED_OR_HELD = "sizes.json lists none and its shards hold none"


def _map_source(cfg: DataConfig, split: str, kind: str, path: str | None, urls: list[str]) -> Source:
    if kind == "synthetic":
        size = cfg.synthetic_train_size if split == "train" else cfg.synthetic_val_size
        group_size = cfg.synthetic_shape_group_size if split == "train" else 1
        return SyntheticSource(cfg.synthetic_seed, split, size, group_size,
                               multi_caption=cfg.synthetic_multi_caption and split == "train")
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


def expand_sources(spec: str) -> tuple[list[str], np.ndarray]:
    """The shard urls of a `::`-joined spec, and the source (0, 1, ...) each comes from (one expansion each)."""
    urls: list[str] = []
    ids = []
    for s, part in enumerate(spec.split("::")):
        expanded = expand_shards(part)
        urls += expanded
        ids.append(np.full(len(expanded), s, np.int64))
    return urls, np.concatenate(ids)


def _shard_loader(cfg: DataConfig, path: str, urls: list[str], ids: np.ndarray, requested: int | None, flag: str,
                  resampled: bool, factors: tuple[float, ...] | None, common: dict[str, Any]) -> MapLoader:
    """Indexable .tar shards. With a sizes.json listing every shard, an O(shards) plan on every rank
    (`SizedShardSource`: each shard counted from its cached index, or not at all with --trust-sizes-json, the index
    itself read by the workers); else every shard is indexed and held. Mixtures, resampling and sized shards take
    their order from a `ShardRecipe`."""
    sizes = _listed_sizes(urls, path, common)
    source: Source
    if sizes is not None:
        source = SizedShardSource(path, urls, sizes, cfg.shard_index_dir, cfg.member_keys(),
                                  _first_shard(len(urls), common), trusted=cfg.trust_sizes_json)
        shard_sizes = source.sizes
    else:
        source = _map_source(cfg, common["split"], "webdataset", path, urls)
        shard_sizes = np.bincount(source.shard_ids, minlength=len(urls)).astype(np.int64)
    if len(source) == 0:
        raise DataError(f"data source {path!r} has no usable samples ({NONE_LISTED_OR_HELD})")
    sources = path.split("::")
    shards = ShardSet(shard_sizes, ids, tuple(sources))
    for s in np.flatnonzero(shards.source_sizes() == 0):  # one source of a `::` mixture with nothing usable
        mine = {u for u, i in zip(urls, ids, strict=True) if i == s}
        reasons = Counter(r["reason"] for r in source.index_skips if r["source"] in mine)
        raise DataError(f"data source {sources[s]!r} of {path!r} has no usable samples "
                        f"({reasons_line(reasons) or (NONE_LISTED_OR_HELD if sizes is not None else 'empty')})")
    if requested is not None and requested > len(source) and not (resampled or factors is not None):
        raise _more_than_the_data(cfg, flag, requested, source)
    if sizes is None and not resampled and factors is None:
        chunked = _chunked(cfg, ShardRecipe(shards, None, False, requested), source, common)
        return MapLoader(source, samples_per_epoch=requested, chunked=chunked, **common)
    try:
        recipe = ShardRecipe(shards, factors, resampled, requested)
        recipe.epoch_samples()
    except ValueError as error:
        raise DataError(str(error)) from None
    loader = MapLoader(source, recipe=recipe, chunked=_chunked(cfg, recipe, source, common), **common)
    if common["rank"] == 0:
        _announce_mixture(cfg, loader, recipe, common["split"])
    return loader


def _chunked(cfg: DataConfig, recipe: ShardRecipe, source: Source, common: dict[str, Any]) -> ChunkedRecipe | None:
    """The chunked order of a training source of tar shards (`chunk_order`); None with --fetch-chunk-size 0."""
    if common["split"] != "train" or cfg.fetch_chunk_size == 0:
        return None
    chunks = shard_chunks(recipe.shards.sizes, source_shard_bytes(source), cfg.fetch_chunk_size << 20)
    return ChunkedRecipe(recipe, chunks, cfg.fetch_streams, cfg.fetch_memory << 20)


def _listed_sizes(urls: list[str], path: str, common: dict[str, Any]) -> np.ndarray | None:
    """`read_sizes` of the shards of `path`; a sizes.json there that cannot be used is named in one line."""
    problems: list[str] = []
    sizes = read_sizes(urls, problems)
    if common["rank"] == 0:
        for problem in problems:
            logger.warning("data %s (%s): %s", common["split"], path, problem)
    return sizes


def _first_shard(num_shards: int, common: dict[str, Any]) -> int:
    """Where this rank starts checking sizes.json against the shards: the ranks spread over them, so that on a
    first run each scans its own and finds the others' indexes in the cache."""
    return common["rank"] * num_shards // common["world_size"]


def _announce_mixture(cfg: DataConfig, loader: MapLoader, recipe: ShardRecipe, split: str) -> None:
    """A mixture's planned samples per source; a source read more than once per epoch, named."""
    shards = recipe.shards
    sources = shards.source_names
    if recipe.factors is not None and not recipe.resampled:
        counts = mixture_counts(shards.source_sizes(), recipe.factors, recipe.num_samples)
        copied = [f"{name} {count / size:.3g}x" for name, count, size in
                  zip(sources, counts, shards.source_sizes(), strict=True) if count > size]
        if copied:
            logger.warning("--train-data-upsampling-factors %s reads %s per epoch: the copies of a pair are planned "
                           "independently, so two can be in the same window, as each other's negatives",
                           cfg.train_data_upsampling_factors, ", ".join(copied))
    if len(sources) > 1:
        logger.warning("data %s epoch 1: %s", split, ", ".join(
            f"{name} {count} samples" for name, count in loader.planned_sources.items()))


def _table_loader(cfg: DataConfig, path: str, requested: int | None, flag: str, resampled: bool,
                  factors: tuple[float, ...] | None, common: dict[str, Any]) -> MapLoader:
    """Parquet files, alone or `::`-joined with WebDataset shards: each Parquet row group is a shard of the epoch's
    `ShardRecipe` (`parquet_source`), each tar source's shards as in `_shard_loader`."""
    sources: list[Source] = []
    sizes, ids = [], []
    parts = path.split("::")
    for s, part in enumerate(parts):
        urls = expand_shards(part)
        source: Source
        if is_parquet(part):
            # columns: the ones named, else the usual names (the flags' defaults are WebDataset suffixes)
            image_keys = None if cfg.image_key == DEFAULT_IMAGE_KEY else split_keys(cfg.image_key)
            source = ParquetSource(part, urls, image_keys, None if cfg.text_key == "txt" else split_keys(cfg.text_key))
            part_sizes = source.group_sizes
        else:
            check_shards(urls, part)
            remote.check_remote_shards(urls, part)
            listed = _listed_sizes(urls, part, common)
            if listed is not None:
                source = SizedShardSource(part, urls, listed, cfg.shard_index_dir, cfg.member_keys(),
                                          _first_shard(len(urls), common), trusted=cfg.trust_sizes_json)
                part_sizes = source.sizes
            else:
                source = IndexedShardSource(part, urls, cfg.shard_index_dir, cfg.member_keys())
                part_sizes = np.bincount(source.shard_ids, minlength=len(urls)).astype(np.int64)
        if len(source) == 0:
            reasons = Counter(r["reason"] for r in source.index_skips)
            raise DataError(f"data source {part!r} of {path!r} has no usable samples "
                            f"({reasons_line(reasons) or 'empty'})")
        sources.append(source)
        sizes.append(np.asarray(part_sizes, np.int64))
        ids.append(np.full(len(part_sizes), s, np.int64))
    joined = JoinedSources(path, sources) if len(sources) > 1 else sources[0]
    if requested is not None and requested > len(joined) and not (resampled or factors is not None):
        raise _more_than_the_data(cfg, flag, requested, joined)
    try:
        recipe = ShardRecipe(ShardSet(np.concatenate(sizes), np.concatenate(ids), tuple(parts)), factors, resampled,
                             requested, block_slots=BLOCK_ROW_GROUPS)
        recipe.epoch_samples()
    except ValueError as error:
        raise DataError(str(error)) from None
    # Parquet keeps its order of row-group blocks: a row group is already one large read, which a worker keeps
    # while the block is read; chunks dealt to streams would take each row group's rows far apart, read again
    loader = MapLoader(joined, recipe=recipe, **common)
    if common["rank"] == 0:
        _announce_mixture(cfg, loader, recipe, common["split"])
    return loader


def _more_than_the_data(cfg: DataConfig, flag: str, requested: int, source: Source) -> DataError:
    """An epoch longer than the data would put copies of one pair into the same window, as each other's negatives
    (a shorter one takes a fresh random subset of the usable samples each epoch): one line naming the flag."""
    if flag == "--naflex-num-train-image-tokens":
        return DataError(f"{flag} {cfg.naflex_num_train_image_tokens} plans {requested} samples, more than the "
                         f"{len(source)} usable samples of {source.name!r}; an epoch reads each sample once: pass a "
                         "smaller budget")
    return DataError(f"{flag} {requested} is more than the {len(source)} usable samples of {source.name!r}; an epoch "
                     f"reads each sample once: omit {flag} or pass at most {len(source)}")


def _processing(cfg: DataConfig, processing: Processing | None, patch_size: int, augment: bool) -> Processing:
    """The processing handed in; our own when none was and the config names no pretrained model's."""
    if processing is not None:
        return processing
    if cfg.hf_processor is not None:  # the data pipeline does not know the families: its caller hands theirs in
        raise ValueError(f"the data config's hf_processor {cfg.hf_processor!r} needs that model's processing handed "
                         f"in (processing=naflexclip.families.data_processing(...))")
    return default_processing(patch_size, augment)


def _naming_its_flag(build: Callable[..., NaFlexLoader]) -> Callable[..., NaFlexLoader]:
    """A data error of a split names its flag (--train-data or --val-data) where the check that raised it, serving
    both, could not (`EITHER_DATA_FLAG`)."""
    @functools.wraps(build)
    def naming(*args: Any, split: str, **kwargs: Any) -> NaFlexLoader:
        try:
            return build(*args, split=split, **kwargs)
        except DataError as error:
            flag = "--train-data" if split == "train" else "--val-data"
            raise DataError(str(error).replace(EITHER_DATA_FLAG, flag)) from None

    return naming


@_naming_its_flag
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
    processing: Processing | None = None,
    inputs: Sequence[SampleInputs] = (),
) -> NaFlexLoader:
    """The loader for `split` ("train": sequence lengths drawn per step, shuffled, optional augment;
    "val": every microbatch at max(--naflex-seq-lens), source order, deterministic eval transform). `patch_size`:
    the model's; "train" draws each microbatch's from --naflex-patch-sizes when they are set.

    `start_batch` resumes mid-epoch: the loader yields exactly the microbatches from that position on that
    an uninterrupted epoch would have yielded. `processing`: the model's transform, collation and tokenizer for
    this split (an augmenting one for "train" with `cfg.augment`), handed in by the model's family
    (`naflexclip.families.data_processing`); None: our own (`default_processing`). `inputs`: what the objectives'
    examples need besides, built per sample into each microbatch (`naflexclip.data.sample_inputs.SampleInputs`,
    handed in by `naflexclip.objectives.objective.Objective.loader_inputs`).
    """
    resolved = cfg.source(split)
    if resolved is None:
        flag = "--train-data" if split == "train" else "--val-data"
        raise ValueError(f"split {split!r} has no data: {flag} is not set")
    kind, path = resolved
    train = split == "train"
    resampled = train and cfg.dataset_resampled
    factors = cfg.upsampling_factors() if train else None
    processing = _processing(cfg, processing, patch_size, augment=cfg.augment and train)
    requested, flag = cfg.train_samples_requested() if train else (cfg.val_num_samples, "--val-num-samples")
    common: dict[str, Any] = dict(
        split=split, budget=cfg.token_budget() if train else cfg.token_budget().at_longest(),
        builder=MicrobatchBuilder(patch_size=patch_size, context_length=context_length, processing=processing,
                                  augment=cfg.augment and train, json_caption=cfg.json_caption(),
                                  max_image_pixels=cfg.max_image_pixels, multi_caption=cfg.multi_caption and train,
                                  caption_per_line=cfg.caption_per_line,
                                  patch_sizes=cfg.patch_sizes(patch_size) if train else None, inputs=inputs),
        seed=cfg.seed, shuffle=train, workers=cfg.workers, rank=rank, world_size=world_size, pin_memory=device_pin,
    )
    # Parquet, alone or in a `::` mixture with shards
    tables = kind == "parquet" or (kind == "webdataset" and any(is_parquet(p) for p in str(path).split("::")))
    shards = kind == "webdataset" and path is not None and not tables
    urls, ids = expand_sources(path) if shards else ([], np.zeros(0, np.int64))
    if urls:
        check_shards(urls, path)
        remote.check_remote_shards([u for u in urls if is_indexable(u)], path)
    if path is not None and any(remote.is_remote(part) for part in str(path).split("::")):
        remote.share_dead_objects()  # before any worker starts: what one gives up, the others skip at once
    loader: NaFlexLoader
    if tables:
        assert path is not None
        loader = _table_loader(cfg, path, requested, flag, resampled, factors, common)
    elif not all(is_indexable(u) for u in urls):  # pipe:, compressed: streamed
        if factors is not None and not resampled:
            raise DataError("--train-data-upsampling-factors without --dataset-resampled plans each source's exact "
                            "share, which needs local .tar shards; these are streamed: add --dataset-resampled")
        num = requested or count_shard_samples(urls)
        if num < 1:
            raise DataError(f"no samples found in shards {path!r}; pass {flag} for remote shards")
        if rank == 0:
            logger.warning("data %s (%s): shards that cannot be indexed (pipe:, compressed) are streamed; an "
                           "epoch is %d samples split by (rank, worker) slot, so a sample can repeat or be missed in "
                           "it", split, path, num)
        weights = None if factors is None else [factors[s] for s in ids]
        loader = StreamLoader(urls, name=path, samples_per_epoch=num, shuffle_buffer=cfg.shuffle_buffer,
                              member_keys=cfg.member_keys(), resampled=resampled, shard_weights=weights, **common)
    elif kind == "webdataset":
        assert path is not None
        loader = _shard_loader(cfg, path, urls, ids, requested, flag, resampled, factors, common)
    else:
        source = _map_source(cfg, split, kind, path, urls)
        if train and kind == "csv" and requested is not None and flag == "--train-num-samples":
            # OpenCLIP's NaFlex CSV loader never reads --train-num-samples: an epoch is the whole file
            if rank == 0:
                logger.warning("%s %d: ignored for a CSV, as OpenCLIP does (an epoch is the whole file, its %d "
                               "samples)", flag, requested, len(source))
            requested = None
        if requested is not None and requested > len(source):
            raise _more_than_the_data(cfg, flag, requested, source)
        loader = MapLoader(source, samples_per_epoch=requested, **common)
    if train:
        _check_trainable(loader, world_size)
        if cfg.trust_sizes_json and rank == 0 and (
                notice := _trust_sizes_json_notice(cfg, path, _planned_from_sizes_json(loader))):
            logger.warning("%s", notice)
        if cfg.shuffle_buffer != _DEFAULT_SHUFFLE_BUFFER and rank == 0 and not isinstance(loader, StreamLoader):
            logger.warning("--shuffle-buffer %d: the training data %r is not streamed (its samples are shuffled over "
                           "the whole epoch); the flag changes nothing for it", cfg.shuffle_buffer,
                           path or "the built-in dataset")
        sizes = cfg.naflex_patch_sizes
        if rank == 0 and sizes is not None and sizes[0] != patch_size:
            logger.warning("--naflex-patch-sizes %s: evaluation runs at the model's own patch size %d (OpenCLIP's at "
                           "the first listed, %d)", " ".join(map(str, sizes)), patch_size, sizes[0])
    if epoch or start_batch:
        loader.set_epoch(epoch, start_batch)
    retried = remote.take_notes()  # startup's (listing, sizes.json, indexing): before any worker forks
    if retried and rank == 0:  # the throttled among them too
        logger.warning("data %s (%s): %d remote reads retried at startup, e.g. %s", split, path, len(retried),
                       retried[0]["detail"])
    return loader


def _trust_sizes_json_notice(cfg: DataConfig, train_path: str | None, train_trusted: bool) -> str | None:
    """--trust-sizes-json's line at the start: the training and validation data it changes nothing for, and the
    validation shards it plans from their sizes.json beside training data it does not; None where it applies to all
    the data given."""
    val_trusted = cfg.val_data is not None and _listed_shards(cfg, "val")
    untouched = [] if train_trusted else [f"the training data {train_path or 'the built-in dataset'!r}"]
    if cfg.val_data is not None and not val_trusted:
        untouched.append(f"the validation data {cfg.val_data!r}")
    if not untouched:
        return None
    one = len(untouched) == 1
    return (f"--trust-sizes-json: {' and '.join(untouched)} {'is' if one else 'are'} not indexable .tar shards beside "
            f"a sizes.json listing each of them; the flag changes nothing for {'it' if one else 'them'}"
            + (f", and plans the validation data {cfg.val_data!r} from its sizes.json alone" if val_trusted else ""))


def _listed_shards(cfg: DataConfig, split: str) -> bool:
    """Whether `split`'s data holds .tar shards its loader plans from a sizes.json listing each of them (what
    --trust-sizes-json applies to), found without building the loader: a local or remote `sizes.json` is read."""
    resolved = cfg.source(split)
    if resolved is None or resolved[0] not in ("webdataset", "parquet") or resolved[1] is None:
        return False
    parts = [expand_shards(part) for part in resolved[1].split("::") if not is_parquet(part)]
    mixed_in_tables = any(is_parquet(part) for part in resolved[1].split("::"))
    if not mixed_in_tables and not all(is_indexable(url) for urls in parts for url in urls):
        return False  # streamed
    return any(urls and all(is_indexable(url) for url in urls) and read_sizes(urls) is not None for urls in parts)


def _planned_from_sizes_json(loader: NaFlexLoader) -> bool:
    """Whether any of the loader's shards are planned from a sizes.json (what --trust-sizes-json applies to)."""
    source = getattr(loader, "source", None)
    return any(isinstance(part, SizedShardSource) for part in getattr(source, "sources", [source]))


def _check_trainable(loader: NaFlexLoader, world_size: int) -> None:
    """Refuse an epoch no contrastive step can learn from: one sample (its loss is 0, it has no negative), or fewer
    samples than ranks (no step at all: the run would train nothing and save a checkpoint)."""
    num = loader.samples_per_epoch
    if num < 2 or loader.num_batches == 0:
        ranks = f" for {world_size} ranks" if world_size > 1 else ""
        raise DataError(f"training data {loader.name!r} has {num} usable sample{'' if num == 1 else 's'}{ranks}: a "
                        "contrastive step needs at least 2 (each example's negatives are the others)"
                        + (" and one on every rank" if world_size > 1 else ""))


def build_zero_shot_loader(
    cfg: DataConfig, *, patch_size: int, context_length: int, num_samples: int = 500,
    processing: Processing | None = None,
) -> NaFlexLoader:
    """Single-object synthetic validation images with "labels": {"shape", "colour", "size"}: long [B].

    Microbatches at max(--naflex-seq-lens), deterministic eval transform, fixed order; one process. `processing`:
    as `build_loader`'s.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    builder = MicrobatchBuilder(patch_size=patch_size, context_length=context_length,
                                processing=_processing(cfg, processing, patch_size, augment=False))
    return MapLoader(ZeroShotSource(cfg.synthetic_seed, num_samples), split="zeroshot",
                     budget=cfg.token_budget().at_longest(), builder=builder, seed=cfg.seed, shuffle=False,
                     workers=cfg.workers)

