"""Parquet files (local or in object storage) as a map-style source, read by row group (pyarrow).

The Hub's image datasets are Parquet: an image column holding the encoded file (`binary`, or the `datasets`
library's struct `{bytes, path}`) and a caption column (a string, or a list of strings: several captions of the
image, as `--multi-positive` reads them). Startup reads each file's footer only (its row groups and their rows);
an epoch's order treats every row group as a shard of a `shard_order.ShardRecipe`, in blocks of `BLOCK_ROW_GROUPS`
row groups shuffled together, so every row is read exactly once per epoch and a resume continues exactly. A worker
reads the row groups its samples are in (the image and caption columns only) and keeps the last `2 x
BLOCK_ROW_GROUPS` of them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from typing import Any

import numpy as np

from naflexclip.data import remote
from naflexclip.data.samples import SkipSample
from naflexclip.data.source import EITHER_DATA_FLAG, DataError, RawSample

BLOCK_ROW_GROUPS = 8  # row groups whose rows are shuffled together (a worker holds up to twice this many)
IMAGE_COLUMNS = ("image", "jpg", "png", "webp")  # looked for when --image-key is left at its default
TEXT_COLUMNS = ("text", "caption", "txt")  # when --text-key is


def is_parquet(spec: str) -> bool:
    """A `.parquet` file or brace pattern of them."""
    return spec.endswith((".parquet", ".parq"))


def _open(url: str) -> Any:
    import pyarrow.parquet as pq

    if remote.is_remote(url):
        return pq.ParquetFile(remote.open_ranged(url, remote.info(url)["size"]))
    return pq.ParquetFile(url)


def _column(names: list[str], wanted: tuple[str, ...] | None, defaults: tuple[str, ...], flag: str, url: str
            ) -> str:
    for name in wanted or defaults:
        if name in names:
            return name
    asked = f"{flag} {';'.join(wanted)!r}" if wanted else f"{flag} (by default one of {', '.join(defaults)})"
    raise DataError(f"{url} has no column named by {asked}; its columns: {', '.join(names)}")


def _checked_type(schema: Any, name: str, flag: str, url: str) -> None:
    """The image column holds encoded files (binary, or the `datasets` library's struct `{bytes, path}`), the
    caption column strings (or lists of them): otherwise one line naming the column, its type and the one expected,
    now rather than a TypeError mid-epoch."""
    import pyarrow as pa

    def binary(t: Any) -> bool:
        return pa.types.is_binary(t) or pa.types.is_large_binary(t)

    def text(t: Any) -> bool:
        if pa.types.is_dictionary(t):  # a categorical column
            t = t.value_type
        return pa.types.is_string(t) or pa.types.is_large_string(t)

    kind = schema.field(name).type
    if flag == "--image-key":
        ok = binary(kind) or (pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0
                              and binary(kind.field("bytes").type))
        expected = "binary (the encoded image file) or a struct {bytes, path}"
    else:
        ok = text(kind) or ((pa.types.is_list(kind) or pa.types.is_large_list(kind)) and text(kind.value_type))
        expected = "a string or a list of strings (several captions)"
    if not ok:
        raise DataError(f"{url}: column {name!r} ({flag}) is {kind}; expected {expected}")


def _footers(spec: str, urls: list[str]) -> list[Any]:
    """Each file's metadata (its footer), remote files 16 at a time; one line naming the file that cannot be read."""
    def footer(url: str) -> Any:
        try:
            return _open(url).metadata
        except (OSError, ValueError, remote.Unreachable) as error:
            raise DataError(f"{EITHER_DATA_FLAG} {spec!r}: cannot read {url}: {error}") from None

    if not any(remote.is_remote(u) for u in urls):
        return [footer(url) for url in urls]
    with concurrent.futures.ThreadPoolExecutor(remote.PARALLEL_READS) as pool:
        return list(pool.map(footer, urls))


class ParquetSource:
    """Parquet files as one map-style source: row r of the files in order is sample r. `group_sizes`: rows per row
    group, in order (the "shards" of its epoch order). `image_keys`/`text_keys`: column names, the first present
    wins (None: the first of `IMAGE_COLUMNS` / `TEXT_COLUMNS`)."""

    group_size = 1

    def __init__(self, spec: str, urls: list[str], image_keys: tuple[str, ...] | None = None,
                 text_keys: tuple[str, ...] | None = None) -> None:
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise DataError("--dataset-type parquet reads Parquet with pyarrow: pip install "
                            "'naflexclip[remote]' (or pyarrow)") from None
        self.name, self.urls = spec, urls
        self.index_skips: list[dict[str, Any]] = []
        self.columns: list[tuple[str, str]] = []
        groups, sizes, first_rows = [], [], []
        for f, (url, meta) in enumerate(zip(urls, _footers(spec, urls), strict=True)):
            schema = meta.schema.to_arrow_schema()
            self.columns.append((_column(schema.names, image_keys, IMAGE_COLUMNS, "--image-key", url),
                                 _column(schema.names, text_keys, TEXT_COLUMNS, "--text-key", url)))
            for name, flag in zip(self.columns[-1], ("--image-key", "--text-key"), strict=True):
                _checked_type(schema, name, flag, url)
            row = 0
            for g in range(meta.num_row_groups):
                groups.append((f, g))
                first_rows.append(row)
                sizes.append(meta.row_group(g).num_rows)
                row += sizes[-1]
        self.groups = np.asarray(groups, np.int64).reshape(-1, 2)
        self.first_rows = np.asarray(first_rows, np.int64)  # each group's first row within its file
        self.group_sizes = np.asarray(sizes, np.int64)
        self.bounds = np.concatenate([[0], np.cumsum(self.group_sizes)]).astype(np.int64)
        self._files: dict[int, Any] = {}
        self._tables: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._pid = -1

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def _where(self, index: int) -> tuple[int, int, int]:
        """(row group, file, row within the file) of sample `index`."""
        g = int(np.searchsorted(self.bounds, index, side="right")) - 1
        return g, int(self.groups[g, 0]), int(self.first_rows[g]) + index - int(self.bounds[g])

    def describe(self, index: int) -> tuple[str, str, int | None]:
        g, f, row = self._where(index)
        return self.urls[f], f"row{row}", None

    def _table(self, g: int) -> Any:
        if self._pid != os.getpid():  # a forked worker opens its own files
            self._files, self._tables, self._pid = {}, collections.OrderedDict(), os.getpid()
        if g not in self._tables:
            f, group = (int(v) for v in self.groups[g])
            try:
                if f not in self._files:
                    self._files[f] = _open(self.urls[f])
                self._tables[g] = self._files[f].read_row_group(group, columns=list(self.columns[f]))
            except remote.Unreachable as error:
                self._tables[g] = SkipSample("unreachable_shard", str(error))
            except (OSError, ValueError) as error:  # pyarrow's errors (ArrowInvalid is a ValueError)
                self._tables[g] = SkipSample("truncated_shard", f"row group {group} of {self.urls[f]}: {error}")
            while len(self._tables) > 2 * BLOCK_ROW_GROUPS:
                self._tables.popitem(last=False)
        self._tables.move_to_end(g)
        return self._tables[g]

    def load(self, index: int) -> RawSample:
        g, f, row = self._where(index)
        table = self._table(g)
        if isinstance(table, SkipSample):
            raise SkipSample(table.reason, str(table).partition(": ")[2])
        j = index - int(self.bounds[g])
        image_column, text_column = self.columns[f]
        image = table.column(image_column)[j].as_py()
        if isinstance(image, dict):  # the `datasets` library's Image feature: {"bytes": ..., "path": ...}
            image = image.get("bytes")
        if image is None:
            raise SkipSample("missing_image", f"{image_column} of row {row} holds no image bytes")
        caption = table.column(text_column)[j].as_py()
        return RawSample(image, caption, None, f"{self.urls[f]}:row{row}")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}, "_tables": collections.OrderedDict(), "_pid": -1}
