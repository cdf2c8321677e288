"""CSV/TSV tables as a map-style source (OpenCLIP's `--csv-img-key`, `--csv-caption-key`, `--csv-separator`)."""

from __future__ import annotations

import os
from typing import Any

from naflexclip.data.folders import sidecar_regions
from naflexclip.data.samples import SkipSample, decode_caption, read_image_file
from naflexclip.data.source import DataError, RawSample, skip_record


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


def _not_a_table(path: str) -> str | None:
    """What a file that holds binary data is (a table's text has no NUL byte), or None for text."""
    with open(path, "rb") as f:
        head = f.read(512)
    if b"\x00" not in head:
        return None
    if head[257:262] == b"ustar":
        return "a tar archive (WebDataset shards: --dataset-type webdataset or auto)"
    if head.startswith(b"PAR1"):
        return "a Parquet file (--dataset-type parquet or auto)"
    return "binary data"


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
        binary = _not_a_table(path)
        if binary is not None:
            raise DataError(f"{path} is not a CSV/TSV table: it is {binary}")
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
