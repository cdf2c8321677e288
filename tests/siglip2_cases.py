"""Tiny random-weight SigLIP 2 checkpoints written by transformers itself, with a tokenizer built here.

Nothing is downloaded: `Siglip2Model(config).save_pretrained` writes the weights, a character-level
`Siglip2Tokenizer` (the Gemma tokenizer with SigLIP 2's lowercasing) is built from a small vocabulary, padding on
the right as the published checkpoints' tokenizer_config.json says (the class default pads on the left), and a
`Siglip2ImageProcessor` with the tiny patch size is saved next to them.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

# unequal vision/text widths (the text head projects 48 -> 32), patch 4 on a 4x4 position table
SMALL = {
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "patch_size": 4, "num_patches": 16},
    "text_config": {"vocab_size": 64, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "max_position_embeddings": 12, "projection_size": 32, "pad_token_id": 0,
                    "bos_token_id": 2, "eos_token_id": 1},
}
# wider vision than text, more heads, a 5x5 table (resized to every grid), another LayerNorm eps
OTHER = {
    "vision_config": {"hidden_size": 48, "intermediate_size": 72, "num_hidden_layers": 1, "num_attention_heads": 4,
                      "patch_size": 4, "num_patches": 25, "layer_norm_eps": 1e-5},
    "text_config": {"vocab_size": 70, "hidden_size": 32, "intermediate_size": 56, "num_hidden_layers": 3,
                    "num_attention_heads": 2, "max_position_embeddings": 10, "projection_size": 48,
                    "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, "layer_norm_eps": 1e-5},
}
CONFIGS = {"small": SMALL, "other": OTHER}


def tokenizer_vocab() -> dict[str, int]:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for token in "▁" + string.ascii_lowercase + string.digits + ".,-'":
        vocab[token] = len(vocab)
    return vocab


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (LayerNorm scales around 1), so no tensor can be mapped wrongly unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            is_norm_scale = "norm" in name and name.endswith("weight")
            param.copy_(1 + 0.2 * noise if is_norm_scale else 0.2 * noise)
        model.logit_scale.fill_(2.3)
        model.logit_bias.fill_(-4.0)


def make_checkpoint(path: Path, config: dict | None = None, *, seed: int = 0, tokenizer: bool = True,
                    max_num_patches: int = 64) -> Path:
    """A transformers SigLIP 2 checkpoint directory with random weights (and tokenizer, image processor)."""
    from transformers import Siglip2Config, Siglip2ImageProcessor, Siglip2Model
    from transformers.models.siglip2.tokenization_siglip2 import Siglip2Tokenizer

    config = config or SMALL
    model = Siglip2Model(Siglip2Config(**config))
    randomize_(model, seed)
    model.save_pretrained(path)
    if tokenizer:
        Siglip2Tokenizer(vocab=tokenizer_vocab(), merges=[], padding_side="right").save_pretrained(path)
    patch = config["vision_config"]["patch_size"]
    Siglip2ImageProcessor(patch_size=patch, max_num_patches=max_num_patches).save_pretrained(path)
    return Path(path)


def hf_features(hf_model, image: dict[str, torch.Tensor], text: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' normalised image/text embeddings, exp(logit_scale) and logit_bias for our inputs."""
    from naflexclip.families.siglip2 import naflex_to_transformers

    with torch.no_grad():
        image_embeds = hf_model.get_image_features(**naflex_to_transformers(image)).pooler_output
        text_embeds = hf_model.get_text_features(input_ids=text).pooler_output
    return {"image_features": torch.nn.functional.normalize(image_embeds, dim=-1),
            "text_features": torch.nn.functional.normalize(text_embeds, dim=-1),
            "logit_scale": hf_model.logit_scale.detach().exp().reshape(()),
            "logit_bias": hf_model.logit_bias.detach().reshape(())}
