"""Folders of images, each captioned by the .txt file of its stem, as a map-style source."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from naflexclip.data.samples import IMAGE_EXTENSIONS, read_image_file
from naflexclip.data.source import CAPTION_EXTENSIONS, DataError, RawSample, skip_record


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
