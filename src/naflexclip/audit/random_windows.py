"""Random NaFlex windows: batches of random images with varied grids and random captions (one or several per image),
and random uneven splits of a window into microbatches. `naflexclip verify`, the tests and the benchmarks build
their windows from these.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any

import torch

from naflexclip.objectives.multi_positive import grouped_window


def random_naflex_batch(
    num_examples: int,
    *,
    patch_size: int,
    context_length: int,
    seq_lens: Sequence[int] = (4, 9, 16, 25, 36),
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    vocab_size: int = 49408,
) -> dict[str, Any]:
    """A NaFlex batch of random images with varied grids (each ≤ a length from `seq_lens`) and random
    token ids ending in the end-of-text token, padded to the longest sequence."""
    gen = generator or torch.Generator().manual_seed(0)
    max_len = max(seq_lens)
    dim = patch_size * patch_size * 3
    patches = torch.zeros(num_examples, max_len, dim, dtype=dtype)
    coords = torch.zeros(num_examples, max_len, 2, dtype=torch.long)
    valid = torch.zeros(num_examples, max_len, dtype=torch.bool)
    text = torch.zeros(num_examples, context_length, dtype=torch.long)
    for row in range(num_examples):
        budget = seq_lens[int(torch.randint(len(seq_lens), (1,), generator=gen))]
        # a random aspect ratio whose grid fits the budget, as NaFlex resizing produces
        height = int(torch.randint(1, budget + 1, (1,), generator=gen))
        width = max(1, budget // height)
        length = height * width
        grid = torch.stack(torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij"), -1)
        patches[row, :length] = torch.randn(length, dim, generator=gen, dtype=dtype)
        coords[row, :length] = grid.reshape(length, 2)
        valid[row, :length] = True
        num_tokens = int(torch.randint(2, context_length + 1, (1,), generator=gen))
        text[row, 0] = vocab_size - 2  # start of text
        text[row, 1 : num_tokens - 1] = torch.randint(1, vocab_size - 2, (num_tokens - 2,), generator=gen)
        text[row, num_tokens - 1] = vocab_size - 1  # end of text: open_clip pools at the argmax id
    longest = int(valid.sum(1).max())
    image = {"patches": patches[:, :longest], "patch_coord": coords[:, :longest], "patch_valid": valid[:, :longest]}
    return {"image": image, "text": text}


def random_grouped_batch(num_images: int, *, max_captions: int = 3, generator: torch.Generator | None = None,
                         **kwargs: Any) -> dict[str, Any]:
    """A grouped NaFlex batch: `num_images` random images, each with 1 to `max_captions` random captions (its
    group), the captions in image order; group ids `image_group [N]`, `text_group [M]` (arbitrary integers)."""
    draw = functools.partial(random_naflex_batch, **kwargs)
    return grouped_window(num_images, draw, generator or torch.Generator().manual_seed(0), max_captions)


def random_split_sizes(num_examples: int, num_microbatches: int, rng: random.Random) -> list[int]:
    """Uneven sizes ≥ 1 summing to `num_examples` (a random composition)."""
    if not 1 <= num_microbatches <= num_examples:
        raise ValueError(f"cannot split {num_examples} examples into {num_microbatches} non-empty microbatches")
    cuts = sorted(rng.sample(range(1, num_examples), num_microbatches - 1))
    bounds = [0, *cuts, num_examples]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
