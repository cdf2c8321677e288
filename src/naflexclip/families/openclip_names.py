"""OpenCLIP model names and their architectures as our `ModelConfig` (the `openclip` family's name map).

A name's open_clip config (`open_clip.get_model_config`; OpenCLIP main's NaFlex names ship in `openclip_configs/`)
maps onto a timm `NaFlexVit` image tower, open_clip's own `TextTransformer` and the `clip` or `siglip` loss; a name
whose towers cannot be NaFlex is refused in one line (`OpenClipError`) saying why. The mapping, part by part:
docs/openclip.md#names.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from naflexclip.models.naflex_clip import ImageTowerConfig, ModelConfig, TextTowerConfig

CONFIG_DIR = Path(__file__).with_name("openclip_configs")


class OpenClipError(ValueError):
    """A name, a weight source or a model that does not map; the message is one line naming the problem."""


# -------------------------------------------------------------------------------------------- names


@functools.lru_cache(maxsize=1)
def _shipped_configs() -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(CONFIG_DIR.glob("*.json"))}


def openclip_config(name: str) -> dict[str, Any] | None:
    """The open_clip model config of `name` (released open_clip's, else a shipped NaFlex name's), or None."""
    import open_clip

    config = open_clip.get_model_config(name) if isinstance(name, str) else None
    if config is None:
        config = _shipped_configs().get(name)
    return json.loads(json.dumps(config)) if config is not None else None  # a copy: callers may edit it


def model_names() -> list[str]:
    """Every name the family claims: the released open_clip's model names and the shipped NaFlex names."""
    import open_clip

    return sorted(set(open_clip.list_models()) | set(_shipped_configs()), key=str.lower)


def claims_name(name: str) -> bool:
    """True when `name` is an OpenCLIP model name (whether or not its towers can be NaFlex: `build` says why not)."""
    return isinstance(name, str) and not os.path.exists(name) and openclip_config(name) is not None


# ------------------------------------------------------------------------------------------- config


def _refuse(name: str, why: str) -> OpenClipError:
    return OpenClipError(f"--model {name}: cannot be a NaFlex model: {why}")


def _activation(name: str, act_kwargs: dict[str, Any] | None, quick_gelu: bool, tower: str) -> str:
    act_kwargs = act_kwargs or {}
    if set(act_kwargs) - {"approximate"}:
        raise _refuse(name, f"{tower} act_kwargs {act_kwargs} (only GELU's approximate maps)")
    if act_kwargs.get("approximate", "none") == "tanh":
        return "gelu_tanh"
    return "quick_gelu" if quick_gelu else "gelu"


def _custom_block(cfg: dict[str, Any]) -> str | None:
    for key in ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc"):
        if cfg.get(key):
            return key
    return None if cfg.get("block_type") in (None, "default") else "block_type"


def _grid(image_size: Any, patch_size: int) -> tuple[int, int]:
    size = tuple(image_size) if isinstance(image_size, (list, tuple)) else (image_size, image_size)
    return size[0] // patch_size, size[1] // patch_size


