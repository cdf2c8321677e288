"""WebDataset shard index: each `.tar` shard's samples as tar member offsets (the sources that read by them:
`shard_sources`).

Indexing reads tar headers only; an index is cached as two JSON lines, its sample count first (beside the shard or
under `--shard-index-dir`), and used while the shard's size and modification time (a remote object's size and ETag)
are unchanged. Shards in object storage (`remote`) are indexed and read by ranged requests; streams that cannot be
indexed go to `shards.shard_samples`. Grouping and caching: docs/data.md#your-own-data and #data-in-object-storage.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from naflexclip.data import remote
from naflexclip.data.shards import (
    DEFAULT_MEMBER_KEYS,
    MemberKeys,
    member_key,
    new_sample,
    same_sample,
)

INDEX_VERSION = 5  # 4: the .json member's offset and size (a sample's regions); 5: two lines, the count first
INDEX_SUFFIX = ".naflexclip-index.json"  # a local shard's cache, and the index `naflexclip data index` writes
logger = logging.getLogger("naflexclip.data")


def is_indexable(url: str) -> bool:
    """An uncompressed tar file, local or in object storage (what can be read by offset)."""
    return not url.startswith("pipe:") and url.endswith(".tar")


@dataclass
class ShardIndex:
    """One shard's samples: key, image (offset, size, or -1, -1), caption (offset, size, or -1, -1).

    `status`: "ok", "missing" (cannot be opened), "unreachable" (a remote shard whose reads kept failing:
    `detail` says why), "changed" (a remote shard rewritten since its version was pinned) or "truncated" (ends
    early or is not a tar; the samples before the damage are kept). `version`: a remote shard's, as indexed.
    `cut`: the key of the sample a member of which the damage cut (left out of `keys`), or None when no member
    was cut. A missing or unreachable shard's `keys`, where a `SizedShardSource` knows them (`known_keys`), are those
    it held when it could be read: they name its skipped samples, nothing of it is read."""

    url: str
    status: str
    keys: list[str]
    offsets: np.ndarray  # int64 [num_samples, 6]: image, caption and .json member offset and size (-1, -1: none)
    cut: str | None = None
    duplicates: list[str] = field(default_factory=list)  # keys that name several samples (each trains)
    detail: str = ""
    version: str | None = None

    def __len__(self) -> int:
        return len(self.keys)


# an unreadable shard's status, and the reason its samples are skipped for
SHARD_STATUS_REASONS = {"missing": "missing_shard", "unreachable": "unreachable_shard", "changed": "shard_changed",
                        "truncated": "truncated_shard"}


def _unreadable(url: str, error: remote.Unreachable) -> ShardIndex:
    return ShardIndex(url, "missing" if error.missing else "unreachable", [], np.zeros((0, 6), np.int64),
                      detail=str(error))


def _changed(url: str, error: remote.Changed) -> ShardIndex:
    return ShardIndex(url, "changed", [], np.zeros((0, 6), np.int64), detail=str(error))


def scan_shard(url: str, keys: MemberKeys = DEFAULT_MEMBER_KEYS, file_size: int | None = None,
               version: str | None = None) -> ShardIndex:
    """Index a tar shard by reading its member headers (a remote one's by ranged requests); `keys` picks each
    sample's image and caption. `file_size`: the shard's, when known; `version`: a remote shard's pinned one."""
    try:
        if remote.is_remote(url):
            file_size = remote.info(url)["size"] if file_size is None else file_size
            stream = remote.open_ranged(url, file_size, version)
        else:
            file_size = os.path.getsize(url)
            stream = open(url, "rb")  # noqa: SIM115 - closed with the tar below
    except OSError:
        return ShardIndex(url, "missing", [], np.zeros((0, 6), np.int64))
    except remote.Unreachable as error:
        return _unreadable(url, error)
    members: list[tuple[str, int, int]] = []
    truncated, cut_member = False, None
    try:
        with stream, tarfile.open(fileobj=stream, mode="r:") as tar:  # reads headers and seeks past member data
            while True:
                try:
                    info = tar.next()
                except (tarfile.TarError, EOFError, OSError):
                    truncated = True
                    break
                # a remote read failing for good (Unreachable) passes through to the handler below
                if info is None:
                    break
                if not info.isreg():
                    continue
                if info.offset_data + info.size > file_size:
                    truncated, cut_member = True, info.name
                    break
                members.append((info.name, info.offset_data, info.size))
    except (tarfile.TarError, EOFError, OSError):
        truncated = True
    except remote.Unreachable as error:  # not a damaged shard: nothing of it is known
        return _unreadable(url, error)
    except remote.Changed as error:
        return _changed(url, error)
    image_rank = {e: i for i, e in enumerate(keys.image)}
    caption_rank = {e: i for i, e in enumerate(keys.caption)}
    sample_keys: list[str] = []
    rows: list[list[int]] = []
    ranks: list[list[int]] = []
    exts: set[str] = set()  # the current sample's suffixes
    for name, offset, size in members:
        key, ext = member_key(name)
        if not sample_keys or new_sample(key, ext, sample_keys[-1], exts):
            sample_keys.append(key)
            rows.append([-1, -1, -1, -1, -1, -1])
            ranks.append([len(image_rank), len(caption_rank)])
            exts = set()
        exact = key == sample_keys[-1]
        if exact:
            exts.add(ext)
        if exact and ext in image_rank and image_rank[ext] < ranks[-1][0]:
            rows[-1][0:2], ranks[-1][0] = [offset, size], image_rank[ext]
        elif exact and ext in caption_rank and caption_rank[ext] < ranks[-1][1]:
            rows[-1][2:4], ranks[-1][1] = [offset, size], caption_rank[ext]
        if exact and ext == "json":  # regions (`naflexclip.data.regions`); also the caption with --json-text-key
            rows[-1][4:6] = [offset, size]
    cut = None
    if cut_member is not None:  # only the sample the cut member belongs to is lost
        cut = member_key(cut_member)[0]
        if sample_keys and same_sample(cut, sample_keys[-1]):
            cut = sample_keys.pop()
            rows.pop()
    return ShardIndex(url, "truncated" if truncated else "ok", sample_keys,
                      np.asarray(rows, dtype=np.int64).reshape(-1, 6), cut, repeated_keys(sample_keys),
                      version=version)


def repeated_keys(sample_keys: list[str]) -> list[str]:
    """The keys that name more than one sample of a shard, each once, in order of their second use."""
    seen: set[str] = set()
    repeated: list[str] = []
    for key in sample_keys:
        if key in seen and key not in repeated:
            repeated.append(key)
        seen.add(key)
    return repeated


def _cache_path(url: str, cache_dir: str | None) -> str:
    local = not remote.is_remote(url)
    if cache_dir is None and local and os.access(os.path.dirname(os.path.abspath(url)), os.W_OK):
        return url + INDEX_SUFFIX
    directory = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "naflexclip", "shard-index")
    digest = hashlib.sha1((os.path.abspath(url) if local else url).encode()).hexdigest()[:20]
    return os.path.join(directory, f"{url.rpartition('/')[2]}-{digest}.json")


