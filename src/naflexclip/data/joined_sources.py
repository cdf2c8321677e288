"""Several map-style sources read as one (a `::` mixture of WebDataset shards and Parquet files): sample ids are
numbered source by source, so each source's shards (or row groups) follow the previous source's in a `ShardSet`."""

from __future__ import annotations

from typing import Any

import numpy as np

from naflexclip.data.source import RawSample, Source


class JoinedSources:
    """`sources` one after the other: sample i of the join is sample i - start of the source it falls in."""

    group_size = 1

    def __init__(self, name: str, sources: list[Source]) -> None:
        self.name, self.sources = name, sources
        self.index_skips: list[dict[str, Any]] = [r for s in sources for r in s.index_skips]
        self.starts = np.concatenate([[0], np.cumsum([len(s) for s in sources])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _source(self, index: int) -> tuple[Source, int]:
        s = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.sources[s], index - int(self.starts[s])

    def load(self, index: int) -> RawSample:
        source, i = self._source(index)
        return source.load(i)

    def describe(self, index: int) -> tuple[str, str, int | None]:
        source, i = self._source(index)
        return source.describe(i)
