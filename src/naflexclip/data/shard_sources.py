"""The map-style sources over indexed WebDataset shards, local or in object storage: `IndexedShardSource` (every
shard indexed, its samples by offset) and `SizedShardSource` (shards counted by `sizes.json` or their cached index,
each indexed when first read). The indexes themselves: `shard_index`."""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from naflexclip.data import remote
from naflexclip.data.samples import SkipSample
from naflexclip.data.shard_index import (
    SHARD_STATUS_REASONS,
    ShardIndex,
    held_samples,
    known_keys,
    load_shard_index,
    load_shard_indexes,
    shard_pins,
)
from naflexclip.data.shards import (
    DEFAULT_MEMBER_KEYS,
    DUPLICATE_DETAIL,
    MemberKeys,
)
from naflexclip.data.source import RawSample, skip_record


def unusable_reason(row: np.ndarray) -> str | None:
    """Why an index row's sample cannot train (no image, a zero-byte image, no caption), None when it can."""
    return ("missing_image" if row[0] < 0 else "empty_image" if row[1] == 0
            else "missing_caption" if row[2] < 0 else None)


def read_sample(url: str, key: str, row: np.ndarray, version: str | None = None,
                notes: list[dict[str, Any]] | None = None, shard_fd: Callable[[], int] | None = None) -> RawSample:
    """An indexed shard's sample by its index row (image, caption and .json member offset and size): a remote
    shard's members in one ranged request, a local shard's by `pread`. A local shard gone since it was indexed skips
    the sample as `missing_shard`, as a shard that cannot be opened; a remote read failing for good as
    `unreachable_shard` (`missing_shard`: the object is gone), naming the URL and the error, and a shard no longer at
    its pinned `version` as `shard_changed`: the names its index gives the same faults. `notes`: as
    `RawSample.notes`; `shard_fd`: the local shard's open descriptor, kept by the caller (else opened for this read)."""
    img_off, img_size, cap_off, cap_size, json_off, json_size = (int(v) for v in row)
    if remote.is_remote(url):
        try:
            image, caption, regions = remote.read_spans(url, [(img_off, img_size), (cap_off, cap_size),
                                                              (json_off, json_size)], version)
        except remote.Unreachable as error:
            reason = SHARD_STATUS_REASONS["missing" if error.missing else "unreachable"]
            raise SkipSample(reason, str(error), notes=notes) from None
        except remote.Changed as error:
            raise SkipSample("shard_changed", str(error), notes=notes) from None
        return RawSample(image, caption, None, f"{url}:{key}", regions, notes or [])
    try:
        fd = shard_fd() if shard_fd is not None else os.open(url, os.O_RDONLY)
        try:
            image = os.pread(fd, img_size, img_off)  # pread: no shared file position between threads or forks
            caption = os.pread(fd, cap_size, cap_off)
            regions = os.pread(fd, json_size, json_off) if json_off >= 0 else None
        finally:
            if shard_fd is None:
                os.close(fd)
    except OSError as error:
        raise SkipSample("missing_shard", f"{url}: {error.strerror}", notes=notes) from None
    return RawSample(image, caption, None, f"{url}:{key}", regions, notes or [])


