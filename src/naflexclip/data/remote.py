"""Files in object storage (`s3://`, `gs://`, `hf://`, `https://`, any fsspec URL), read by byte range.

Each URL's filesystem is fsspec's, with its backend's own credentials and endpoint; only the ranges a reader asks
for are fetched, nothing is written to disk. A transient error is retried with backoff (`RETRIES`), each retry a
`read_retry` note (`read_throttled` when the store asked us to slow down: `take_notes`); a read that still fails
raises `Unreachable`, naming the URL and the last error, and the object is given up for `DEAD_FOR_S` by every
process of the run (`share_dead_objects`); a missing or refused file, or a missing credential, is not retried.
docs/data.md#data-in-object-storage.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from naflexclip.data.source import EITHER_DATA_FLAG, DataError, skip_record

RETRIES = 5  # retries of a transient error, after the first attempt
BACKOFF_S = 0.25  # the first retry's wait; doubled each retry (with jitter), at most MAX_BACKOFF_S
MAX_BACKOFF_S = 8.0
PARALLEL_READS = 16  # a microbatch's samples read at once, each a ranged request (latency, not bandwidth, bounds them)
SCAN_BLOCK = 1 << 18  # bytes fetched per request while reading tar headers (several small members per request)
DEAD_FOR_S = 300.0  # an object whose retries were all spent is given up this long, then tried again
# the store asks the client to slow down: S3's 503 SlowDown (s3fs: EBUSY), HTTP 429, GCS's rate limits
_THROTTLED_STATUS = (429, 503)
_THROTTLED_WORDS = ("SlowDown", "TooManyRequests", "Throttl", "RequestLimitExceeded", "rateLimitExceeded")
_T = TypeVar("_T")

# not worth retrying: the object is not there, or we may not read it
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# no credential was found (botocore's, google-auth's): not worth retrying either, and the message says what to set
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError", "DefaultCredentialsError")
_CREDENTIALS_HINT = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (a profile of ~/.aws/credentials)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS, or run `gcloud auth application-default login`",
    "hf": "set HF_TOKEN, or run `huggingface-cli login`",
}
_notes: list[dict[str, Any]] = []  # appended by the reading threads, drained under `_notes_lock`
_notes_lock = threading.Lock()
_filesystems: dict[tuple[int, str], Any] = {}
_dead: dict[str, tuple[float, str]] = {}  # url: (given up at, why), this process's
_dead_dir: str | None = None  # where every process of the run marks what it gave up (`share_dead_objects`)
# the open caches of fetched ranges (`chunk_fetch.ChunkFetcher`s, one per loader reading its epoch: two loaders of
# one process each find theirs): `get(url, version, start, end)` gives bytes or None
_range_caches: list[Any] = []


class Unreachable(RuntimeError):
    """A remote read that failed after every retry, or failed for good (the URL and the reason in the message).

    Not an OSError on purpose: `tarfile` reads an OSError as a truncated shard."""

    def __init__(self, url: str, error: BaseException, attempts: int) -> None:
        tried = f" after {attempts} attempts" if attempts > 1 else ""
        if _no_credentials(error):
            protocol = url.split("://", 1)[0].rstrip("a")  # s3a: s3
            tried = f": {_CREDENTIALS_HINT.get(protocol, 'give the credentials its fsspec backend reads')}"
        super().__init__(f"{url}: {type(error).__name__}: {error}{tried}".strip())
        self.url, self.missing = url, isinstance(error, FileNotFoundError)


class Changed(RuntimeError):
    """A read of an object that is no longer the version pinned when the epoch was planned (it was rewritten):
    its bytes are another object's, never data. Not retried."""

    def __init__(self, url: str, pinned: str, found: str | None = None) -> None:
        now = f", now {found}" if found else ""
        super().__init__(f"{url}: changed since it was planned (version {pinned}{now})")
        self.url = url


def is_remote(url: str) -> bool:
    """A URL fsspec reads (`s3://`, `gs://`, `hf://`, `https://`, ...): not a local path, not a `pipe:`."""
    return "://" in url and not url.startswith(("pipe:", "file://"))


