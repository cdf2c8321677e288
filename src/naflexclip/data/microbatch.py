"""One planned microbatch from its raw samples: decode, NaFlex transform, collate, tokenize; and splitting one.

Runs in the DataLoader workers. A bad sample is left out of its microbatch and becomes a skip record; a
microbatch whose samples are all bad comes back as an empty item, covered later by the loader.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from naflexclip.batch import EXAMPLE_INPUTS, TEACHER_INPUTS
from naflexclip.data.sample_inputs import DecodedSample, SampleInputs
from naflexclip.data.samples import JsonCaption, SkipSample, decode_captions, decode_image, one_caption
from naflexclip.data.schedule import PatchSizes, ScheduledBatch, even_sizes
from naflexclip.data.source import RawSample, skip_record
from naflexclip.processing.naflex_transform import Processing

# where a sample is, for the skip log: (source, key, line)
Where = tuple[str, str | None, int | None]


@dataclass(frozen=True)
class TeacherInputs(SampleInputs):
    """How a distillation teacher whose inputs differ from the student's processes the same samples: its processing
    (its transform, collation and tokenizer; cropping like the student's with --augment), patch size and context
    length. Each image is resized at the microbatch's sequence length on the teacher's own patch grid (as many
    patches as the student gets at most; larger pixels when its patches are larger); a sample its transform skips
    is left out for the student too. In each microbatch's `teacher_inputs`: its patches and tokens of the same
    samples and captions."""

    processing: Processing
    patch_size: int
    context_length: int

    def target_hw(self, hw: tuple[int, int], seq_len: int) -> tuple[int, int] | None:
        return self.processing.transform.target_hw(hw, seq_len)

    def of_sample(self, sample: DecodedSample) -> Any:
        own = self.processing.transform
        if sample.draws is None:
            return own(sample.image, sample.seq_len)
        return own(sample.image, sample.seq_len, _replayed(sample.draws))  # the same crop: the student's draws

    def of_microbatch(self, values: list[Any], texts: list[str], seq_len: int) -> dict[str, dict[str, Any]]:
        return {TEACHER_INPUTS: {"image": self.processing.collate(values, seq_len, self.patch_size),
                                 "text": self.processing.tokenize(texts, self.context_length)}}


class MicrobatchBuilder:
    """Builds the item of a planned microbatch: {"planned": its index in the plan, "skips": records} and, unless
    every sample was bad ("empty": True), "image" (the NaFlex dict), "text", "keys", "seq_len", "num_tokens" and
    "labels" where the source has them.

    `processing`: the model's image transform, collation and tokenizer, handed in by the caller (the model's
    family, `naflexclip.families.data_processing`; built in the main process, so a bad one fails there, not in a
    worker). `augment` (its transform then crops at random) draws each microbatch's crops from a generator seeded
    by the microbatch's `seed_key`, so a resume replays them and no global RNG is touched.
    `json_caption`: captions are fields of a JSON member (`--json-text-key`), chosen per (seed, epoch, sample) from
    the first two entries of `seed_key`; `max_image_pixels` > 0: larger images are skipped before decoding.
    `multi_caption`: every caption of a sample with several becomes a text row, and the item is grouped
    (`image_group`, `text_group`: a sample's group id is a hash of its key, the same on every rank and in every
    window); otherwise a sample with several captions takes one per epoch (`one_caption`). `caption_per_line`
    (--caption-per-line): a caption file's (a folder's `.txt`, a shard's text member) non-empty lines are several
    captions of its image.
    `patch_sizes` (--naflex-patch-sizes): each microbatch's patch size, drawn from its `seed_key` (seed, epoch,
    rank, microbatch index), its images transformed and patched at it into `[B, N, P, P, 3]` patches (timm's
    unflattened layout, which the model's patch interpolator resamples its embedding to), with the item's
    "patch_size"; None: `patch_size` for every microbatch, patches flattened.
    `inputs`: what the objectives' examples need besides (`naflexclip.data.sample_inputs.SampleInputs`: a LocCa
    decoder's example from each sample's caption and regions, a teacher's own patches and tokens, a view seed),
    each built from every sample the student's transform keeps and collated into the item in their order; a sample
    one of them skips is left out of the microbatch.
    """

    def __init__(self, *, patch_size: int, context_length: int, processing: Processing, augment: bool = False,
                 json_caption: JsonCaption | None = None, max_image_pixels: int = 0,
                 multi_caption: bool = False, caption_per_line: bool = False,
                 patch_sizes: PatchSizes | None = None, inputs: Sequence[SampleInputs] = ()) -> None:
        for each in inputs:
            each.check(augment, multi_caption)
        self.inputs = tuple(inputs)
        self.patch_size, self.context_length, self.augment = patch_size, context_length, augment
        self.processing = processing
        self.patch_sizes = patch_sizes
        # one processing per patch size, built here (the main process) so an unsupported one fails before training
        self._at_size = {size: processing.at_patch_size(size) for size in (patch_sizes.sizes if patch_sizes else ())}
        self.json_caption, self.max_image_pixels = json_caption, max_image_pixels
        self.multi_caption, self.caption_per_line = multi_caption, caption_per_line

    def build(self, planned: ScheduledBatch, samples: list[tuple[RawSample | SkipSample, Where]],
              records: list[dict[str, Any]], seed_key: tuple[int, ...]) -> dict[str, Any]:
        """The item of `planned` from `samples` (each with where it is); `records`: skips found before decoding."""
        # only our NaFlex transform augments (SigLIP 2's processing refuses --augment)
        rng = random.Random(hash(seed_key)) if self.augment else None
        patch_size, processing = self.patch_size, self.processing
        if self.patch_sizes is not None:
            patch_size = self.patch_sizes.draw(*seed_key)
            processing = self._at_size[patch_size]
        transform = processing.transform
        # a JPEG is decoded at the smallest scale that still covers every resize of it
        draft = lambda hw: tuple(max(sizes) for sizes in zip(*(
            size for size in (transform.target_hw(hw, planned.seq_len),
                              *(each.target_hw(hw, planned.seq_len) for each in self.inputs)) if size is not None),
            strict=True))
        records = list(records)
        pixels, texts, labels, keys, captions_per_image = [], [], [], [], []
        inputs: list[list[Any]] = [[] for _ in self.inputs]  # each input's values of the samples kept
        for raw, (source, key, line) in samples:
            try:
                if isinstance(raw, SkipSample):
                    raise raw
                image = (raw.image if isinstance(raw.image, Image.Image)
                         else decode_image(raw.image, draft, self.max_image_pixels))
                caption = (decode_captions(raw.caption, self.caption_per_line) if self.json_caption is None
                           else self.json_caption(raw.caption, seed_key[0], seed_key[1], raw.key))
                captions = [caption] if isinstance(caption, str) else caption
                if not self.multi_caption:
                    captions = [one_caption(caption, seed_key[0], seed_key[1], raw.key)]
                draws = None if rng is None or not self.inputs else rng.getstate()
                patched = (transform(image, planned.seq_len) if rng is None
                           else transform(image, planned.seq_len, rng))
                decoded = DecodedSample(raw, image, captions, seed_key, planned.seq_len, draws)
                values = [each.of_sample(decoded) for each in self.inputs]
            except SkipSample as skip:
                records.append(skip_record(source, key, line, skip.reason, str(skip)))
                continue
            pixels.append(patched)  # after every input's: a sample one of them skips is in no list
            for kept, value in zip(inputs, values, strict=True):
                kept.append(value)
            records += [skip_record(source, key, line, reason, detail) for reason, detail in decoded.skips]
            texts.extend(captions)
            captions_per_image.append(len(captions))
            keys.append(raw.key)
            if raw.labels is not None:
                labels.append(raw.labels)
        item: dict[str, Any] = {"planned": planned.index, "skips": records}
        if not pixels:
            item["empty"] = True
            return item
        item["image"] = processing.collate(pixels, planned.seq_len, patch_size)
        if self.patch_sizes is not None:  # (ph, pw, C) flattened, as timm's Patchify(flatten_patches=False) leaves it
            item["image"]["patches"] = item["image"]["patches"].unflatten(-1, (patch_size, patch_size, 3))
            item["patch_size"] = patch_size
        item["text"] = processing.tokenize(texts, self.context_length)
        item["keys"] = keys
        for each, values in zip(self.inputs, inputs, strict=True):
            for where, collated in each.of_microbatch(values, texts, planned.seq_len).items():
                item.setdefault(where, {}).update(collated)
        if self.multi_caption:
            item["image_group"] = torch.tensor([group_id(key) for key in keys], dtype=torch.int64)
            item["text_group"] = torch.repeat_interleave(item["image_group"], torch.tensor(captions_per_image))
        item["seq_len"] = planned.seq_len
        item["num_tokens"] = int(item["image"]["patch_valid"].sum())
        if labels:
            item["labels"] = {k: torch.tensor([lab[k] for lab in labels]) for k in labels[0]}
        return item


def _replayed(state: Any) -> random.Random:
    """A generator that draws what the one whose `getstate()` was `state` drew next."""
    rng = random.Random()
    rng.setstate(state)
    return rng


def group_id(sample_key: str) -> int:
    """A sample's group id: a 63-bit hash of its key, so ids are global over microbatches, ranks and epochs without
    any exchange (two samples of one epoch collide with probability ~n²/2⁶⁴)."""
    return int.from_bytes(hashlib.blake2b(sample_key.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def split_rows(item: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A collated microbatch cut into `parts` consecutive microbatches of nearly equal rows (larger first); a
    grouped one is cut by its images, each keeping its captions."""
    rows = len(item["keys"])
    bounds = [0, *itertools.accumulate(even_sizes(rows, parts))]
    grouped = "image_group" in item
    pieces = []
    for lo, hi in itertools.pairwise(bounds):
        image = {k: v[lo:hi] for k, v in item["image"].items()}
        texts = (torch.isin(item["text_group"], item["image_group"][lo:hi]).nonzero().flatten() if grouped
                 else slice(lo, hi))
        piece = {**item, "image": image, "text": item["text"][texts], "keys": item["keys"][lo:hi],
                 "num_tokens": int(image["patch_valid"].sum())}
        if grouped:
            piece["image_group"], piece["text_group"] = item["image_group"][lo:hi], item["text_group"][texts]
        if EXAMPLE_INPUTS in item:
            piece[EXAMPLE_INPUTS] = {k: v[lo:hi] for k, v in item[EXAMPLE_INPUTS].items()}
        if TEACHER_INPUTS in item:
            teacher = item[TEACHER_INPUTS]
            piece[TEACHER_INPUTS] = {"image": {k: v[lo:hi] for k, v in teacher["image"].items()},
                                     "text": teacher["text"][texts]}
        if "labels" in item:
            piece["labels"] = {k: v[lo:hi] for k, v in item["labels"].items()}
        pieces.append(piece)
    return pieces
