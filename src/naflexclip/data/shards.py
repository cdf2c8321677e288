"""WebDataset tar shards: their specs (`expand_shards`, `check_shards`), sizes (`sizes.json` or tar headers), how
members group into samples (`member_key`, `new_sample`), and reading a shard as a stream (`shard_samples`), one
shard at a time so that a truncated shard costs only its unread tail. Local shards are read by offset in
`shard_index`.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from webdataset.gopen import gopen
from webdataset.shardlists import expand_urls
from webdataset.tariterators import base_plus_ext

from naflexclip.data import remote
from naflexclip.data.samples import IMAGE_EXTENSIONS
from naflexclip.data.source import CAPTION_EXTENSIONS, EITHER_DATA_FLAG, DataError, RawSample, skip_record

# suffixes that end a member's key (see `member_key`): images, captions and the json metadata
KEY_SUFFIXES = (*IMAGE_EXTENSIONS, *CAPTION_EXTENSIONS, "json")
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's metadata members (`__key__`, ...), not sample data
DUPLICATE_DETAIL = "several samples of this shard have this key; each trains (OpenCLIP's grouping)"


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


def expand_shards(urls: str) -> list[str]:
    """Brace- and '::'-expand a shard spec ("shards/{00000..00031}.tar") into a list of URLs."""
    return list(expand_urls(urls))


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:")


def check_shards(urls: list[str], spec: str) -> None:
    """Fail early, naming `spec`, when none of its local shards exist."""
    local = [u for u in urls if _is_local(u)]
    if not urls or (local and len(local) == len(urls) and not any(os.path.isfile(u) for u in local)):
        raise DataError(f"no shard of {EITHER_DATA_FLAG} {spec!r} exists (expanded to {len(urls)} urls)")


def read_sizes(urls: list[str], problems: list[str] | None = None) -> np.ndarray | None:
    """Samples per shard from the OpenCLIP-style `sizes.json` beside them (shard file name -> count), or None
    unless one lists every shard. A sizes.json that is there but cannot be used (not JSON, not an object, a count
    that is not a whole number >= 0, a shard left out) also gives None; `problems` gets one line naming it."""
    tables: dict[str, dict[str, Any] | None] = {}
    sizes = np.zeros(len(urls), dtype=np.int64)
    for i, url in enumerate(urls):
        directory, _, name = url.rpartition("/")
        path = os.path.join(directory, "sizes.json")
        if directory not in tables:
            tables[directory] = _sizes_table(path, problems)
        table = tables[directory]
        if table is None:
            return None
        count = sample_count(table[name]) if name in table else None
        if count is None:
            _unusable(problems, path, f"{name!r}: {table[name]!r} is not a sample count" if name in table else
                      f"lists no {name!r}")
            return None
        sizes[i] = count
    return sizes


def sample_count(value: Any) -> int | None:
    """A sizes.json count as OpenCLIP's int() reads it (16, "16", 16.0), or None where it is not a whole number
    >= 0 (int() would truncate 15.5 and take -3)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, (int, float)) and value >= 0 and float(value).is_integer():
        return int(value)
    return None


def _sizes_table(path: str, problems: list[str] | None) -> dict[str, Any] | None:
    """sizes.json at `path` as an object, or None: absent (said nothing of) or unusable (said in `problems`)."""
    try:
        if remote.is_remote(path):
            text = remote.read_bytes(path)
        else:
            with open(path, "rb") as f:
                text = f.read()
    except FileNotFoundError:
        return None
    except (OSError, remote.Unreachable) as error:
        if isinstance(error, remote.Unreachable) and error.missing:
            return None
        _unusable(problems, path, f"cannot be read ({type(error).__name__})")
        return None
    try:
        table = json.loads(text)
    except ValueError as error:
        _unusable(problems, path, f"not JSON ({str(error).splitlines()[0]})")
        return None
    if not isinstance(table, dict):
        _unusable(problems, path, f"not an object of shard name -> sample count (a {type(table).__name__})")
        return None
    return table


def _unusable(problems: list[str] | None, path: str, what: str) -> None:
    if problems is not None:
        problems.append(f"{path}: {what}; every shard is indexed instead, all its samples train")


def count_shard_samples(urls: list[str]) -> int:
    """Samples in local shards: from an OpenCLIP-style sizes.json beside them, else by reading tar headers."""
    sizes: dict[str, int] = {}
    for directory in {os.path.dirname(u) for u in urls}:
        table = _sizes_table(os.path.join(directory, "sizes.json"), None) or {}  # unusable: counted from headers
        listed = {os.path.join(directory, k): sample_count(v) for k, v in table.items()}
        sizes.update({url: count for url, count in listed.items() if count is not None})
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
