"""A sample's regions (boxes with captions) and the LocCa decoder example each sample trains in an epoch.

`parse_regions` reads a sample's `.json` regions, each box divided by the stored image's width and height, and
skips a bad region by name (`samples.REGION_REASONS`), never the sample; `DecoderExamples` draws each sample's
decoder example (caption, aref or gcap; half of them parallel) from (seed, epoch, sample key) alone, so a resume
and any split of the data see the same examples. docs/data.md#regions-siglip-2s-locca-decoder.
"""

from __future__ import annotations

import io
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from naflexclip.batch import EXAMPLE_INPUTS
from naflexclip.data.sample_inputs import DecodedSample, SampleInputs
from naflexclip.processing.decoder_tokens import TASKS, Vocabulary, collate_decoder, decoder_example


@dataclass(frozen=True)
class Region:
    """A box as fractions of the image's width and height `(x0, y0, x1, y1)`, and its caption."""

    box: tuple[float, float, float, float]
    caption: str


def parse_regions(data: Any, width: int, height: int) -> tuple[list[Region], list[tuple[str, str]]]:
    """The usable regions of a sample's `.json` (bytes, str or the parsed object) for an original image of
    `width` x `height` pixels, and (reason, detail) of each region skipped."""
    if isinstance(data, bytes | str):
        try:
            data = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return [], [("region_malformed", "the .json is not JSON")]
    if not isinstance(data, dict):  # valid JSON, but not the object that holds "regions"
        return [], [("region_malformed", f"the .json is {_json_kind(data)}, not an object")]
    entries = data.get("regions")
    if entries is None:
        return [], []
    if not isinstance(entries, list):
        return [], [("region_malformed", f"\"regions\" is a {type(entries).__name__}, not a list")]
    regions, skipped = [], []
    for n, entry in enumerate(entries):
        bbox = entry.get("bbox") if isinstance(entry, dict) else None
        if (not isinstance(bbox, list | tuple) or len(bbox) != 4
                or not all(isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c) for c in bbox)):
            skipped.append(("region_malformed", f"region {n}: bbox {bbox!r} is not [x0, y0, x1, y1]"))
            continue
        x0, y0, x1, y1 = (float(c) for c in bbox)
        if min(x0, y0, x1, y1) < 0 or max(x0, x1) > width or max(y0, y1) > height:
            skipped.append(("region_outside_image", f"region {n}: bbox {list(bbox)} outside {width}x{height}"))
            continue
        if x1 <= x0 or y1 <= y0:
            skipped.append(("region_empty_box", f"region {n}: bbox {list(bbox)} has x1 <= x0 or y1 <= y0"))
            continue
        caption = entry.get("caption")
        if not isinstance(caption, str) or not caption.strip():
            skipped.append(("region_no_caption", f"region {n}: caption {caption!r}"))
            continue
        regions.append(Region((x0 / width, y0 / height, x1 / width, y1 / height), caption.strip()))
    return regions, skipped


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string"}.get(type(value), "a number")


class CaptionTokens:
    """A caption's word tokens from the text tower's tokenizer (`tokenize(texts, context_length) -> [B, T]`), with
    its start, end and padding stripped; `end` is the tokenizer's end token (the last token of an empty text; the
    padding id when an empty text has no token)."""

    def __init__(self, tokenize: Callable[[list[str], int], torch.Tensor], context_length: int) -> None:
        self.tokenize, self.context_length = tokenize, context_length
        empty = tokenize([""], context_length)[0].tolist()
        self.pad = empty[-1]
        used = list(empty)
        while used and used[-1] == self.pad:
            used.pop()
        # a tokenizer that marks no start or end (SigLIP 2's: the text is followed by padding) ends a target with
        # its padding id, where its text tower reads the end of a text
        self.start, self.end = (used[:-1], used[-1]) if used else ([], self.pad)

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        rows = self.tokenize(list(texts), self.context_length).tolist()
        words = []
        for row in rows:
            while row and row[-1] == self.pad:
                row.pop()
            if row and row[-1] == self.end:
                row.pop()
            if row[: len(self.start)] == self.start:
                row = row[len(self.start):]
            words.append(row)
        return words


def original_size(data: bytes | Image.Image | None, decoded: Image.Image) -> tuple[int, int]:
    """(width, height) of the stored image, from its header: a JPEG decoded in draft mode is smaller."""
    if isinstance(data, bytes):
        return Image.open(io.BytesIO(data)).size
    return decoded.size


@dataclass(frozen=True)
class DecoderExamples(SampleInputs):
    """Each sample's decoder example from its caption and regions, collated at the decoder's fixed width into a
    microbatch's `example_inputs`; a bad region is a skip record of its own, not the sample's."""

    vocab: Vocabulary
    max_length: int
    tokens: CaptionTokens
    task: str | None = None  # evaluation: this task (a sample without regions: caption), causal

    def draw(self, seed: int, epoch: int, sample_key: str, has_regions: bool, num_regions: int
             ) -> tuple[str, int, bool]:
        """(task, region index, parallel) of a sample in an epoch: a function of (seed, epoch, key) alone."""
        rng = random.Random(f"{seed}:{epoch}:{sample_key}:locca")  # str seeds hash with SHA-512: stable
        task = TASKS[rng.randrange(len(TASKS))] if has_regions else "caption"
        region = rng.randrange(num_regions) if has_regions else 0
        parallel = rng.random() < 0.5
        if self.task is not None:
            return (self.task if has_regions else "caption"), region, False
        return task, region, parallel

    def example(self, caption: str, regions: Sequence[Region], seed: int, epoch: int, sample_key: str
                ) -> tuple[list[int], list[int], bool]:
        task, r, parallel = self.draw(seed, epoch, sample_key, bool(regions), len(regions))
        text = caption if task == "caption" else regions[r].caption
        words = [*self.tokens([text])[0], self.tokens.end]
        box = self.vocab.box_tokens(regions[r].box) if regions else []
        prefix, target = {"caption": ([], words), "aref": (words[:-1], box), "gcap": (box, words)}[task]
        return (*decoder_example(self.vocab, task, prefix, target, parallel, self.max_length), parallel)

    def collate(self, examples: Sequence[tuple[list[int], list[int], bool]]) -> dict[str, torch.Tensor]:
        batch = collate_decoder(examples, self.vocab, length=self.max_length)
        return {"decoder_input_ids": batch.input_ids, "decoder_labels": batch.labels,
                "decoder_parallel": batch.parallel}

    def check(self, augment: bool, multi_caption: bool) -> None:
        if augment or multi_caption:
            raise ValueError("a LocCa term (--recipe siglip2 / --locca-loss-weight) with "
                             f"{'--augment' if augment else '--multi-positive'} is not supported: "
                             + ("a crop would move the regions' boxes" if augment else "one decoder example per "
                                "image needs one caption"))

    def of_sample(self, sample: DecodedSample) -> tuple[list[int], list[int], bool]:
        raw, regions = sample.raw, list[Region]()
        if raw.regions is not None:
            regions, bad = parse_regions(raw.regions, *original_size(raw.image, sample.image))
            sample.skips += bad
        return self.example(sample.captions[0], regions, sample.seed_key[0], sample.seed_key[1], raw.key)

    def of_microbatch(self, values: list[Any], texts: list[str], seq_len: int) -> dict[str, dict[str, Any]]:
        return {EXAMPLE_INPUTS: self.collate(values)}