def _cache_stamp(url: str, keys: MemberKeys, pin: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What the shard's cached index must match: its size and mtime (a remote object's size and ETag: `pin`, else
    asked for, which raises `remote.Unreachable`) and the member keys. None: a local path that cannot be stat'ed."""
    if remote.is_remote(url):  # a remote shard's version is its ETag (or its backend's modification stamp)
        found = pin or remote.info(url)
        stamp = {"version": INDEX_VERSION, "size": found["size"], "etag": found["version"]}
    else:
        try:
            st = os.stat(url)
        except OSError:
            return None
        stamp = {"version": INDEX_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {**stamp, "image_key": list(keys.image), "caption_key": list(keys.caption)}


def _read_cache(path: str, stamp: dict[str, Any], whole: bool) -> dict[str, Any] | None:
    """A cached index whose first line (stamp, status, sample count) matches `stamp`; `whole`: with its second line
    (keys and offsets), else the first alone (a count costs a short read). None: no such cache."""
    try:
        with open(path) as f:
            cached = json.loads(f.readline())
            if not all(cached.get(k) == v for k, v in stamp.items()):
                return None
            if whole:
                cached.update(json.loads(f.readline()))
        return cached
    except (OSError, ValueError, AttributeError):  # AttributeError: a line that is JSON but not an object
        return None


def _index_lines(stamp: dict[str, Any], index: ShardIndex) -> str:
    """An index as its two lines: the stamp, status and count first (a count costs a short read), then the samples."""
    return (json.dumps({**stamp, "status": index.status, "count": len(index)}) + "\n"
            + json.dumps({"keys": index.keys, "offsets": index.offsets.tolist(), "cut": index.cut,
                          "duplicates": index.duplicates}) + "\n")


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic: ranks (and threads) indexing the same shard at once each write a whole file


@contextlib.contextmanager
def _indexing(path: str) -> Iterator[None]:
    """Held while one process indexes a shard into its cache `path`: another rank or worker of the node that needs
    the same shard waits, then finds it cached, so its headers are read once, not once per process."""
    # the lock files live in the node's temporary folder: none is left beside the shards or in a shared cache
    folder = os.path.join(tempfile.gettempdir(), "naflexclip-index-locks")
    try:
        import fcntl

        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, hashlib.sha1(os.path.abspath(path).encode()).hexdigest()), "a")  # noqa: SIM115
    except (ImportError, OSError):  # no locks here (or an unwritable cache): each process reads for itself
        yield
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        lock.close()  # releases the lock


