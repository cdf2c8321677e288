"""The model an evaluation runs: a naflexclip checkpoint's, or a pretrained family's directory with the config an
evaluation needs (its processor, its own patch budget, fp32). A checkpoint's LocCa decoder is attached, so that
its metrics are evaluated with the towers'."""

from __future__ import annotations

import dataclasses

import torch

from naflexclip.data.data_config import DataConfig
from naflexclip.families import find_family
from naflexclip.models.run_weights import load_checkpoint_model
from naflexclip.objectives import locca_decoder


def evaluated_model(checkpoint: str, device: torch.device) -> tuple[torch.nn.Module, dict]:
    """(model, run config) of a naflexclip checkpoint, or of a pretrained family's directory (a config stating
    its processor, its own patch budget and fp32)."""
    family = find_family(checkpoint)
    if family is not None:
        model = family.load(checkpoint).to(device).eval()
        budget = family.patch_budget(checkpoint, model.image_patch_size)
        # the built-in evaluation's 512 validation scenes (the demo's default is 256)
        data = DataConfig(hf_processor=checkpoint, naflex_seq_lens=(budget,), naflex_max_tokens_per_batch=32 * budget,
                          synthetic_val_size=512)
        return model, {"data": dataclasses.asdict(data), "precision": "fp32", "zero_shot_samples": 0}
    model, config = load_checkpoint_model(checkpoint, device)
    if locca_decoder.HEAD_SLOT in model.pending_heads and model.config.decoder is not None:
        locca_decoder.attach_decoder(model, model.config.decoder).eval()
    return model, config
