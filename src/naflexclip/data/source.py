"""What every data reader gives: `RawSample`s (undecoded), map-style `Source`s, skip records and `DataError`.

The readers: `readers` (the built-in synthetic splits), `tables` (CSV/TSV), `folders` (image+.txt trees),
`shards` (WebDataset tar shards as a stream) and `shard_index` (local shards by offset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image

CAPTION_EXTENSIONS = ("txt", "text", "caption")  # a caption file's suffixes (folders, shard members)


class DataError(RuntimeError):
    """The data source cannot feed the run (nothing usable, missing files); the message names the source."""


# in a message of a check that serves both splits; the loader of a split names its own flag there
EITHER_DATA_FLAG = "--train-data/--val-data"


@dataclass
class RawSample:
    """Undecoded sample: image as bytes (or an already-decoded PIL image), caption as bytes/str (or several
    captions of the image, a list), labels."""

    image: bytes | Image.Image | None
    caption: bytes | str | list[str] | None
    labels: dict[str, int] | None = None
    key: str = ""
    regions: Any = None  # the sample's regions: its .json (bytes, str or parsed; `naflexclip.data.regions`)
    # skip records the reader found beside this sample (other samples of its shard that the plan cannot read)
    notes: list[dict[str, Any]] = field(default_factory=list)


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


def skip_record(source: str, key: str | None, line: int | None, reason: str, detail: str = "") -> dict[str, Any]:
    """One entry of the skip log: where the sample is (source, key or path, line) and why it was skipped."""
    return {"source": source, "key": key, "line": line, "reason": reason, "detail": detail}
