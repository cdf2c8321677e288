"""Data sources: the built-in synthetic splits here; CSV/TSV tables are in `tables`, image+.txt folders in `folders`,
WebDataset streams in `shards` (the reader interface: `source`).

Map-style sources (synthetic, CSV, folder; indexed shards in `shard_sources`) are `Source`s. Shards that
cannot be indexed are read as a stream by `shard_samples`, one shard at a time so that a truncated shard
costs only its unread tail.
"""

from __future__ import annotations

from typing import Any

from naflexclip.data.source import RawSample
from naflexclip.data.synthetic import synthetic_scene, zero_shot_sample


class _GeneratedSource:
    """Samples 0..size-1 generated from a seed: every index is readable, named by its number in the skip log."""

    group_size = 1

    def __init__(self, seed: int, size: int, name: str) -> None:
        self.seed, self.size, self.name = seed, size, name
        self.index_skips: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return self.size

    def describe(self, index: int) -> tuple[str, str, int | None]:
        return self.name, str(index), None


class SyntheticSource(_GeneratedSource):
    """The built-in dataset's `split` ("train"/"val") as a map-style source of `size` samples.

    `group_size` > 1: scenes come in shape groups of that many consecutive indices, which the loader's
    shuffle keeps together (see `synthetic_sample`)."""

    def __init__(self, seed: int, split: str, size: int, group_size: int = 1, multi_caption: bool = False) -> None:
        super().__init__(seed, size, f"synthetic:{split}[{size}]")
        self.split, self.group_size = split, group_size
        self.multi_caption = multi_caption  # 2-5 captions per scene (`synthetic_captions`)

    def load(self, index: int) -> RawSample:
        img, caption, regions = synthetic_scene(self.seed, self.split, index, self.group_size, self.multi_caption)
        return RawSample(img, caption, None, str(index), {"regions": regions})


class ZeroShotSource(_GeneratedSource):
    """Single-object synthetic validation images with shape/colour/size labels."""

    def __init__(self, seed: int, size: int) -> None:
        super().__init__(seed, size, f"synthetic:zeroshot[{size}]")

    def load(self, index: int) -> RawSample:
        img, caption, labels = zero_shot_sample(self.seed, index)
        return RawSample(img, caption, labels, str(index))
