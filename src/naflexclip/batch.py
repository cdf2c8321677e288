"""The microbatch format, and its helpers: size, kind (dense or NaFlex), device moves, concatenation, splitting.

A microbatch is `{"image": dense [B, C, H, W] or NaFlex dict, "text": long [B, T], ...}`; a NaFlex dict holds
`patches [B, L, P*P*C]`, `patch_coord [B, L, 2]` (row, col) and `patch_valid [B, L]` (True for real patches), `L`
that microbatch's padded length. Optional keys, each row-aligned: `example_inputs` (fixed-width tensors of
per-example terms, e.g. decoder tokens); `image_group` long `[B]` and `text_group` long `[M]` (several captions per
image: image i and text j are a positive pair when their ids are equal; `M` may differ from `B`); `teacher_inputs`
(`{"image": NaFlex dict, "text": long [B, T']}`, a teacher's own processing of the same rows when it reads other
inputs than the student; without it the teacher reads `image` and `text`). Its size (`batch_size`) is its images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

NAFLEX_KEYS = ("patches", "patch_coord", "patch_valid")
GROUP_KEYS = ("image_group", "text_group")
EXAMPLE_INPUTS = "example_inputs"  # row-aligned tensors of per-example objective terms (decoder tokens), fixed width
TEACHER_INPUTS = "teacher_inputs"  # the teacher's own image and text of the same rows, when they differ


def is_naflex(image: Any) -> bool:
    """True for a NaFlex dict, False for a dense tensor; ValueError for anything else."""
    if isinstance(image, dict):
        missing = [key for key in NAFLEX_KEYS if key not in image]
        if missing:
            raise ValueError(f"NaFlex image dict is missing {missing}; it has keys {sorted(image)}")
        return True
    if isinstance(image, torch.Tensor):
        return False
    raise ValueError(f"image must be a dense tensor or a NaFlex dict, got {type(image).__name__}")


def is_grouped(microbatch: dict[str, Any]) -> bool:
    """True when the microbatch carries group ids (`image_group`, `text_group`)."""
    present = [key in microbatch for key in GROUP_KEYS]
    if any(present) and not all(present):
        raise ValueError(f"a grouped microbatch holds both {GROUP_KEYS}; it has keys {sorted(microbatch)}")
    return all(present)


def batch_size(microbatch: dict[str, Any]) -> int:
    """Number of examples in a microbatch: its image–text pairs (image and text rows must agree), or its images
    when it is grouped (each with its captions)."""
    text = microbatch["text"]
    image_rows = num_images(microbatch["image"])
    if is_grouped(microbatch):
        if microbatch["image_group"].shape != (image_rows,) or microbatch["text_group"].shape != (text.shape[0],):
            raise ValueError(f"group ids {tuple(microbatch['image_group'].shape)} / "
                             f"{tuple(microbatch['text_group'].shape)} do not match {image_rows} images / "
                             f"{text.shape[0]} texts")
        return int(image_rows)
    if image_rows != text.shape[0]:
        raise ValueError(f"microbatch has {image_rows} images but {text.shape[0]} texts")
    return int(text.shape[0])


def num_images(image: Any) -> int:
    """Rows of a dense image tensor or a NaFlex dict."""
    return int(image["patches"].shape[0] if is_naflex(image) else image.shape[0])


def teacher_inputs(microbatch: dict[str, Any]) -> dict[str, Any]:
    """What a distillation teacher reads of a microbatch: its `teacher_inputs`, else the student's image and text."""
    own = microbatch.get(TEACHER_INPUTS)
    return own if own is not None else {"image": microbatch["image"], "text": microbatch["text"]}


def text_rows(microbatch: dict[str, Any]) -> int:
    """Number of texts in a microbatch (its pairs, unless it is grouped)."""
    return int(microbatch["text"].shape[0])