_named_stale: set[str] = set()  # indexes beside shards found stale, named once per process


def _published(url: str, cache_dir: str | None, pin: dict[str, Any] | None) -> str | None:
    """Where the shard's index written by `naflexclip data index` is (beside the shard), when it is there and is not
    already the cache; None: there is none. A remote one is known from the listing (`pin["beside"]`): no request."""
    published = url + INDEX_SUFFIX
    if remote.is_remote(url):
        return published if pin is not None and "beside" in pin else None
    if os.path.abspath(published) == os.path.abspath(_cache_path(url, cache_dir)):
        return None
    return published if os.path.exists(published) else None


def _read_published(url: str, published: str, stamp: dict[str, Any]) -> str | None:
    """The index beside the shard, as text, when its stamp is the shard's now; a stale one (the shard changed since it
    was written, or it was written for other member keys) is named in one line and left unused."""
    try:
        if remote.is_remote(published):
            text = remote.read_bytes(published).decode()
        else:
            with open(published) as f:
                text = f.read()
        head = json.loads(text.partition("\n")[0])
    except (OSError, ValueError, UnicodeDecodeError, remote.Unreachable):
        return None  # unreadable: the shard is indexed from its headers, as without one
    if not isinstance(head, dict):
        return None
    differs = [k for k, v in stamp.items() if head.get(k) != v]
    if not differs:
        return text
    if published not in _named_stale:
        _named_stale.add(published)
        logger.warning("data: the index beside %s is stale (its %s: %s; the shard's now: %s): not used, the shard is "
                       "indexed from its headers; run `naflexclip data index` again", url, ", ".join(differs),
                       ", ".join(str(head.get(k)) for k in differs), ", ".join(str(stamp[k]) for k in differs))
    return None


def _from_cache(url: str, cached: dict[str, Any], version: str | None) -> ShardIndex | None:
    try:
        return ShardIndex(url, cached["status"], cached["keys"],
                          np.asarray(cached["offsets"], dtype=np.int64).reshape(-1, 6), cached["cut"],
                          cached["duplicates"], version=version)
    except (KeyError, ValueError, TypeError):
        return None


def load_shard_index(url: str, cache_dir: str | None = None, keys: MemberKeys = DEFAULT_MEMBER_KEYS,
                     pin: dict[str, Any] | None = None) -> ShardIndex:
    """The shard's index: from its cache while the shard's size and mtime (and the member keys) match, else from the
    index beside it (`naflexclip data index`) when that matches, else scanned; then cached. Scanned once per node:
    another process needing it meanwhile waits and reads the cache. `pin`: a remote shard's size and version
    (`remote.pins`), which its reads must find."""
    try:
        stamp = _cache_stamp(url, keys, pin)
    except remote.Unreachable as error:
        return _unreadable(url, error)
    if stamp is None:
        return scan_shard(url, keys)
    version = stamp.get("etag")
    path = _cache_path(url, cache_dir)
    cached = _read_cache(path, stamp, whole=True)
    index = None if cached is None else _from_cache(url, cached, version)
    if index is not None:
        return index
    with _indexing(path):
        cached = _read_cache(path, stamp, whole=True)  # another process may have indexed it while we waited
        index = None if cached is None else _from_cache(url, cached, version)
        if index is not None:
            return index
        published = _published(url, cache_dir, pin)
        text = None if published is None else _read_published(url, published, stamp)
        if text is not None:
            lines = text.splitlines()
            index = _from_cache(url, {**json.loads(lines[0]), **json.loads(lines[1])}, version)
        if index is None:
            index = scan_shard(url, keys, stamp["size"], version)
            if index.status in ("missing", "unreachable", "changed"):
                return index  # a fault of this moment, not the shard's content: never cached
            text = _index_lines(stamp, index)
        try:
            _write_atomic(path, text)
        except OSError:
            pass  # an unwritable cache only costs a re-scan next time
    return index


