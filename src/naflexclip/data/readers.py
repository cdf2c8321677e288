"""Data sources: the built-in synthetic splits, CSV/TSV tables, image+.txt folders, and WebDataset shards.

Map-style sources (synthetic, CSV, folder) expose `len()` and `load(index) -> RawSample`; a
missing file raises SkipSample. WebDataset shards are read as a stream by `shard_samples`, through
the `webdataset` library's tar iterators, one shard at a time so that a truncated shard costs
only its unread tail.
"""

from __future__ import annotations

import csv
import json
import os
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from PIL import Image
from webdataset.gopen import gopen
from webdataset.handlers import reraise_exception
from webdataset.shardlists import expand_urls
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from naflexclip.data.samples import IMAGE_EXTENSIONS, SkipSample, read_image_file
from naflexclip.data.synthetic import synthetic_sample, zero_shot_sample

CAPTION_EXTENSIONS = ("txt", "text", "caption")


class DataError(RuntimeError):
    """The data source cannot feed the run (nothing usable, missing files); the message names the source."""


@dataclass
class RawSample:
    """Undecoded sample: image as bytes (or an already-decoded PIL image), caption as bytes/str, labels."""

    image: bytes | Image.Image | None
    caption: bytes | str | None
    labels: dict[str, int] | None = None
    key: str = ""


class SyntheticSource:
    """The built-in dataset's `split` ("train"/"val") as a map-style source of `size` samples.

    `group_size` > 1: scenes come in shape groups of that many consecutive indices, which the loader's
    shuffle keeps together (see `synthetic_sample`)."""

    def __init__(self, seed: int, split: str, size: int, group_size: int = 1) -> None:
        self.seed, self.split, self.size, self.group_size = seed, split, size, group_size
        self.name = f"synthetic:{split}[{size}]"

    def __len__(self) -> int:
        return self.size

    def load(self, index: int) -> RawSample:
        img, caption = synthetic_sample(self.seed, self.split, index, self.group_size)
        return RawSample(img, caption, None, str(index))


class ZeroShotSource:
    """Single-object synthetic validation images with shape/colour/size labels."""

    def __init__(self, seed: int, size: int) -> None:
        self.seed, self.size = seed, size
        self.name = f"synthetic:zeroshot[{size}]"

    def __len__(self) -> int:
        return self.size

    def load(self, index: int) -> RawSample:
        img, caption, labels = zero_shot_sample(self.seed, index)
        return RawSample(img, caption, labels, str(index))


class CsvSource:
    """Rows of a CSV/TSV file: image path column `img_key`, caption column `caption_key` (OpenCLIP names).

    Relative image paths are looked up next to the table first, then from the working directory.
    """

    def __init__(self, path: str, img_key: str, caption_key: str, separator: str) -> None:
        if not os.path.isfile(path):
            raise DataError(f"CSV data file not found: {path}")
        self.name = path
        self.root = os.path.dirname(os.path.abspath(path))
        # surrogateescape keeps non-UTF-8 caption bytes around so the row is skipped, not the file
        with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
            reader = csv.DictReader(f, delimiter=separator)
            columns = reader.fieldnames or []
            for flag, key in (("--csv-img-key", img_key), ("--csv-caption-key", caption_key)):
                if key not in columns:
                    raise DataError(f"{flag} {key!r} is not a column of {path} (columns: {columns})")
            self.rows = [(row[img_key], row[caption_key]) for row in reader]

    def __len__(self) -> int:
        return len(self.rows)

    def _resolve(self, image_path: str) -> str:
        if os.path.isabs(image_path):
            return image_path
        beside = os.path.join(self.root, image_path)
        return beside if os.path.exists(beside) or not os.path.exists(image_path) else image_path

    def load(self, index: int) -> RawSample:
        image_path, caption = self.rows[index]
        if not image_path:
            raise SkipSample("missing_file", f"row {index} has an empty {image_path!r}")
        return RawSample(read_image_file(self._resolve(image_path)), caption, None, image_path)