def _native_image(name: str, cfg: dict[str, Any], quick_gelu: bool) -> tuple[ImageTowerConfig, dict[str, Any]]:
    """A native OpenCLIP `VisionTransformer` as NaFlexVit fields."""
    if cfg.get("attentional_pool"):
        raise _refuse(name, "its image tower pools with an attentional pooler (CoCa)")
    if cfg.get("pos_embed_type", "learnable") != "learnable":
        raise _refuse(name, f"its image position embedding is {cfg['pos_embed_type']!r}, not a learned table")
    if _custom_block(cfg):
        raise _refuse(name, f"its image blocks are custom ({_custom_block(cfg)})")
    pool = cfg.get("pool_type", "tok")
    if pool not in ("tok", "avg"):
        raise _refuse(name, f"image pool_type {pool!r} (token and average pooling map)")
    if set(cfg.get("norm_kwargs") or {}) - {"eps"}:
        raise _refuse(name, f"image norm_kwargs {cfg['norm_kwargs']}")
    width, patch = cfg.get("width", 768), cfg.get("patch_size", 16)
    head_width = cfg.get("head_width", 64)
    if width % head_width:
        raise _refuse(name, f"image width {width} is not a multiple of head_width {head_width}")
    grid = _grid(cfg.get("image_size", 224), patch)
    image = ImageTowerConfig(
        patch_size=patch, width=width, depth=cfg.get("layers", 12), heads=width // head_width,
        global_pool="token" if pool == "tok" else "avg", pos_embed_grid_size=grid,
        mlp_width=int(width * cfg.get("mlp_ratio", 4.0)),
        act=_activation(name, cfg.get("act_kwargs"), quick_gelu, "image"),
        norm_eps=(cfg.get("norm_kwargs") or {}).get("eps", 1e-5), pos_embed_interp_mode="bicubic",
        class_token=True, pre_norm=not cfg.get("no_ln_pre", False), patch_bias=False,
        norm_after_pool=bool(cfg.get("final_ln_after_pool", False)), ls_init_value=cfg.get("ls_init_value"),
    )
    return image, {"layout": "native", "projection": True, "proj_bias": False}


def _timm_trunk(name: str, cfg: dict[str, Any]) -> torch.nn.Module:
    """The timm trunk of a `TimmModel` tower on the meta device (its architecture, no weights)."""
    import timm

    timm_name = cfg["timm_model_name"]
    kwargs = dict(cfg.get("timm_model_kwargs") or {})
    kwargs.pop("use_naflex", None)  # the name's own size is the timm model's (open_clip's TimmModel passes none)
    try:
        with torch.device("meta"):
            return timm.create_model(timm_name, pretrained=False, num_classes=0, **kwargs)
    except Exception as error:  # an unknown timm name or kwargs: open_clip could not build it either
        raise _refuse(name, f"timm could not build {timm_name!r} ({str(error).splitlines()[0]})") from None