class IndexedShardSource:
    """Local tar shards as a map-style source: `load(i)` reads sample i's image and caption by offset.

    Samples with no image, no caption or a zero-byte image, samples cut by a truncated shard, and missing or
    truncated shards, are found by indexing and listed in `index_skips`; `len()` counts the others.
    """

    group_size = 1

    def __init__(self, spec: str, urls: list[str], cache_dir: str | None = None,
                 member_keys: MemberKeys = DEFAULT_MEMBER_KEYS) -> None:
        self.name = spec
        self.urls = urls
        self.index_skips: list[dict[str, Any]] = []
        shard_ids, keys, offsets = [], [], []
        indexes = load_shard_indexes(urls, cache_dir, member_keys, shard_pins(urls))
        self.versions = [index.version for index in indexes]  # what every read of a remote shard must find
        for shard_id, index in enumerate(indexes):
            url = index.url
            if index.status != "ok":
                self.index_skips.append(skip_record(url, None, None, SHARD_STATUS_REASONS[index.status],
                                                    index.detail))
            for key in index.duplicates:
                self.index_skips.append(skip_record(url, key, None, "duplicate_key", DUPLICATE_DETAIL))
            if index.cut is not None:
                self.index_skips.append(skip_record(url, index.cut, None, "truncated_sample",
                                                    "the shard ends inside this sample's data"))
            for key, row in zip(index.keys, index.offsets, strict=True):
                reason = unusable_reason(row)
                if reason is not None:
                    self.index_skips.append(skip_record(url, key, None, reason))
                    continue
                shard_ids.append(shard_id)
                keys.append(key)
                offsets.append(row)
        self.shard_ids = np.asarray(shard_ids, dtype=np.int64)
        self.keys = keys
        self.offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 6)
        self._fds: dict[int, int] = {}
        self._pid = -1
        self.parallel_reads = remote.PARALLEL_READS if any(remote.is_remote(u) for u in urls) else 1
        # shards changed since a checkpoint (`pin_versions`): the offsets are the new bytes', never read at the old
        self.changed: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def shard_versions(self) -> dict[str, str]:
        """The pinned version of each remote shard, by URL (what a checkpoint records)."""
        return {url: v for url, v in zip(self.urls, self.versions, strict=True) if v is not None}

    def pin_versions(self, saved: dict[str, str]) -> list[tuple[str, str, str | None]]:
        """Read each shard at its `saved` version (a checkpoint's): (url, saved, now) of those that changed since,
        whose reads are then `shard_changed`."""
        changed = []
        for shard_id, url in enumerate(self.urls):
            if url in saved and self.versions[shard_id] not in (None, saved[url]):  # not listed now: missing_shard
                changed.append((url, saved[url], self.versions[shard_id]))
                self.changed[shard_id] = (f"{url}: changed since the checkpoint (version {saved[url]}, now "
                                          f"{self.versions[shard_id]})")
                self.versions[shard_id] = saved[url]
        return changed

    def describe(self, index: int) -> tuple[str, str, int | None]:
        return self.urls[int(self.shard_ids[index])], self.keys[index], None

    def _fd(self, shard_id: int) -> int:
        if self._pid != os.getpid():  # a forked worker opens its own descriptors
            self._fds, self._pid = {}, os.getpid()
        if shard_id not in self._fds:
            self._fds[shard_id] = os.open(self.urls[shard_id], os.O_RDONLY)
        return self._fds[shard_id]

    def load(self, index: int) -> RawSample:
        shard_id = int(self.shard_ids[index])
        if shard_id in self.changed:
            raise SkipSample("shard_changed", self.changed[shard_id])
        return read_sample(self.urls[shard_id], self.keys[index], self.offsets[index], self.versions[shard_id],
                           shard_fd=functools.partial(self._fd, shard_id))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}, "_pid": -1}


