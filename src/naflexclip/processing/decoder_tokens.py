"""The LocCa decoder's token language, shared by the data pipeline (which writes decoder examples) and the
decoder (which reads them): the three tasks, the vocabulary (text ids, box coordinates, task and special tokens),
one example's input ids and labels, and their padded batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TASKS = ("caption", "aref", "gcap")
IGNORE = -100  # label of a position that is not a target token



@dataclass(frozen=True)
class Vocabulary:
    """Token ids of the decoder: the text tower's `text_vocab` ids, then `box_bins` coordinate tokens, then the three
    task tokens, a start token and the mask token of parallel prediction."""

    text_vocab: int
    box_bins: int

    @property
    def output_size(self) -> int:  # what the decoder predicts: words and coordinates
        return self.text_vocab + self.box_bins

    def task(self, name: str) -> int:
        return self.output_size + TASKS.index(name)

    @property
    def start(self) -> int:
        return self.output_size + len(TASKS)

    @property
    def mask(self) -> int:
        return self.start + 1

    @property
    def pad(self) -> int:
        return self.mask + 1

    @property
    def input_size(self) -> int:
        return self.pad + 1

    def box_tokens(self, box: Sequence[float]) -> list[int]:
        """A box `(x0, y0, x1, y1)` as fractions of the image's width and height → 4 coordinate tokens."""
        if len(box) != 4:
            raise ValueError(f"a box has 4 coordinates (x0, y0, x1, y1), got {list(box)}")
        bins = self.box_bins - 1
        return [self.text_vocab + int(round(min(max(float(c), 0.0), 1.0) * bins)) for c in box]

    def box_of(self, tokens: Sequence[int]) -> tuple[float, ...] | None:
        """Inverse of `box_tokens` (bin centres); None unless `tokens` starts with 4 coordinate tokens."""
        coords = [int(t) - self.text_vocab for t in tokens[:4]]
        if len(coords) != 4 or any(not 0 <= c < self.box_bins for c in coords):
            return None
        return tuple(c / (self.box_bins - 1) for c in coords)


@dataclass(frozen=True)
class DecoderBatch:
    """The decoder's inputs for a microbatch: `input_ids [B, T]`, `labels [B, T]` (IGNORE off the target) and
    `parallel [B]` (True: all-mask input, no causal mask)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    parallel: torch.Tensor


def decoder_example(vocab: Vocabulary, task: str, prefix: Sequence[int], target: Sequence[int], parallel: bool,
                    max_length: int) -> tuple[list[int], list[int]]:
    """One example's input ids and labels: `[task, *prefix, start, *target[:-1]]` (causal) or
    `[task, *prefix, mask × len(target)]` (parallel), labels `target` at the last `len(target)` positions. The target
    is cut to fit `max_length`; the prefix first gives way to it."""
    if not target:
        raise ValueError(f"a {task} example needs at least one target token")
    room = max_length - 1
    target = list(target)[: room - min(len(prefix), room // 2)]
    prefix = list(prefix)[: room - len(target)]
    body = [vocab.mask] * len(target) if parallel else [vocab.start, *target[:-1]]
    ids = [vocab.task(task), *prefix, *body]
    labels = [IGNORE] * (1 + len(prefix)) + list(target)
    return ids, labels


def collate_decoder(examples: Sequence[tuple[list[int], list[int], bool]], vocab: Vocabulary,
                    length: int | None = None) -> DecoderBatch:
    """Pad `(input_ids, labels, parallel)` examples to the longest one, or to `length` (a fixed width, so that
    microbatches concatenate and split by rows)."""
    length = length or max(len(ids) for ids, _, _ in examples)
    input_ids = torch.full((len(examples), length), vocab.pad, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    for row, (ids, labs, _) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
    parallel = torch.tensor([p for _, _, p in examples], dtype=torch.bool)
    return DecoderBatch(input_ids, labels, parallel)