def forget_filesystems() -> None:
    """Make the next read create its filesystems again (after the endpoint or credentials in the environment
    changed), and forget the objects given up (they are asked again)."""
    _filesystems.clear()
    _dead.clear()
    if _dead_dir is not None:
        for name in os.listdir(_dead_dir):
            try:
                os.remove(os.path.join(_dead_dir, name))
            except OSError:
                pass


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) of a remote URL; one filesystem per protocol and process (a forked worker
    makes its own)."""
    import fsspec

    protocol = url.split("://", 1)[0]
    key = (os.getpid(), protocol)
    if key not in _filesystems:
        s3 = protocol in ("s3", "s3a")
        options: dict[str, Any] = {"config_kwargs": {"retries": {"total_max_attempts": 1}}} if s3 else {}
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
        if s3:  # every retry is ours, so it is counted (s3fs and botocore retry otherwise, silently)
            fs.retries = 1
        _filesystems[key] = fs
    fs = _filesystems[key]
    return fs, fs._strip_protocol(url)


def _no_credentials(error: BaseException) -> bool:
    return type(error).__name__ in _NO_CREDENTIALS


def is_transient(error: BaseException) -> bool:
    """Worth retrying: a timeout, a dropped or refused connection, a server error or throttling (fsspec backends
    raise these as OSError, TimeoutError, or their HTTP client's errors); not a missing credential."""
    if isinstance(error, _PERMANENT) or _no_credentials(error):
        return False
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.ENOENT):
        return False
    return isinstance(error, (OSError, TimeoutError, ConnectionError)) or type(error).__module__.startswith(
        ("aiohttp", "botocore", "requests", "urllib3", "huggingface_hub", "google"))


def is_throttled(error: BaseException) -> bool:
    """The store asked us to slow down (503 SlowDown, 429 Too Many Requests, a rate limit): retried like any
    transient error, counted apart (`read_throttled`)."""
    for cause in (error, error.__cause__):
        if cause is None:
            continue
        status = getattr(cause, "status", None) or getattr(cause, "status_code", None)
        if status in _THROTTLED_STATUS or (isinstance(cause, OSError) and cause.errno == errno.EBUSY):
            return True
        if any(word in str(cause) for word in _THROTTLED_WORDS):
            return True
    return False


def share_dead_objects() -> None:
    """Have every process started from this one from now on (a loader's workers) share the objects given up: the
    first reader to spend its retries on one marks it, the others skip it at once. Called before workers start."""
    global _dead_dir
    if _dead_dir is None:
        _dead_dir = tempfile.mkdtemp(prefix="naflexclip-dead-")
        owner = os.getpid()
        import atexit

        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(_dead_dir or "", ignore_errors=True))


def _dead_marker(url: str) -> str | None:
    return None if _dead_dir is None else os.path.join(_dead_dir, hashlib.sha1(url.encode()).hexdigest())


def _give_up(url: str, error: Unreachable) -> None:
    _dead[url] = (time.time(), str(error))
    marker = _dead_marker(url)
    if marker is not None:
        try:
            with open(f"{marker}.{os.getpid()}", "w") as f:
                f.write(str(error))
            os.replace(f"{marker}.{os.getpid()}", marker)
        except OSError:
            pass  # each process then finds out for itself


def given_up(url: str) -> str | None:
    """Why `url` was given up in the last `DEAD_FOR_S` by a process of this run (None: it was not)."""
    now = time.time()
    if url in _dead and now - _dead[url][0] < DEAD_FOR_S:
        return _dead[url][1]
    marker = _dead_marker(url)
    try:
        if marker is not None and now - os.path.getmtime(marker) < DEAD_FOR_S:
            with open(marker) as f:
                return f.read()
    except OSError:
        pass
    return None


class GivenUp(Unreachable):
    """A read of an object that a process of this run gave up on moments ago: not asked again."""

    def __init__(self, url: str, why: str) -> None:
        RuntimeError.__init__(self, f"{why} (given up by another read of this run, not tried again)")
        self.url, self.missing = url, False