def _timm_image(name: str, cfg: dict[str, Any]) -> tuple[ImageTowerConfig, dict[str, Any]]:
    """A timm ViT (classic `VisionTransformer` or `NaFlexVit`) trunk as NaFlexVit fields, read off the module."""
    from timm.layers import AttentionPoolLatent, LayerScale
    from timm.models.naflexvit import NaFlexVit
    from timm.models.vision_transformer import Attention, Block, Mlp, VisionTransformer

    timm_name = cfg["timm_model_name"]
    trunk: Any = _timm_trunk(name, cfg)  # timm's modules: their attributes are read as the architecture
    if not isinstance(trunk, (VisionTransformer, NaFlexVit)):
        kind = type(trunk).__name__
        raise _refuse(name, f"its image tower is timm {timm_name!r} ({kind}), not a ViT NaFlexVit can carry")
    naflex = isinstance(trunk, NaFlexVit)
    embeds: Any = trunk.embeds if naflex else trunk
    block: Any = trunk.blocks[0]
    problems = []
    if type(block) is not Block or type(block.attn) is not Attention or type(block.mlp) is not Mlp:
        problems.append(f"its blocks are {type(block).__name__}/{type(block.attn).__name__}/"
                        f"{type(block.mlp).__name__} (plain ViT blocks map)")
    elif not isinstance(block.attn.q_norm, torch.nn.Identity):
        problems.append("its attention normalises q and k")
    pos: Any = getattr(embeds, "pos_embed", None)
    if pos is None or (naflex and getattr(embeds, "pos_embed_type", "learned") != "learned"):
        problems.append("it has no learned position table (rotary or factorized position embeddings)")
    pool = cfg.get("timm_pool", "avg") if not naflex or cfg.get("timm_pool") else trunk.global_pool
    if pool not in ("avg", "token", "map", "max"):
        problems.append(f"timm_pool {pool!r} (avg, token, map and max map)")
    proj = cfg.get("timm_proj", "linear")
    if proj not in ("linear", "none", None):
        problems.append(f"timm_proj {proj!r} (a linear projection or none)")
    if proj == "linear" and cfg.get("timm_proj_bias"):
        problems.append("a projection with bias")
    if problems:
        raise _refuse(name, f"its image tower timm {timm_name!r}: " + "; ".join(problems))
    patch = embeds.patch_embed.patch_size if not naflex else embeds.patch_size
    patch = patch[0] if isinstance(patch, (tuple, list)) else patch
    if naflex:
        grid = tuple(pos.shape[1:3])
    else:
        prefix = 0 if trunk.no_embed_class else trunk.num_prefix_tokens
        side = math.isqrt(pos.shape[1] - prefix)
        patch_embed: Any = trunk.patch_embed
        grid = tuple(patch_embed.grid_size) if side * side != pos.shape[1] - prefix else (side, side)
    act = type(block.mlp.act).__name__
    acts = {"GELU": "gelu", "GELUTanh": "gelu_tanh", "QuickGELU": "quick_gelu"}
    if act == "GELU" and getattr(block.mlp.act, "approximate", "none") == "tanh":
        act = "GELUTanh"
    if act not in acts:
        raise _refuse(name, f"its image MLP activation {act} (GELU, tanh GELU and QuickGELU map)")
    fc_norm = not isinstance(trunk.fc_norm, torch.nn.Identity)
    attn_pool = getattr(trunk, "attn_pool", None)
    if pool == "map" and not isinstance(attn_pool, AttentionPoolLatent):
        raise _refuse(name, "map pooling without timm's latent attention pool")
    image = ImageTowerConfig(
        patch_size=int(patch), width=trunk.embed_dim, depth=len(trunk.blocks), heads=block.attn.num_heads,
        global_pool=pool, pos_embed_grid_size=(int(grid[0]), int(grid[1])), reg_tokens=int(trunk.num_reg_tokens),
        mlp_width=block.mlp.fc1.out_features, act=acts[act], norm_eps=block.norm1.eps,
        pos_embed_interp_mode=getattr(embeds, "pos_embed_interp_mode", "bicubic"),
        class_token=getattr(embeds, "cls_token", None) is not None,
        pre_norm=not isinstance(trunk.norm_pre, torch.nn.Identity), norm_after_pool=fc_norm,
        ls_init_value=1e-5 if isinstance(block.ls1, LayerScale) else None,
    )
    layout = {"layout": "naflex" if naflex else "timm", "projection": proj == "linear", "proj_bias": False,
              "no_embed_class": getattr(trunk, "no_embed_class", True)}
    return image, layout


def _text(name: str, cfg: dict[str, Any], quick_gelu: bool) -> TextTowerConfig:
    if cfg.get("hf_model_name"):
        raise _refuse(name, f"its text tower is the Hugging Face model {cfg['hf_model_name']!r}, not open_clip's "
                            f"TextTransformer")
    if cfg.get("text_arch", "clip") != "clip":
        raise _refuse(name, f"its text tower is text_arch {cfg['text_arch']!r}")
    if cfg.get("embed_cls"):
        raise _refuse(name, "its text tower has a CLS embedding (CoCa)")
    if _custom_block(cfg):
        raise _refuse(name, f"its text blocks are custom ({_custom_block(cfg)})")
    if cfg.get("final_ln_after_pool"):
        raise _refuse(name, "its text tower normalises after pooling")
    if cfg.get("proj_type", "linear") != "linear":
        raise _refuse(name, f"text proj_type {cfg['proj_type']!r}")
    pool = cfg.get("pool_type", "argmax")
    if pool not in ("argmax", "first", "last"):
        raise _refuse(name, f"text pool_type {pool!r} (argmax, first and last map)")
    if set(cfg.get("norm_kwargs") or {}) - {"eps"}:
        raise _refuse(name, f"text norm_kwargs {cfg['norm_kwargs']}")
    width = cfg.get("width", 512)
    return TextTowerConfig(
        context_length=cfg.get("context_length", 77), width=width, heads=cfg.get("heads", 8),
        layers=cfg.get("layers", 12), pool_type=pool, ls_init_value=cfg.get("ls_init_value"),
        vocab_size=cfg.get("vocab_size", 49408), mlp_width=int(width * cfg.get("mlp_ratio", 4.0)),
        act=_activation(name, cfg.get("act_kwargs"), quick_gelu, "text"),
        norm_eps=(cfg.get("norm_kwargs") or {}).get("eps", 1e-5), causal_mask=not cfg.get("no_causal_mask", False),
        proj_bias=bool(cfg.get("proj_bias", False)), pad_id=cfg.get("pad_id", 0),
    )


