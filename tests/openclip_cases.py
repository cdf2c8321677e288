"""Shrunken OpenCLIP model names for tests: the real config of a name (`ViT-B-32-quickgelu`, `ViT-B-16-SigLIP`,
`ViT-B-16-SigLIP2`, ...) with small widths, depths and images, registered in open_clip under `<name>-tiny`, so that
`open_clip.create_model` and ours build it in well under a second. Everything else of the name (pooling,
activations, norms, class token, pre-norm, text pooling and mask, projection bias, logit bias) is the name's own."""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import open_clip
import torch


def _register_tiny_timm_models() -> None:
    """Small timm trunks with the architecture arguments of the names' own (open_clip's released TimmModel takes
    no model kwargs, so a shrunken trunk is a registered timm name)."""
    from timm.models import register_model
    from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg
    from timm.models.vision_transformer import VisionTransformer

    def clean(kwargs: dict) -> dict:
        return {k: v for k, v in kwargs.items() if k not in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")}

    @register_model
    def vit_tiny_test_siglip(pretrained: bool = False, **kwargs) -> VisionTransformer:
        # vit_base_patch16_siglip_224's arguments, small
        return VisionTransformer(**{"img_size": 48, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
                                    "class_token": False, "global_pool": "map", **clean(kwargs)})

    @register_model
    def naflexvit_tiny_test_gap(pretrained: bool = False, **kwargs) -> NaFlexVit:
        # naflexvit_base_patch16_gap's configuration, small
        kwargs = clean(kwargs)
        cfg = NaFlexVitCfg(patch_size=8, embed_dim=32, depth=2, num_heads=2, init_values=1e-5, global_pool="avg",
                           reg_tokens=4, fc_norm=True, pos_embed_grid_size=(6, 6))
        kwargs.pop("img_size", None)
        model = NaFlexVit(cfg, **kwargs)
        model.pretrained_cfg = model.default_cfg = {}  # what timm's builder sets (TimmModel reads it)
        return model


try:
    import timm

    if "vit_tiny_test_siglip" not in timm.list_models("vit_tiny_test_*"):
        _register_tiny_timm_models()
except ImportError:  # pragma: no cover
    pass

# name -> (vision overrides, text overrides); native ViTs are shrunk through their fields, timm trunks by a
# registered small timm model of the same arguments
SHRINK = {
    "ViT-B-32-quickgelu": ({"image_size": 64, "patch_size": 16, "width": 32, "head_width": 16, "layers": 2}, {}),
    "ViT-B-32": ({"image_size": 64, "patch_size": 16, "width": 32, "head_width": 16, "layers": 2}, {}),
    "ViT-B-16": ({"image_size": 48, "patch_size": 8, "width": 32, "head_width": 16, "layers": 2}, {}),
    "ViT-L-14-CLIPA": ({"image_size": 56, "patch_size": 14, "width": 32, "head_width": 16, "layers": 2}, {}),
    "ViT-M-16-alt": ({"image_size": 48, "patch_size": 16, "width": 32, "head_width": 16, "layers": 2}, {}),
    "ViT-B-16-SigLIP": ({"image_size": 48, "timm_model_name": "vit_tiny_test_siglip"}, {"vocab_size": 300}),
    "ViT-B-16-SigLIP2": ({"image_size": 48, "timm_model_name": "vit_tiny_test_siglip"}, {"vocab_size": 300}),
    "naflex_ViT-B-16": ({"image_size": 48, "timm_model_name": "naflexvit_tiny_test_gap"}, {}),
}
TEXT_SHRINK = {"width": 32, "heads": 2, "layers": 2}


def tiny_name(name: str) -> str:
    """Register the shrunken config of `name` in open_clip (idempotent); its registered name."""
    tiny = f"{name}-tiny"
    if open_clip.get_model_config(tiny) is not None:
        return tiny
    config = copy.deepcopy(open_clip.get_model_config(name) or _shipped(name))
    vision, text = SHRINK[name]
    config["vision_cfg"].update(vision)
    config["text_cfg"].update({**TEXT_SHRINK, "context_length": min(config["text_cfg"]["context_length"], 16),
                               **text})
    if "mlp_ratio" in config["text_cfg"]:
        config["text_cfg"]["mlp_ratio"] = 4.0
    # without a projection the image width is the embedding width; with one, another width proves the projection
    config["embed_dim"] = 32 if config["vision_cfg"].get("timm_proj", "linear") == "none" else 24
    directory = Path(tempfile.gettempdir()) / f"naflexclip-openclip-configs-{os.getpid()}"
    directory.mkdir(exist_ok=True)
    path = directory / f"{tiny}.json"
    path.write_text(json.dumps(config))
    open_clip.add_model_config(path)
    return tiny


def _shipped(name: str) -> dict:
    from naflexclip.families.openclip_names import openclip_config

    return openclip_config(name)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (not the init's zeros and ones: a swapped norm or bias must change the outputs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.2)
            if name.endswith("logit_scale"):
                param.fill_(2.0)
            if name.endswith("logit_bias"):
                param.fill_(-3.0)


def openclip_model(name: str, seed: int = 0) -> torch.nn.Module:
    """Random-init open_clip model of the registered name (eval mode, output_dict)."""
    model = open_clip.create_model(name, output_dict=True)
    randomize_(model, seed)
    return model.eval()