def with_retries(url: str, what: str, call: Callable[[], _T]) -> _T:
    """`call()`, retried on transient errors with backoff; each retry is noted (`read_throttled` or `read_retry`).
    Raises `Unreachable`: at once for an object given up in the last `DEAD_FOR_S`, which one that spends its
    retries then is."""
    why = given_up(url)
    if why is not None:
        raise GivenUp(url, why)
    for attempt in range(RETRIES + 1):
        try:
            return call()
        except Changed:
            raise
        except Exception as error:  # noqa: BLE001 - classified below, re-raised as Unreachable
            if not is_transient(error) or attempt == RETRIES:
                unreachable = Unreachable(url, error, attempt + 1)
                if attempt == RETRIES and attempt > 0:
                    _give_up(url, unreachable)
                raise unreachable from error
            reason = "read_throttled" if is_throttled(error) else "read_retry"
            note = skip_record(url, None, None, reason,
                               f"{what}, attempt {attempt + 1}: {type(error).__name__}: {error}")
            with _notes_lock:
                _notes.append(note)
            wait = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** attempt)
            time.sleep(wait * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")


def take_notes() -> list[dict[str, Any]]:
    """The `read_retry` and `read_throttled` notes of this process since the last call (each given once, whatever
    thread asks)."""
    with _notes_lock:
        notes = list(_notes)
        _notes.clear()
    return notes


def _stamp(found: dict[str, Any]) -> dict[str, Any]:
    """Size and version (ETag, else the backend's modification stamp) of an `info` or listing entry."""
    version = found.get("ETag") or found.get("etag") or found.get("md5Hash") or found.get("LastModified") or \
        found.get("mtime") or found.get("last_modified") or found.get("blob_id")
    return {"size": int(found["size"]), "version": str(version)}


def info(url: str) -> dict[str, Any]:
    """The object's size and version stamp (ETag or modification time), with retries."""
    fs, path = filesystem(url)
    return _stamp(with_retries(url, "info", lambda: fs.info(path)))


def pins(urls: Sequence[str], beside: str | None = None) -> dict[str, dict[str, Any]]:
    """Each remote URL's size and version as its folder's listing gives them (one listing per folder): what the
    epoch is planned from, and what every later read of it must still find (`read_range`). Left out: local paths,
    objects not listed, folders that cannot be listed. `beside`: a suffix; where the listing also holds the object
    `url + beside` (a shard's index), its pin has it as `"beside"` (size and version)."""
    wanted = [u for u in urls if is_remote(u)]
    found = list_objects(wanted) if wanted else {}
    pinned = {url: _stamp(found[url]) for url in wanted if url in found and found[url].get("type") != "directory"}
    if beside is not None:
        for url, pin in pinned.items():
            if url + beside in found:
                pin["beside"] = _stamp(found[url + beside])
    return pinned


def _cat_range(fs: Any, path: str, url: str, start: int, end: int, version: str | None) -> bytes:
    """One ranged GET; with `version` on S3 it is sent as If-Match and the response's ETag checked too (a store
    that ignores If-Match): a rewritten object raises `Changed`. Other stores' reads are not pinned."""
    if version is None or type(fs).__name__ != "S3FileSystem":
        return fs.cat_file(path, start=start, end=end)
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)

    async def get() -> bytes:
        try:
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                         IfMatch=version)
        except OSError as error:
            cause = getattr(error, "__cause__", None)
            code = getattr(cause, "response", {}).get("Error", {}).get("Code") if cause is not None else None
            if code in ("PreconditionFailed", "412") or "pre-condition" in str(error):
                raise Changed(url, version) from None
            raise
        try:
            if response.get("ETag") not in (None, version):
                raise Changed(url, version, response["ETag"])
            return await response["Body"].read()
        finally:
            response["Body"].close()

    return sync(fs.loop, get)


def read_range(url: str, start: int, end: int, version: str | None = None) -> bytes:
    """Bytes [start, end) of the object, one ranged request (retried). `version`: the one pinned (`pins`); an
    object no longer at that version raises `Changed`."""
    if end <= start:
        return b""
    fs, path = filesystem(url)
    data = with_retries(url, f"bytes {start}-{end}", lambda: _cat_range(fs, path, url, start, end, version))
    if len(data) != end - start:  # a short read is a dropped transfer, not the object's end
        data = with_retries(url, f"bytes {start}-{end} (short read)",
                            lambda: _exact(_cat_range(fs, path, url, start, end, version), end - start))
    return data


def _exact(data: bytes, size: int) -> bytes:
    if len(data) != size:
        raise OSError(errno.EIO, f"got {len(data)} of {size} bytes")
    return data


def read_spans(url: str, spans: Sequence[tuple[int, int]], version: str | None = None) -> list[bytes | None]:
    """Several (offset, size) members of one object in one ranged request covering them (a sample's members
    are consecutive in its shard); an offset < 0 gives None. `version`: as `read_range`'s."""
    present = [(o, s) for o, s in spans if o >= 0]
    if not present:
        return [None] * len(spans)
    start, end = min(o for o, _ in present), max(o + s for o, s in present)
    data = _cached_range(url, version, start, end)
    if data is None:
        data = read_range(url, start, end, version)
    return [None if o < 0 else data[o - start: o - start + s] for o, s in spans]


