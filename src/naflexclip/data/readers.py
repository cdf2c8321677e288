"""Data sources: the built-in synthetic splits, CSV/TSV tables, image+.txt folders, and WebDataset streams.

Map-style sources (synthetic, CSV, folder; local shards in `shard_index`) are `Source`s. Shards that
cannot be indexed are read as a stream by `shard_samples`, one shard at a time so that a truncated shard
costs only its unread tail.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from PIL import Image
from webdataset.gopen import gopen
from webdataset.shardlists import expand_urls
from webdataset.tariterators import base_plus_ext

from naflexclip.data.samples import IMAGE_EXTENSIONS, SkipSample, decode_caption, read_image_file
from naflexclip.data.synthetic import synthetic_scene, zero_shot_sample

CAPTION_EXTENSIONS = ("txt", "text", "caption")
# suffixes that end a member's key (see `member_key`): images, captions and the json metadata
KEY_SUFFIXES = (*IMAGE_EXTENSIONS, *CAPTION_EXTENSIONS, "json")
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's metadata members (`__key__`, ...), not sample data


DUPLICATE_DETAIL = "several samples of this shard have this key; each trains (OpenCLIP's grouping)"


class DataError(RuntimeError):
    """The data source cannot feed the run (nothing usable, missing files); the message names the source."""


@dataclass(frozen=True)
class MemberKeys:
    """Which tar members of a sample are its image and its caption: OpenCLIP's `--image-key` and `--text-key`
    (suffixes, the first present in this order), or the `.json` member with `--json-text-key`."""

    image: tuple[str, ...] = ("jpg", "png", "jpeg", "webp")
    text: tuple[str, ...] = ("txt",)
    json: bool = False

    @property
    def caption(self) -> tuple[str, ...]:
        """The suffixes a caption is read from, in priority order."""
        return ("json",) if self.json else self.text

    def pick(self, members: dict[str, Any]) -> tuple[Any, Any]:
        """(image, caption) of a sample's members by suffix: the first present of each list, else None."""
        image = next((members[e] for e in self.image if e in members), None)
        caption = next((members[e] for e in self.caption if e in members), None)
        return image, caption


DEFAULT_MEMBER_KEYS = MemberKeys()


@dataclass
class RawSample:
    """Undecoded sample: image as bytes (or an already-decoded PIL image), caption as bytes/str (or several
    captions of the image, a list), labels."""

    image: bytes | Image.Image | None
    caption: bytes | str | list[str] | None
    labels: dict[str, int] | None = None
    key: str = ""
    regions: Any = None  # the sample's regions: its .json (bytes, str or parsed; `naflexclip.data.regions`)


class Source(Protocol):
    """A map-style reader: `len()` samples, each read by its index, so an epoch can visit them in any order.

    `name` names it in messages; `index_skips` are the skip records of the samples found unusable before any
    decoding (missing files, malformed rows, missing captions), which `len()` does not count; `group_size` is
    how many consecutive indices the epoch's shuffle keeps together (1: none).
    """

    name: str
    index_skips: list[dict[str, Any]]
    group_size: int

    def __len__(self) -> int: ...

    def load(self, index: int) -> RawSample:
        """Sample `index`, undecoded; raises `SkipSample` when it cannot be read."""
        ...

    def describe(self, index: int) -> tuple[str, str, int | None]:
        """Where sample `index` is, for the skip log: (source, key or path, line or None)."""
        ...


class SyntheticSource:
    """The built-in dataset's `split` ("train"/"val") as a map-style source of `size` samples.

    `group_size` > 1: scenes come in shape groups of that many consecutive indices, which the loader's
    shuffle keeps together (see `synthetic_sample`)."""

    def __init__(self, seed: int, split: str, size: int, group_size: int = 1, multi_caption: bool = False) -> None:
        self.seed, self.split, self.size, self.group_size = seed, split, size, group_size
        self.multi_caption = multi_caption  # 2-5 captions per scene (`synthetic_captions`)
        self.name = f"synthetic:{split}[{size}]"
        self.index_skips: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return self.size

    def describe(self, index: int) -> tuple[str, str, int | None]:
        return self.name, str(index), None

    def load(self, index: int) -> RawSample:
        img, caption, regions = synthetic_scene(self.seed, self.split, index, self.group_size, self.multi_caption)
        return RawSample(img, caption, None, str(index), {"regions": regions})


class ZeroShotSource:
    """Single-object synthetic validation images with shape/colour/size labels."""

    group_size = 1

    def __init__(self, seed: int, size: int) -> None:
        self.seed, self.size = seed, size
        self.name = f"synthetic:zeroshot[{size}]"
        self.index_skips: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return self.size

    def describe(self, index: int) -> tuple[str, str, int | None]:
        return self.name, str(index), None

    def load(self, index: int) -> RawSample:
        img, caption, labels = zero_shot_sample(self.seed, index)
        return RawSample(img, caption, labels, str(index))


