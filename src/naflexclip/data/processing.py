"""Which image transform, collation and tokenizer a data config uses: timm's NaFlex transform with open_clip's
tokenizer (our presets), or an imported SigLIP 2 checkpoint's own (`DataConfig.hf_processor`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from naflexclip.data.transform import NaFlexTransform, collate, tokenize


@dataclass(frozen=True)
class Processing:
    """`transform(img, seq_len) -> (uint8 patches, patch_coord)`, `collate(samples, seq_len, patch_size)` -> the
    NaFlex image dict, `tokenize(texts, context_length)` -> long `[B, T]`."""

    transform: Any
    collate: Callable[[list[tuple[torch.Tensor, torch.Tensor]], int, int], dict[str, torch.Tensor]]
    tokenize: Callable[[list[str], int], torch.Tensor]


def make_processing(hf_processor: str | None, patch_size: int, augment: bool = False) -> Processing:
    """The default pipeline, or the SigLIP 2 checkpoint directory `hf_processor`'s tokenizer and patching."""
    if hf_processor is None:
        return Processing(NaFlexTransform(patch_size, augment=augment), collate, tokenize)
    if augment:
        raise ValueError("--augment: random crops are not part of SigLIP 2's image processor; drop --augment "
                         "when fine-tuning an imported SigLIP 2 checkpoint")
    from naflexclip.data.siglip2_processing import (
        Siglip2Transform,
        load_tokenizer,
        processor_settings,
        siglip2_collate,
        siglip2_tokenize,
    )

    load_tokenizer(hf_processor), processor_settings(hf_processor, patch_size)  # fail here, not in a worker
    return Processing(Siglip2Transform(hf_processor, patch_size), functools.partial(siglip2_collate, hf_processor),
                      functools.partial(siglip2_tokenize, hf_processor))