@contextlib.contextmanager
def range_cache(cache: Any) -> Iterator[None]:
    """While open, reads of ranges `cache` holds are served from it (`cache.get(url, version, start, end)`)."""
    _range_caches.append(cache)
    try:
        yield
    finally:
        _range_caches.remove(cache)


def _cached_range(url: str, version: str | None, start: int, end: int) -> bytes | None:
    for cache in list(_range_caches):
        data = cache.get(url, version, start, end)
        if data is not None:
            return data
    return None


def read_bytes(url: str) -> bytes:
    """The whole object (small files: `sizes.json`, a shard's index), retried."""
    fs, path = filesystem(url)
    return with_retries(url, "read", lambda: fs.cat_file(path))


def write_bytes(url: str, data: bytes) -> None:
    """Write the whole object (a shard's index), retried."""
    fs, path = filesystem(url)
    with_retries(url, "write", lambda: fs.pipe_file(path, data))


class RangedFile(io.RawIOBase):
    """A remote object as a seekable binary file whose reads are retried ranged requests (wrap it in an
    `io.BufferedReader` to fetch `SCAN_BLOCK` bytes at a time): what `tarfile` reads a shard's headers from."""

    def __init__(self, url: str, size: int, version: str | None = None) -> None:
        super().__init__()
        self.url, self.size, self.position, self.version = url, size, 0, version

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        end = min(self.size, self.position + len(buffer))
        if end <= self.position:
            return 0
        data = read_range(self.url, self.position, end, self.version)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)


def open_ranged(url: str, size: int, version: str | None = None) -> io.BufferedReader:
    """The object as a buffered, seekable file reading `SCAN_BLOCK` bytes per request (`version`: pinned)."""
    return io.BufferedReader(RangedFile(url, size, version), buffer_size=SCAN_BLOCK)


def _list_folder(folder: str) -> list[dict[str, Any]] | None:
    """The entries of one folder's listing (retried); None: it cannot be listed (a plain `https://` server)."""
    fs, path = filesystem(folder + "/")
    if not hasattr(fs, "split_path") and folder.startswith(("http://", "https://")):
        return None  # a web server's folder page, where there is one, is links, not a listing
    try:
        return with_retries(folder, "list", lambda: fs.ls(path, detail=True))
    except Unreachable as error:
        if error.missing or isinstance(error.__cause__, NotImplementedError):
            return None
        raise


def _listings(urls: Sequence[str]) -> Iterator[dict[str, dict[str, Any]] | None]:
    """The objects of each folder `urls` are in, by URL (one listing per folder, retried); None for a folder that
    cannot be listed (plain `https://`)."""
    for folder in sorted({u.rpartition("/")[0] for u in urls}):
        entries = _list_folder(folder)
        yield None if entries is None else {
            f"{folder}/{entry['name'].rstrip('/').rpartition('/')[2]}": entry for entry in entries}


def list_objects(urls: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The objects of the folders `urls` are in, by URL (one listing per folder, retried): which shards exist, and
    their sizes, before any worker reads. Folders that cannot be listed (plain `https://`) are left out."""
    found: dict[str, dict[str, Any]] = {}
    for listed in _listings(urls):
        found.update(listed or {})
    return found


def check_remote_shards(urls: Sequence[str], spec: str) -> None:
    """Fail early, in one line naming `spec`, when the folders of its remote shards cannot be listed (after
    retries) or list none of them. Shards a listing leaves out are skipped by name when read (`missing_shard`)."""
    wanted = [u for u in urls if is_remote(u)]
    if not wanted:
        return
    found: dict[str, dict[str, Any]] = {}
    try:
        for listed in _listings(wanted):
            if listed is None:
                return  # a folder that cannot be listed: its shards are known when read
            found.update(listed)
    except Unreachable as error:
        raise DataError(f"{EITHER_DATA_FLAG} {spec!r}: cannot list its shards: {error}") from None
    if not any(u in found for u in wanted):
        raise DataError(f"no shard of {EITHER_DATA_FLAG} {spec!r} exists (expanded to {len(wanted)} urls, "
                        "none of them listed in object storage)")