def skip_record(source: str, key: str | None, line: int | None, reason: str, detail: str = "") -> dict[str, Any]:
    """One entry of the skip log: where the sample is (source, key or path, line) and why it was skipped."""
    return {"source": source, "key": key, "line": line, "reason": reason, "detail": detail}


def split_row(line: str, separator: str) -> list[str]:
    """One table line into fields. A field is quoted only when it is wholly quoted (RFC 4180: `"a ""b"" c"`
    is `a "b" c`, and may hold the separator); any other quote is text (`"The Best" of summer` keeps its
    quotes, an unbalanced `"` stays in its field). A row never continues on the next line."""
    fields: list[str] = []
    i, n = 0, len(line)
    while True:
        end = -1
        if line.startswith('"', i):
            j, text = i + 1, []
            while j < n:
                if line[j] == '"':
                    if line.startswith('"', j + 1):
                        text.append('"')
                        j += 2
                        continue
                    end = j + 1
                    break
                text.append(line[j])
                j += 1
            if end != -1 and (end == n or line.startswith(separator, end)):
                fields.append("".join(text))
            else:
                end = -1
        if end == -1:  # plain field: up to the next separator, quotes and all
            end = line.find(separator, i)
            end = n if end == -1 else end
            fields.append(line[i:end])
        if end >= n:
            return fields
        i = end + len(separator)
        if i == n:
            fields.append("")
            return fields


def _separator_hint(path: str, header: str, separator: str, wanted: tuple[str, str]) -> str:
    for sep, flag in ((",", ","), ("\t", "$'\\t'"), (";", "';'"), ("|", "'|'")):
        if sep != separator and all(w in [c.strip() for c in split_row(header, sep)] for w in wanted):
            return f"; the header splits on {sep!r}: pass --csv-separator {flag}"
    if path.lower().endswith(".csv") and separator == "\t":
        return "; --csv-separator defaults to a tab (OpenCLIP's convention): pass --csv-separator , for a .csv"
    return ""


class CsvSource:
    """Rows of a CSV/TSV file: image path column `img_key`, caption column `caption_key` (OpenCLIP names).

    One row per line (see `split_row`); a UTF-8 byte-order mark is ignored. Rows that do not split into
    the header's columns and rows whose image file does not exist are found when the table is read
    (one stat per row) and listed in `index_skips` with their line numbers; the epoch plan holds the
    others. Relative image paths are looked up next to the table first, then from the working directory.

    Rows naming the same image file (wherever they are in the table) are one sample with several captions, at its
    first row's place: an epoch visits every image once (`MicrobatchBuilder` takes one caption per epoch, or all of
    them with --multi-positive). Of such rows, one whose caption is empty or not UTF-8 is left out and listed in
    `index_skips`; the image trains with the others (if none is usable, it keeps its first and is skipped when read).
    """

    group_size = 1

    def __init__(self, path: str, img_key: str, caption_key: str, separator: str) -> None:
        if not os.path.isfile(path):
            raise DataError(f"CSV data file not found: {path}")
        if not separator:
            raise DataError("--csv-separator must not be empty")
        self.name = path
        self.root = os.path.dirname(os.path.abspath(path))
        self.index_skips: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.captions: list[list[str]] = []  # each image's captions, one per row in table order
        self.caption_lines: list[list[int]] = []
        self.keys: list[str] = []
        self.lines: list[int] = []
        sample_of: dict[str, int] = {}  # image file -> its sample
        # surrogateescape keeps non-UTF-8 caption bytes around so the row is skipped, not the file
        with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
            header = f.readline().rstrip("\r\n").lstrip("\ufeff")
            columns = [c.strip() for c in split_row(header, separator)]
            for flag, key in (("--csv-img-key", img_key), ("--csv-caption-key", caption_key)):
                if key not in columns:
                    hint = _separator_hint(path, header, separator, (img_key, caption_key))
                    raise DataError(f"{flag} {key!r} is not a column of {path} "
                                    f"(columns with --csv-separator {separator!r}: {columns}){hint}")
            img_col, cap_col = columns.index(img_key), columns.index(caption_key)
            for lineno, text in enumerate(f, start=2):
                text = text.rstrip("\r\n")
                if not text.strip():
                    continue  # blank lines (a trailing newline, spacing) are not rows
                fields = split_row(text, separator)
                if len(fields) != len(columns):
                    self.index_skips.append(skip_record(
                        path, None, lineno, "malformed_row",
                        f"{len(fields)} fields with --csv-separator {separator!r}, the header has {len(columns)}"))
                    continue
                image_path = fields[img_col]
                resolved = self._resolve(image_path) if image_path else None
                if resolved is None:
                    self.index_skips.append(skip_record(path, image_path, lineno, "missing_file",
                                                        f"not found beside {path} nor from {os.getcwd()}"))
                    continue
                index = sample_of.setdefault(os.path.normpath(os.path.abspath(resolved)), len(self.paths))
                if index == len(self.paths):
                    self.paths.append(resolved)
                    self.captions.append([])
                    self.caption_lines.append([])
                    self.keys.append(image_path)
                    self.lines.append(lineno)
                self.captions[index].append(fields[cap_col])
                self.caption_lines[index].append(lineno)
        for index, captions in enumerate(self.captions):
            if len(captions) > 1:
                self.captions[index] = self._usable_captions(path, self.keys[index], captions,
                                                             self.caption_lines[index])

    def _usable_captions(self, path: str, key: str, captions: list[str], lines: list[int]) -> list[str]:
        """The captions of an image's rows that decode; each one that does not is an index skip of its row."""
        usable = []
        for caption, lineno in zip(captions, lines, strict=True):
            try:
                decode_caption(caption)
                usable.append(caption)
            except SkipSample as skip:
                self.index_skips.append(skip_record(path, key, lineno, skip.reason, str(skip)))
        if not usable:  # the first row stays: reading the sample skips it, by its reason
            self.index_skips.pop(-len(captions))
            return captions[:1]
        return usable

    def __len__(self) -> int:
        return len(self.paths)

    def _resolve(self, image_path: str) -> str | None:
        """The image file: beside the table first, then from the working directory; None if neither exists."""
        if os.path.isabs(image_path):
            return image_path if os.path.isfile(image_path) else None
        beside = os.path.join(self.root, image_path)
        if os.path.isfile(beside):
            return beside
        return image_path if os.path.isfile(image_path) else None

    def describe(self, index: int) -> tuple[str, str, int | None]:
        """(source, key, line) of sample `index`, for the skip log."""
        return self.name, self.keys[index], self.lines[index]

    def load(self, index: int) -> RawSample:
        image = read_image_file(self.paths[index])
        captions = self.captions[index]
        return RawSample(image, captions[0] if len(captions) == 1 else captions, None, self.keys[index],
                         sidecar_regions(self.paths[index]))