class FolderSource:
    """A directory tree of images, each captioned by the .txt file with the same stem."""

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise DataError(f"image folder not found: {root}")
        self.name = root
        images: dict[str, str] = {}
        captions: dict[str, str] = {}
        for dirpath, _, files in os.walk(root):
            for fname in files:
                stem, _, ext = fname.rpartition(".")
                key = os.path.join(dirpath, stem)
                if ext.lower() in IMAGE_EXTENSIONS:
                    images[key] = os.path.join(dirpath, fname)
                elif ext.lower() in CAPTION_EXTENSIONS:
                    captions[key] = os.path.join(dirpath, fname)
        self.items = sorted((path, captions.get(key)) for key, path in images.items())
        if not self.items:
            raise DataError(f"no images ({'/'.join(IMAGE_EXTENSIONS)}) found under {root}")

    def __len__(self) -> int:
        return len(self.items)

    def load(self, index: int) -> RawSample:
        image_path, caption_path = self.items[index]
        caption = None
        if caption_path is not None:
            with open(caption_path, "rb") as f:
                caption = f.read()
        return RawSample(read_image_file(image_path), caption, None, image_path)


def expand_shards(urls: str) -> list[str]:
    """Brace- and '::'-expand a shard spec ("shards/{00000..00031}.tar") into a list of URLs."""
    return list(expand_urls(urls))


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:")


def check_shards(urls: list[str], spec: str) -> None:
    """Fail early, naming `spec`, when none of its local shards exist."""
    local = [u for u in urls if _is_local(u)]
    if not urls or (local and len(local) == len(urls) and not any(os.path.isfile(u) for u in local)):
        raise DataError(f"no shard of --train-data/--val-data {spec!r} exists (expanded to {len(urls)} urls)")


def count_shard_samples(urls: list[str]) -> int:
    """Samples in local shards: from an OpenCLIP-style sizes.json beside them, else by reading tar headers."""
    sizes: dict[str, int] = {}
    for directory in {os.path.dirname(u) for u in urls}:
        path = os.path.join(directory, "sizes.json")
        if os.path.isfile(path):
            with open(path) as f:
                sizes.update({os.path.join(directory, k): int(v) for k, v in json.load(f).items()})
    total = 0
    for url in urls:
        if url in sizes:
            total += sizes[url]
            continue
        if not (_is_local(url) and os.path.isfile(url)):
            continue
        keys = set()
        try:
            with tarfile.open(url, "r:") as tar:
                for member in tar:
                    if member.isreg():
                        keys.add(base_plus_ext(member.name)[0])
        except (tarfile.TarError, OSError, EOFError):
            pass  # truncated shard: count what is readable
        total += len(keys)
    return total


@dataclass
class ShardReadLog:
    """What reading shards went wrong with, per epoch: each bad shard counted once."""

    counts: Counter = field(default_factory=Counter)
    bad_urls: set = field(default_factory=set)

    def record(self, reason: str, url: str) -> None:
        if url not in self.bad_urls:
            self.bad_urls.add(url)
            self.counts[reason] += 1


def shard_samples(url: str, log: ShardReadLog) -> Iterator[RawSample]:
    """Samples of one tar shard, in order; a truncated/corrupt shard ends early and is logged once."""
    try:
        stream = gopen(url, "rb")
    except OSError:
        log.record("missing_shard", url)
        return
    try:
        files = tar_file_expander([{"url": url, "stream": stream}], handler=reraise_exception)
        for sample in group_by_keys(files, handler=reraise_exception):
            yield _raw_from_wds(sample)
    except (tarfile.TarError, OSError, EOFError, ValueError):
        log.record("truncated_shard", url)
    finally:
        stream.close()


def _raw_from_wds(sample: dict) -> RawSample:
    image = next((sample[e] for e in IMAGE_EXTENSIONS if e in sample), None)
    caption = next((sample[e] for e in CAPTION_EXTENSIONS if e in sample), None)
    return RawSample(image, caption, None, f"{sample.get('__url__', '')}:{sample.get('__key__', '')}")