def to_device(
    microbatch: dict[str, Any], device: torch.device | str, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Move `image` and `text` to `device`; floating image tensors are cast to `dtype` if given; entries of a NaFlex
    dict that are not tensors (OpenCLIP's collator adds an int `seq_len`) stay as they are."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype, non_blocking=True)
        return t.to(device=device, non_blocking=True)

    image = microbatch["image"]
    moved_image = {k: move(v) for k, v in image.items()} if isinstance(image, dict) else move(image)
    groups = {key: move(microbatch[key]) for key in GROUP_KEYS if key in microbatch}
    moved = {**microbatch, "image": moved_image, "text": move(microbatch["text"]), **groups}
    if EXAMPLE_INPUTS in microbatch:  # integer / bool rows (decoder tokens): device only
        moved[EXAMPLE_INPUTS] = {k: v.to(device, non_blocking=True) for k, v in microbatch[EXAMPLE_INPUTS].items()}
    if TEACHER_INPUTS in microbatch:
        moved[TEACHER_INPUTS] = to_device(microbatch[TEACHER_INPUTS], device, dtype)
    return moved


def concat_microbatches(microbatches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One batch of all rows, in order; NaFlex sequences are padded to the longest `L`."""
    text = torch.cat([mb["text"] for mb in microbatches])
    extra = ({EXAMPLE_INPUTS: {key: torch.cat([mb[EXAMPLE_INPUTS][key] for mb in microbatches])
                               for key in microbatches[0][EXAMPLE_INPUTS]}}
             if EXAMPLE_INPUTS in microbatches[0] else {})
    if TEACHER_INPUTS in microbatches[0]:
        extra[TEACHER_INPUTS] = concat_microbatches([mb[TEACHER_INPUTS] for mb in microbatches])
    images = [mb["image"] for mb in microbatches]
    groups = ({key: torch.cat([mb[key] for mb in microbatches]) for key in GROUP_KEYS}
              if is_grouped(microbatches[0]) else {})
    if not is_naflex(images[0]):
        return {"image": torch.cat(images), "text": text, **groups, **extra}
    max_len = max(img["patches"].shape[1] for img in images)

    def pad(t: torch.Tensor) -> torch.Tensor:
        extra = max_len - t.shape[1]
        if extra == 0:
            return t
        filler = t.new_zeros((t.shape[0], extra, *t.shape[2:]))
        return torch.cat([t, filler], dim=1)

    image = {key: torch.cat([pad(img[key]) for img in images]) for key in NAFLEX_KEYS}
    return {"image": image, "text": text, **groups, **extra}


def split_batch(batch: dict[str, Any], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Split a batch into consecutive microbatches of `sizes` rows; NaFlex pieces are trimmed
    to their own longest valid sequence, as a token-budget loader would produce them. A grouped batch is split by
    its images; each text goes, in order, with the piece holding the first image of its group."""
    total = batch_size(batch)
    if sum(sizes) != total or any(size < 1 for size in sizes):
        raise ValueError(f"split sizes {list(sizes)} do not partition a batch of {total} rows")
    grouped = is_grouped(batch)
    if grouped:
        piece_of_image = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(list(sizes)))
        first_piece: dict[int, int] = {}
        for group, piece in zip(batch["image_group"].tolist(), piece_of_image.tolist(), strict=True):
            first_piece.setdefault(group, piece)
        text_piece = torch.tensor([first_piece.get(group, -1) for group in batch["text_group"].tolist()])
    pieces: list[dict[str, Any]] = []
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        start += size
        texts: slice | torch.Tensor = rows
        if grouped:
            texts = torch.eq(text_piece, len(pieces)).nonzero().flatten()
            piece = {"image": _image_rows(batch["image"], rows), "text": batch["text"][texts],
                     "image_group": batch["image_group"][rows], "text_group": batch["text_group"][texts]}
        else:
            piece = {"image": _image_rows(batch["image"], rows), "text": batch["text"][rows]}
        if EXAMPLE_INPUTS in batch:
            piece[EXAMPLE_INPUTS] = {key: value[rows] for key, value in batch[EXAMPLE_INPUTS].items()}
        if TEACHER_INPUTS in batch:  # the teacher's own rows: the piece's images and texts
            own = batch[TEACHER_INPUTS]
            piece[TEACHER_INPUTS] = {"image": _image_rows(own["image"], rows), "text": own["text"][texts]}
        pieces.append(piece)
    return pieces


def _image_rows(image: Any, rows: slice) -> Any:
    """`rows` of a dense image tensor or a NaFlex dict, the latter trimmed to their own longest valid sequence."""
    if not is_naflex(image):
        return image[rows]
    length = int(image["patch_valid"][rows].sum(dim=1).max())
    return {key: image[key][rows, :length] for key in NAFLEX_KEYS}