def walk_folder(root: str) -> Iterator[tuple[str, list[str]]]:
    """(folder, file names) of every folder under `root`, top-down with sub-folders in sorted order. Symbolic
    links to folders are followed, each real folder once (no loops, no doubles); file names are as listed
    (links to files included, broken ones too)."""
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, files in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames.sort()
        yield dirpath, files


class FolderSource:
    """A directory tree of images, each captioned by the .txt file with the same stem (`a.b.jpg` -> `a.b.txt`).

    Symbolic links to folders are followed, each real folder once (no loops, no doubles). Images that
    share a stem (`dup.jpg`, `dup.png` beside `dup.txt`) are each a sample with that caption. Images
    without a caption file are listed in `index_skips` (`missing_caption`).
    """

    group_size = 1

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise DataError(f"image folder not found: {root}")
        self.name = root
        images: list[tuple[str, str]] = []  # (stem key, path)
        captions: dict[str, str] = {}
        for dirpath, files in walk_folder(root):
            for fname in files:
                stem, dot, ext = fname.rpartition(".")
                if not dot:
                    continue
                key = os.path.join(dirpath, stem)
                if ext.lower() in IMAGE_EXTENSIONS:
                    images.append((key, os.path.join(dirpath, fname)))
                elif ext.lower() in CAPTION_EXTENSIONS:
                    captions[key] = os.path.join(dirpath, fname)
        if not images:
            raise DataError(f"no images ({'/'.join(IMAGE_EXTENSIONS)}) found under {root}")
        self.index_skips: list[dict[str, Any]] = []
        self.items: list[tuple[str, str]] = []
        for key, path in sorted(images, key=lambda kp: kp[1]):
            if key in captions:
                self.items.append((path, captions[key]))
            else:
                self.index_skips.append(skip_record(root, path, None, "missing_caption", f"no {key}.txt"))

    def __len__(self) -> int:
        return len(self.items)

    def describe(self, index: int) -> tuple[str, str, int | None]:
        return self.name, self.items[index][0], None

    def load(self, index: int) -> RawSample:
        image_path, caption_path = self.items[index]
        image = read_image_file(image_path)
        with open(caption_path, "rb") as f:
            caption = f.read()
        return RawSample(image, caption, None, image_path, sidecar_regions(image_path))


