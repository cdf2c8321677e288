"""Which image transform, collation and tokenizer a data config uses: timm's NaFlex transform with open_clip's
tokenizer (our presets), or those of a pretrained directory's family (`DataConfig.hf_processor`)."""

from __future__ import annotations

from naflexclip.data.transform import NaFlexTransform, Processing, collate, tokenize


def make_processing(hf_processor: str | None, patch_size: int, augment: bool = False) -> Processing:
    """The default pipeline, or the tokenizer and patching of the pretrained directory `hf_processor`."""
    if hf_processor is None:
        return Processing(NaFlexTransform(patch_size, augment=augment), collate, tokenize)
    from naflexclip.families import family_of  # the families import the model: only when asked for

    return family_of(hf_processor).processing(hf_processor, patch_size, augment)