class SizedShardSource:
    """Tar shards (local or in object storage) beside a `sizes.json` (as OpenCLIP's datasets ship): planned from
    O(shards) counts, each shard's samples read by offset from its index, which each process keeps for the last
    `cached_shards` shards it read from.

    sizes.json is checked at startup against each shard's tar headers (`held_samples`; the index is cached, so the
    reads find it there): a shard is planned at the samples it holds, or at its listed count when that is more. A
    shard holding more than listed is named once per epoch (`shard_holds_more`, with both counts) and all its
    samples train; each listed sample a shard lacks is skipped when read (`shard_size_mismatch`), as are a missing
    or unreachable shard's listed samples, and what indexing finds unusable (no image, no caption).
    `trusted` (--trust-sizes-json): planned from sizes.json alone, nothing read at startup; the samples a shard holds
    past its listed count are named by key with its last listed sample, once per read of it.
    Memory is O(shards), the same on every rank.
    """

    group_size = 1
    cached_shards = 256  # shard indexes a process keeps (a block of the epoch order reads 64 shards)

    def __init__(self, spec: str, urls: list[str], sizes: np.ndarray, cache_dir: str | None = None,
                 member_keys: MemberKeys = DEFAULT_MEMBER_KEYS, first_shard: int = 0, trusted: bool = False) -> None:
        """`sizes`: sizes.json's counts; `first_shard`: where this rank starts checking them (`held_samples`);
        `trusted`: not checked, the plan is sizes.json's."""
        self.name, self.urls, self.listed = spec, urls, np.asarray(sizes, dtype=np.int64)
        self.cache_dir, self.member_keys, self.trusted = cache_dir, member_keys, trusted
        self.pins = shard_pins(urls)  # remote shards' sizes and versions: what every later read must find
        # a trusted list is what the shards hold, as far as the plan knows: no shard is read for it
        held = self.listed if trusted else held_samples(urls, cache_dir, member_keys, first_shard, self.pins)
        self.sizes = np.maximum(self.listed, held)  # positions planned per shard
        self.index_skips: list[dict[str, Any]] = [
            skip_record(url, None, None, "shard_holds_more",
                        f"sizes.json lists {listed} samples, the shard holds {count}: all {count} are read")
            for url, listed, count in zip(urls, self.listed.tolist(), held.tolist(), strict=True) if count > listed]
        self.bounds = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.saved_versions: dict[str, str] = {}  # a checkpoint's, also of shards not listed now
        self._indexes: collections.OrderedDict[int, ShardIndex] = collections.OrderedDict()
        # a microbatch's samples are read at once: their shards' indexes are loaded first, by `describe`
        self.parallel_reads = remote.PARALLEL_READS if any(remote.is_remote(u) for u in urls) else 1

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def shard_versions(self) -> dict[str, str]:
        """As `IndexedShardSource.shard_versions`."""
        return {url: pin["version"] for url, pin in self.pins.items()}

    def pin_versions(self, saved: dict[str, str]) -> list[tuple[str, str, str | None]]:
        """As `IndexedShardSource.pin_versions`."""
        changed = []
        self.saved_versions = dict(saved)
        for url in dict.fromkeys(self.urls):
            now = self.pins[url]["version"] if url in self.pins else None
            if url in saved and now not in (None, saved[url]):  # not listed now: missing_shard
                changed.append((url, saved[url], now))
                self.pins[url] = {**self.pins[url], "version": saved[url]}
        self._indexes.clear()
        return changed

    def locate(self, index: int) -> tuple[int, int, ShardIndex]:
        """Sample `index`'s shard, its place in the shard, and the shard's index (loaded at its first use)."""
        shard = int(np.searchsorted(self.bounds, index, side="right")) - 1
        if shard not in self._indexes:
            url = self.urls[shard]
            found = load_shard_index(url, self.cache_dir, self.member_keys, self.pins.get(url))
            if found.status in ("missing", "unreachable") and not found.keys:  # its samples named as when readable
                version = self.pins[url]["version"] if url in self.pins else self.saved_versions.get(url)
                found.keys = known_keys(url, self.cache_dir, self.member_keys, version)
                found.offsets = np.full((len(found.keys), 6), -1, dtype=np.int64)  # never read: its status says why
            self._indexes[shard] = found
            while len(self._indexes) > self.cached_shards:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(shard)
        return shard, index - int(self.bounds[shard]), self._indexes[shard]

    def describe(self, index: int) -> tuple[str, str, int | None]:
        shard, j, shard_index = self.locate(index)
        return self.urls[shard], shard_index.keys[j] if j < len(shard_index) else f"#{j}", None

    def load(self, index: int) -> RawSample:
        shard, j, shard_index = self.locate(index)
        url = self.urls[shard]
        if shard_index.status in ("missing", "unreachable", "changed"):
            raise SkipSample(SHARD_STATUS_REASONS[shard_index.status], shard_index.detail or url)
        listed, planned = int(self.listed[shard]), int(self.sizes[shard])
        if j >= len(shard_index):
            if shard_index.status == "truncated":
                raise SkipSample("truncated_shard", f"sample {j} of {url}: the shard ends before it")
            raise SkipSample("shard_size_mismatch",
                             f"sizes.json lists {listed} samples, the shard holds {len(shard_index)}")
        # a trusted list's shard, one that could not be read at startup, or one changed since may hold more than the
        # plan has places for
        notes = [] if j != planned - 1 else [
            skip_record(url, key, None, "shard_size_mismatch",
                        f"sizes.json lists {listed} samples, the shard holds {len(shard_index)}: "
                        + (f"--trust-sizes-json plans the first {planned}" if self.trusted else
                           f"the epoch was planned for {planned} (it could not be read at startup, or changed since)"))
            for key in shard_index.keys[planned:]]
        reason = unusable_reason(shard_index.offsets[j])
        if reason is not None:
            raise SkipSample(reason, notes=notes)
        return read_sample(url, shard_index.keys[j], shard_index.offsets[j], shard_index.version, notes)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_indexes": collections.OrderedDict()}