def sidecar_regions(image_path: str) -> bytes | None:
    """The `.json` beside an image file (same stem: `a.jpg` -> `a.json`), which may hold its regions; None if none."""
    try:
        with open(os.path.splitext(image_path)[0] + ".json", "rb") as f:
            return f.read()
    except OSError:
        return None


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


def read_sizes(urls: list[str]) -> np.ndarray | None:
    """Samples per shard from the OpenCLIP-style `sizes.json` beside them (shard file name -> count), or None
    unless one lists every shard."""
    tables: dict[str, dict[str, Any] | None] = {}
    sizes = np.zeros(len(urls), dtype=np.int64)
    for i, url in enumerate(urls):
        directory, _, name = url.rpartition("/")
        if directory not in tables:
            path = os.path.join(directory, "sizes.json")
            try:
                with open(path) as f:
                    tables[directory] = json.load(f)
            except (OSError, ValueError):
                tables[directory] = None
        table = tables[directory]
        if table is None or name not in table:
            return None
        sizes[i] = int(table[name])
    return sizes


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
    """What reading shards went wrong with, per epoch: each bad shard (and each sample a truncation cut)
    logged once."""

    seen: set = field(default_factory=set)
    records: list = field(default_factory=list)

    def record(self, reason: str, url: str, key: str | None = None, detail: str = "") -> None:
        if (reason, url, key) not in self.seen:
            self.seen.add((reason, url, key))
            self.records.append(skip_record(url, key, None, reason, detail))


def shard_samples(url: str, log: ShardReadLog, keys: MemberKeys = DEFAULT_MEMBER_KEYS) -> Iterator[RawSample]:
    """Samples of one tar shard, in order. A truncated or corrupt shard ends early and is logged once; a
    sample whose member data the damage cut is left out and logged, the samples before it are kept."""
    try:
        stream = gopen(url, "rb")
    except OSError:
        log.record("missing_shard", url)
        return
    sample: dict | None = None  # the sample being grouped: consecutive members with the same key
    seen: set[str] = set()  # the shard's keys so far
    reading = None  # the member whose data is being read
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for info in tar:
                tar.members = []  # a stream keeps no member list: memory stays flat over a shard
                if not info.isreg() or _META.match(info.name):
                    continue
                reading = info.name
                data = tar.extractfile(info).read()
                reading = None
                key, ext = member_key(info.name)
                if sample is None or new_sample(key, ext, sample["__key__"], sample.keys()):
                    if sample is not None:
                        yield _raw_sample(url, sample, keys)
                    if key in seen:
                        log.record("duplicate_key", url, key, DUPLICATE_DETAIL)
                    seen.add(key)
                    sample = {"__key__": key}
                if key == sample["__key__"]:
                    sample[ext] = data
    except (tarfile.TarError, OSError, EOFError, ValueError):
        log.record("truncated_shard", url)
        if reading is not None:  # only the sample the cut member belongs to is lost
            cut = member_key(reading)[0]
            if sample is not None and same_sample(cut, sample["__key__"]):
                cut, sample = sample["__key__"], None
            log.record("truncated_sample", url, cut, "the shard ends inside this sample's data")
    finally:
        stream.close()
    if sample is not None:
        yield _raw_sample(url, sample, keys)


def member_key(name: str) -> tuple[str, str]:
    """(sample key, extension) of a tar member name. WebDataset's key ends at the file name's first dot;
    when the last suffix is an image or caption extension the key is everything before it instead, so
    `img.v2.3.jpg` is sample `img.v2.3` with extension `jpg`."""
    directory, _, fname = name.rpartition("/")
    stem, dot, ext = fname.rpartition(".")
    if dot and stem and ext.lower() in KEY_SUFFIXES:
        return (f"{directory}/{stem}" if directory else stem), ext.lower()
    key, suffix = base_plus_ext(name)
    return key or name, (suffix or "").lower()


def new_sample(key: str, ext: str, current: str, exts: Container[str]) -> bool:
    """A member (`key`, `ext`) starts a new sample after the sample `current` whose suffixes are `exts`: another
    key, or the same key with a suffix it already has (`k5.jpg k5.txt k5.jpg k5.txt` is two samples, as
    OpenCLIP's grouping makes it)."""
    return not same_sample(key, current) or (key == current and ext in exts)


def same_sample(key: str, current: str | None) -> bool:
    """A member with `key` continues the sample `current` (consecutive members; `k.seg.png` joins `k`)."""
    return current is not None and (key == current or key.startswith(current + "."))


def _raw_sample(url: str, sample: dict, keys: MemberKeys) -> RawSample:
    image, caption = keys.pick(sample)
    return RawSample(image, caption, None, f"{url}:{sample['__key__']}", sample.get("json"))