def known_keys(url: str, cache_dir: str | None, keys: MemberKeys, version: str | None) -> list[str]:
    """The sample keys the shard's cached index holds, whatever the shard's state now: how the samples of a shard
    that cannot be read are named, by the keys they had when it could. A remote shard's at `version` (its pinned
    ETag) only; none when that is not known."""
    stamp: dict[str, Any] = {"version": INDEX_VERSION, "image_key": list(keys.image),
                             "caption_key": list(keys.caption)}
    if remote.is_remote(url):
        if version is None:
            return []
        stamp["etag"] = version
    cached = _read_cache(_cache_path(url, cache_dir), stamp, whole=True)
    found = cached.get("keys") if cached is not None else None
    return found if isinstance(found, list) else []


def index_shards(urls: list[str], keys: MemberKeys = DEFAULT_MEMBER_KEYS,
                 cache_dir: str | None = None) -> list[ShardIndex]:
    """Write each shard's index beside it (`<shard>.naflexclip-index.json`, stamped with the shard's size and ETag,
    or its mtime when local), so that a run's startup reads it instead of the shard's headers
    (`naflexclip data index`). Shards already indexed in the cache are not read again."""
    pins = shard_pins(urls)
    indexes = load_shard_indexes(urls, cache_dir, keys, pins)
    for url, index in zip(urls, indexes, strict=True):
        if index.status in ("missing", "unreachable", "changed"):
            continue
        stamp = _cache_stamp(url, keys, pins.get(url))
        assert stamp is not None
        text = _index_lines(stamp, index)
        if remote.is_remote(url):
            remote.write_bytes(url + INDEX_SUFFIX, text.encode())
        else:
            _write_atomic(url + INDEX_SUFFIX, text)
    return indexes


def held_count(url: str, cache_dir: str | None = None, keys: MemberKeys = DEFAULT_MEMBER_KEYS,
               pin: dict[str, Any] | None = None) -> int:
    """The samples the shard holds (0: it cannot be read): the first line of its cached index, else its index."""
    try:
        stamp = _cache_stamp(url, keys, pin)
    except remote.Unreachable:
        return 0  # its reads are tried again, and its listed samples counted, when the epoch reaches it
    cached = None if stamp is None else _read_cache(_cache_path(url, cache_dir), stamp, whole=False)
    if cached is not None and isinstance(cached.get("count"), int):
        return cached["count"]
    return len(load_shard_index(url, cache_dir, keys, pin))


def load_shard_indexes(urls: list[str], cache_dir: str | None, keys: MemberKeys,
                       pins: dict[str, dict[str, Any]] | None = None) -> list[ShardIndex]:
    """Every shard's index, in order; remote shards' by several requests at once, at their `pins`."""
    pins = pins or {}
    if not any(remote.is_remote(u) for u in urls):
        return [load_shard_index(url, cache_dir, keys) for url in urls]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda url: load_shard_index(url, cache_dir, keys, pins.get(url)), urls))


def held_samples(urls: list[str], cache_dir: str | None, keys: MemberKeys, first: int = 0,
                 pins: dict[str, dict[str, Any]] | None = None) -> np.ndarray:
    """The samples each shard holds (0 for one that cannot be read), by `held_count`; no index is kept. Shards are
    taken from `first` on, wrapping round, several at once: ranks starting at different shards scan different ones
    and find the others' in the cache. `pins`: remote shards' sizes and versions."""
    pins = pins or {}
    unique = list(dict.fromkeys(urls))  # a shard named twice is scanned once
    order = unique[first % len(unique):] + unique[:first % len(unique)] if unique else []
    found: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # a shard's header reads wait on disk or network
        for start in range(0, len(order), 1024):  # a chunk at a time: a future per shard of 10^5 is 100 MiB
            chunk = order[start:start + 1024]
            found.update(zip(chunk, pool.map(lambda url: held_count(url, cache_dir, keys, pins.get(url)), chunk),
                             strict=True))
    return np.asarray([found[url] for url in urls], dtype=np.int64).reshape(-1)


def shard_pins(urls: list[str]) -> dict[str, dict[str, Any]]:
    """`remote.pins` of the remote shards; none (each shard's stamp asked for when indexed) where no listing can be
    had (the startup check named a store that cannot be listed)."""
    try:
        return remote.pins(urls, beside=INDEX_SUFFIX)
    except remote.Unreachable:
        return {}