def _refuse_unsupported(name: str, config: dict[str, Any]) -> None:
    vision = config.get("vision_cfg") or {}
    if config.get("multimodal_cfg"):
        raise _refuse(name, "it is a captioning model (CoCa: a multimodal text decoder)")
    if isinstance(vision.get("layers"), (list, tuple)):
        raise _refuse(name, "its image tower is a ModifiedResNet (convolutional)")
    if vision.get("timm_model_name") and not vision["timm_model_name"].startswith(("vit", "naflexvit")):
        raise _refuse(name, f"its image tower is timm {vision['timm_model_name']!r}, not a ViT")
    if config.get("nonscalar_logit_scale"):
        raise _refuse(name, "a non-scalar logit scale")


@functools.lru_cache(maxsize=64)
def _model_config_and_layout(name: str) -> tuple[ModelConfig, tuple[tuple[str, Any], ...]]:
    config = openclip_config(name)
    if config is None:
        raise OpenClipError(f"--model: {name!r} is not an OpenCLIP model name")
    _refuse_unsupported(name, config)
    vision, text_cfg = config["vision_cfg"], config["text_cfg"]
    quick_gelu = bool(config.get("quick_gelu", False))
    if vision.get("timm_model_name"):
        image, layout = _timm_image(name, vision)
    else:
        image, layout = _native_image(name, vision, quick_gelu)
    layout["custom_text"] = bool(config.get("custom_text", False))
    embed_dim = config["embed_dim"]
    if not layout["projection"] and image.width != embed_dim:
        raise _refuse(name, f"no image projection but width {image.width} != embed_dim {embed_dim}")
    siglip = config.get("init_logit_bias") is not None
    model = ModelConfig(
        embed_dim=embed_dim, image=image, text=_text(name, text_cfg, quick_gelu),
        loss="siglip" if siglip else "clip", image_projection=layout["projection"],
        # an imported SigLIP temperature may exceed 100: a clamp would change the model at its first step
        max_logit_scale=None if siglip else math.log(100.0),
        init_logit_scale=float(config.get("init_logit_scale", math.log(1 / 0.07))),
        init_logit_bias=config.get("init_logit_bias"),
        openclip_name=name,
    )
    return model, tuple(sorted(layout.items()))


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """Our `ModelConfig` for the OpenCLIP name (one-line OpenClipError when its towers cannot be NaFlex), with tower
    overrides that keep the weights (`drop_path_rate=0.1`, ...) or another `loss`."""
    config = _model_config_and_layout(name)[0]
    if not overrides:
        return config
    image_fields = {f.name for f in dataclasses.fields(ImageTowerConfig)}
    text_fields = {f.name for f in dataclasses.fields(TextTowerConfig)}
    image = {k: v for k, v in overrides.items() if k in image_fields}
    text = {k: v for k, v in overrides.items() if k in text_fields and k not in image_fields}
    top = {k: v for k, v in overrides.items() if k == "loss"}
    unknown = sorted(set(overrides) - set(image) - set(text) - set(top))
    if unknown:
        raise OpenClipError(f"--model {name}: override {unknown[0]!r} does not apply to an OpenCLIP model")
    if top.get("loss", config.loss) != config.loss:
        # another loss from scratch: its own start (and a bias only under siglip)
        top.update(init_logit_scale=None, init_logit_bias=None,
                   max_logit_scale=None if top["loss"] == "siglip" else math.log(100.0))
    return dataclasses.replace(config, image=dataclasses.replace(config.image, **image),
                               text=dataclasses.replace(config.text, **text), **top)


def weight_layout(name: str) -> dict[str, Any]:
    """How the name's weights are laid out (`layout`: native, timm or naflex; `projection`, `custom_text`, ...), for
    the weight map."""
    return dict(_model_config_and_layout(name)[1])

