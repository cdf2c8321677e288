"""The `openclip` family: OpenCLIP's model names and checkpoints in, as NaFlex models, and out again.

`build(NAME)` reads the name's config with open_clip (`open_clip.get_model_config`; OpenCLIP main's NaFlex names,
absent from the released package, ship in `openclip_configs/`) and maps it onto our `ModelConfig`:

- image tower: timm `NaFlexVit` in the configuration of the name's ViT. A native OpenCLIP ViT (`VisionTransformer`:
  class token, `ln_pre`, `ln_post`, token or average pooling, bias-free projection, QuickGELU for `-quickgelu`
  names) or a timm ViT trunk (`TimmModel`: SigLIP's MAP-pooled ViTs, the `naflexvit_*` trunks of the NaFlex names).
  The learned position table keeps the native grid (e.g. 14x14 for `ViT-B-16` at 224) and is resampled per image
  grid; at the native grid the tower is the original function.
- text tower: open_clip's own `TextTransformer` with the name's settings; its tokenizer is open_clip's for the name
  (`SimpleTokenizer`), or for names with a Hugging Face tokenizer that tokenizer read from a local directory.
- loss: `siglip` for names with a logit bias (SigLIP, SigLIP 2), starting at their temperature and bias; else `clip`.

Weights (`build(NAME, pretrained=...)`): an `open_clip_train` checkpoint (`{"state_dict": ...}`, `module.`
prefixes), a plain state dict (`.pt`, `.pth`, `.bin`, `.safetensors`), an OpenCLIP pretrained tag or
`hf-hub:org/name`, the last two found only in local caches (`--cache-dir`, the Hugging Face cache, open_clip's
`~/.cache/clip`); nothing downloads. Every tensor goes through the explicit map below, both sides accounted for.
`export` writes the inverse: a state dict `open_clip.create_model(NAME, pretrained=FILE)` loads.
Equality with open_clip's own model is proven by outputs (tests/test_openclip_family.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from naflexclip.data.transform import NaFlexTransform, Processing, collate, tokenize
from naflexclip.model import ImageTowerConfig, ModelConfig, NaFlexClip, TextTowerConfig

NAME = "openclip"
LOSS = "clip"  # the loss of most names; `model_config(name).loss` is the name's own
EXPORT_FORMAT = "openclip"
# the DataConfig.hf_processor of a model built from a name: "open_clip:NAME[:TOKENIZER_DIR]"
PROCESSOR_PREFIX = "open_clip:"
CONFIG_DIR = Path(__file__).with_name("openclip_configs")
# the weight files of a Hugging Face repo of open_clip, safetensors first (as open_clip prefers it)
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
# pretrained tags of the shipped NaFlex names (OpenCLIP main's pretrained.py)
SHIPPED_TAGS: dict[str, dict[str, dict[str, Any]]] = {
    "ViT-B-16-SigLIP2-naflex": {"webli": {"hf_hub": "timm/ViT-B-16-SigLIP2-naflex/", "mean": SIGLIP_MEAN,
                                          "std": SIGLIP_STD, "interpolation": "bicubic"}},
    "ViT-SO400M-16-SigLIP2-naflex": {"webli": {"hf_hub": "timm/ViT-SO400M-16-SigLIP2-naflex/",
                                               "mean": SIGLIP_MEAN, "std": SIGLIP_STD, "interpolation": "bicubic"}},
}
_BLOCK_KEYS = (("ln_1.", "norm1."), ("attn.in_proj_", "attn.qkv."), ("attn.out_proj.", "attn.proj."),
               ("ln_2.", "norm2."), ("mlp.c_fc.", "mlp.fc1."), ("mlp.c_proj.", "mlp.fc2."),
               ("ls_1.gamma", "ls1.gamma"), ("ls_2.gamma", "ls2.gamma"))
_CLIP_TEXT_KEYS = ("transformer.", "token_embedding.", "positional_embedding", "ln_final.", "text_projection")


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
    trunk = _timm_trunk(name, cfg)
    if not isinstance(trunk, (VisionTransformer, NaFlexVit)):
        kind = type(trunk).__name__
        raise _refuse(name, f"its image tower is timm {timm_name!r} ({kind}), not a ViT NaFlexVit can carry")
    naflex = isinstance(trunk, NaFlexVit)
    embeds = trunk.embeds if naflex else trunk
    block = trunk.blocks[0]
    problems = []
    if type(block) is not Block or type(block.attn) is not Attention or type(block.mlp) is not Mlp:
        problems.append(f"its blocks are {type(block).__name__}/{type(block.attn).__name__}/"
                        f"{type(block.mlp).__name__} (plain ViT blocks map)")
    elif not isinstance(block.attn.q_norm, torch.nn.Identity):
        problems.append("its attention normalises q and k")
    pos = getattr(embeds, "pos_embed", None)
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
        grid = tuple(trunk.patch_embed.grid_size) if side * side != pos.shape[1] - prefix else (side, side)
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


def _layout(name: str) -> dict[str, Any]:
    return dict(_model_config_and_layout(name)[1])


# ------------------------------------------------------------------------------------ weight sources


def _hf_cache_dirs(cache_dir: str | None) -> list[Path]:
    """The Hugging Face hub caches to look in: `cache_dir` and the default (HF_HUB_CACHE, HF_HOME/hub)."""
    dirs = [Path(cache_dir).expanduser()] if cache_dir else []
    from huggingface_hub.constants import HF_HUB_CACHE

    dirs.append(Path(HF_HUB_CACHE))
    return dirs


def _from_hf_cache(repo_id: str, filenames: tuple[str, ...], cache_dir: str | None) -> tuple[Path | None, list[str]]:
    """The first of `filenames` of `repo_id` in a local hub cache (its `models--org--name/snapshots/*/` layout);
    and the places looked in."""
    from huggingface_hub import try_to_load_from_cache

    looked = []
    for directory in _hf_cache_dirs(cache_dir):
        looked.append(str(directory / f"models--{repo_id.replace('/', '--')}"))
        for filename in filenames:
            found = try_to_load_from_cache(repo_id, filename, cache_dir=str(directory))
            if isinstance(found, str) and os.path.isfile(found):
                return Path(found), looked
        # a snapshot without refs/ (copied by hand) is still a snapshot
        for filename in filenames:
            matches = sorted((directory / f"models--{repo_id.replace('/', '--')}" / "snapshots").glob(f"*/{filename}"))
            if matches:
                return matches[-1], looked
    return None, looked


def _tag_cfg(name: str, tag: str) -> dict[str, Any]:
    import open_clip

    return dict(open_clip.get_pretrained_cfg(name, tag) or SHIPPED_TAGS.get(name, {}).get(tag) or {})


def resolve_pretrained(name: str, pretrained: str, cache_dir: str | None = None) -> Path:
    """The local file of a `--pretrained` weight source for the name: a file, an OpenCLIP pretrained tag or
    `hf-hub:org/name` found in a local cache (nothing downloads); one-line OpenClipError naming where it looked."""
    path = Path(pretrained).expanduser()
    if path.is_file():
        return path.resolve()
    if pretrained.startswith("hf-hub:"):
        repo_id = pretrained[len("hf-hub:"):].strip("/")
        found, looked = _from_hf_cache(repo_id, WEIGHT_FILES, cache_dir)
        if found is None:
            raise OpenClipError(f"--pretrained {pretrained}: {' or '.join(WEIGHT_FILES)} of {repo_id!r} is not in a "
                                f"local cache (looked in {', '.join(looked)}); nothing is downloaded")
        return found
    cfg = _tag_cfg(name, pretrained)
    if not cfg:
        if path.exists() or os.sep in pretrained or pretrained.startswith("."):
            raise OpenClipError(f"--pretrained {pretrained}: not a file (a checkpoint, .pt, .bin or .safetensors)")
        import open_clip

        tags = open_clip.list_pretrained_tags_by_model(name) or list(SHIPPED_TAGS.get(name, {}))
        raise OpenClipError(f"--pretrained {pretrained!r}: not a file, nor a pretrained tag of {name} "
                            f"(its tags: {', '.join(tags) or 'none'})")
    looked: list[str] = []
    if cfg.get("hf_hub"):
        repo_id, filename = os.path.split(cfg["hf_hub"].rstrip("/") if cfg["hf_hub"].endswith("/") else cfg["hf_hub"])
        if cfg["hf_hub"].endswith("/"):
            repo_id, filenames = cfg["hf_hub"].rstrip("/"), WEIGHT_FILES
        else:
            stem = filename.rsplit(".", 1)[0]
            filenames = (f"{stem}.safetensors", filename) if not filename.endswith(".safetensors") else (filename,)
        found, looked = _from_hf_cache(repo_id, filenames, cache_dir)
        if found is not None:
            return found
        needed = f"{' or '.join(filenames)} of {repo_id!r}"
    if cfg.get("url"):
        filename = os.path.basename(cfg["url"])
        dirs = [Path(cache_dir).expanduser()] if cache_dir else []
        dirs.append(Path("~/.cache/clip").expanduser())  # open_clip's own download folder
        for directory in dirs:
            looked.append(str(directory))
            if (directory / filename).is_file():
                return directory / filename
        needed = filename if not cfg.get("hf_hub") else f"{needed}, or {filename}"
    raise OpenClipError(f"--pretrained {pretrained}: the weights of {name} {pretrained} ({needed}) are not in a local "
                        f"cache (looked in {', '.join(looked)}); put the file there or pass --cache-dir")


def read_state_dict(file: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file: `open_clip_train`'s `{"state_dict": ...}`, a plain state dict (`.pt`,
    `.bin`) or `.safetensors`; the `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes removed."""
    path = Path(file)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except SafetensorError as error:
            raise OpenClipError(f"{str(path)!r} is truncated or damaged ({str(error).strip()})") from None
    else:
        try:  # memory-mapped: the tensors are read from the page cache as they are copied into the model
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            try:  # a file of torch's legacy (non-zip) format cannot be mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as error:  # pickle errors of many kinds: not a state dict we can read
                raise OpenClipError(f"{str(path)!r} is not a readable checkpoint "
                                    f"({str(error).splitlines()[0]})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise OpenClipError(f"{str(path)!r} holds no state dict of tensors")
    out = {}
    for key, value in state.items():
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        out[key] = value
    return out


# ---------------------------------------------------------------------------------------- weight map


def _conv_to_linear(weight: torch.Tensor) -> torch.Tensor:
    """A conv patch embedding `[D, C, P, P]` as NaFlexVit's linear one over (ph, pw, C) patches `[D, P*P*C]`."""
    return weight.permute(0, 2, 3, 1).flatten(1)


def _linear_to_conv(weight: torch.Tensor, patch: int) -> torch.Tensor:
    return weight.reshape(weight.shape[0], patch, patch, -1).permute(0, 3, 1, 2).contiguous()


def _grid_table(pos: torch.Tensor, grid: tuple[int, int], source: str, key: str) -> torch.Tensor:
    """A `[N, D]` or `[1, N, D]` table of the native grid as NaFlexVit's `[1, H, W, D]`."""
    pos = pos.reshape(-1, pos.shape[-1])
    if pos.shape[0] != grid[0] * grid[1]:
        raise OpenClipError(f"{source}: {key!r} has {pos.shape[0]} positions, the name's grid {grid[0]}x{grid[1]} "
                            f"needs {grid[0] * grid[1]}")
    return pos.reshape(1, grid[0], grid[1], pos.shape[-1])


def _import_text(theirs: dict[str, torch.Tensor], custom_text: bool) -> dict[str, torch.Tensor]:
    if custom_text:
        return {key: value for key, value in theirs.items() if key.startswith("text.")}
    return {f"text.{key}": value for key, value in theirs.items() if key.startswith(_CLIP_TEXT_KEYS)}


def import_state_dict(model: NaFlexClip, theirs: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Our state dict from an open_clip state dict of the model's name (every tensor of both sides accounted for)."""
    name = model.config.openclip_name
    layout, img = _layout(name), model.config.image
    ours: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in theirs:
            raise OpenClipError(f"{source}: tensor {key!r} is missing (is it a checkpoint of {name}?)")
        used.add(key)
        return theirs[key]

    for key in ("logit_scale", "logit_bias"):
        if key in theirs:
            ours[key] = take(key).reshape(())
    text = _import_text(theirs, layout["custom_text"])
    used.update(key if layout["custom_text"] else key.removeprefix("text.") for key in text)
    ours.update(text)
    if layout["layout"] == "native":
        pos = take("visual.positional_embedding")
        ours["visual.embeds.cls_token"] = (take("visual.class_embedding") + pos[0]).reshape(1, 1, -1)
        ours["visual.embeds.pos_embed"] = _grid_table(pos[1:], img.pos_embed_grid_size, source,
                                                      "visual.positional_embedding")
        ours["visual.embeds.proj.weight"] = _conv_to_linear(take("visual.conv1.weight"))
        final = "visual.fc_norm" if img.norm_after_pool else "visual.norm"
        for theirs_name, ours_name in (("visual.ln_pre", "visual.norm_pre"), ("visual.ln_post", final)):
            for part in ("weight", "bias"):
                if f"{theirs_name}.{part}" in theirs:
                    ours[f"{ours_name}.{part}"] = take(f"{theirs_name}.{part}")
        ours["image_projection.weight"] = take("visual.proj").T
        prefix = "visual.transformer.resblocks."
        for key in [k for k in theirs if k.startswith(prefix)]:
            index, _, rest = key[len(prefix):].partition(".")
            for old, new in _BLOCK_KEYS:
                if rest.startswith(old):
                    ours[f"visual.blocks.{index}.{new}{rest[len(old):]}"] = take(key)
                    break
    else:
        prefix = "visual.trunk."
        for key in [k for k in theirs if k.startswith(prefix)]:
            rest, value = key[len(prefix):], take(key)
            if layout["layout"] == "naflex":
                ours[f"visual.{rest}"] = value
            elif rest == "pos_embed":
                prefix_tokens = 0 if layout["no_embed_class"] else int(img.class_token) + img.reg_tokens
                if prefix_tokens:  # NaFlexVit adds no position to its prefix tokens: fold theirs into the tokens
                    for token, start, count in (("cls_token", 0, int(img.class_token)),
                                                ("reg_token", int(img.class_token), img.reg_tokens)):
                        if count:
                            ours[f"visual.embeds.{token}"] = take(f"{prefix}{token}") + value[:, start:start + count]
                ours["visual.embeds.pos_embed"] = _grid_table(value[:, prefix_tokens:], img.pos_embed_grid_size,
                                                              source, key)
            elif rest in ("cls_token", "reg_token"):
                ours.setdefault(f"visual.embeds.{rest}", value)
            elif rest.startswith("patch_embed.proj."):
                part = rest.removeprefix("patch_embed.proj.")
                ours[f"visual.embeds.proj.{part}"] = _conv_to_linear(value) if part == "weight" else value
            else:
                ours[f"visual.{rest}"] = value
        if layout["projection"]:
            ours["image_projection.weight"] = take("visual.head.proj.weight")
    unexpected = sorted(set(theirs) - used)
    if unexpected:
        raise OpenClipError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unmapped in all; "
                            f"is it a checkpoint of {name}?)")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise OpenClipError(f"{source}: no tensor for our {missing[0]!r} ({len(missing)} in all; is it a checkpoint "
                            f"of {name}?)")
    for key, value in ours.items():
        if key not in expected:
            raise OpenClipError(f"{source}: tensor for {key!r} does not fit {name}")
        if tuple(value.shape) != tuple(expected[key].shape):
            raise OpenClipError(f"{source}: tensor for {key!r} has shape {tuple(value.shape)}, {name} needs "
                                f"{tuple(expected[key].shape)}")
    return ours


def export_state_dict(model: NaFlexClip) -> dict[str, torch.Tensor]:
    """The open_clip state dict of our model for its name (inverse of `import_state_dict`; the position table at the
    native grid it has)."""
    name = model.config.openclip_name
    if name is None:
        raise OpenClipError("export --format openclip: the model was not built from an OpenCLIP model name (a preset "
                            "or a SigLIP 2 directory); use --format transformers for SigLIP 2")
    ours = {key: value.detach().clone() for key, value in model.state_dict().items()}
    layout, img = _layout(name), model.config.image
    out: dict[str, torch.Tensor] = {}
    for key in ("logit_scale", "logit_bias"):
        if key in ours:
            out[key] = ours.pop(key)
    for key in [k for k in ours if k.startswith("text.")]:
        out[key if layout["custom_text"] else key.removeprefix("text.")] = ours.pop(key)
    if layout["layout"] == "native":
        cls = ours.pop("visual.embeds.cls_token").reshape(-1)
        pos = ours.pop("visual.embeds.pos_embed").reshape(-1, cls.shape[0])
        out["visual.class_embedding"] = cls
        out["visual.positional_embedding"] = torch.cat([torch.zeros_like(cls)[None], pos])  # folded into the token
        out["visual.conv1.weight"] = _linear_to_conv(ours.pop("visual.embeds.proj.weight"), img.patch_size)
        out["visual.proj"] = ours.pop("image_projection.weight").T.contiguous()
        final = "visual.fc_norm" if img.norm_after_pool else "visual.norm"
        for theirs_name, ours_name in (("visual.ln_pre", "visual.norm_pre"), ("visual.ln_post", final)):
            for part in ("weight", "bias"):
                if f"{ours_name}.{part}" in ours:
                    out[f"{theirs_name}.{part}"] = ours.pop(f"{ours_name}.{part}")
        for key in [k for k in ours if k.startswith("visual.blocks.")]:
            index, _, rest = key[len("visual.blocks."):].partition(".")
            for old, new in _BLOCK_KEYS:
                if rest.startswith(new):
                    out[f"visual.transformer.resblocks.{index}.{old}{rest[len(new):]}"] = ours.pop(key)
                    break
    else:
        if layout["projection"]:
            out["visual.head.proj.weight"] = ours.pop("image_projection.weight")
        for key in [k for k in ours if k.startswith("visual.")]:
            rest, value = key[len("visual."):], ours.pop(key)
            if layout["layout"] == "timm":
                if rest == "embeds.pos_embed":
                    value = value.reshape(1, -1, value.shape[-1])
                    if not layout["no_embed_class"]:  # their table has slots for the prefix tokens: zero, folded
                        extra = int(img.class_token) + img.reg_tokens
                        value = torch.cat([value.new_zeros(1, extra, value.shape[-1]), value], dim=1)
                    rest = "pos_embed"
                elif rest in ("embeds.cls_token", "embeds.reg_token"):
                    rest = rest.removeprefix("embeds.")
                elif rest.startswith("embeds.proj."):
                    part = rest.removeprefix("embeds.proj.")
                    value = _linear_to_conv(value, img.patch_size) if part == "weight" else value
                    rest = f"patch_embed.proj.{part}"
            out[f"visual.trunk.{rest}"] = value
    if ours:  # the map must cover the model: a gap here is a bug in the map, not in the model
        raise AssertionError(f"openclip export leaves {sorted(ours)[0]!r} unmapped")
    return {key: value.contiguous() for key, value in out.items()}


# --------------------------------------------------------------------------------------- the family


def build(name: str, pretrained: str | None = None, cache_dir: str | None = None, **overrides: Any) -> NaFlexClip:
    """The NaFlex model of the OpenCLIP name, random init or with the weights of `pretrained` (a file, a tag or
    `hf-hub:org/name` in a local cache); `overrides` that keep the weights (`drop_path_rate=0.1`, ...)."""
    config = model_config(name, **overrides)
    if pretrained is None:
        return NaFlexClip(config)
    if config.loss != model_config(name).loss:
        raise OpenClipError(f"--loss {config.loss}: the weights of {name} are trained with --loss "
                            f"{model_config(name).loss}; drop --loss")
    file = resolve_pretrained(name, pretrained, cache_dir)
    model = _uninitialised(config)
    model.load_state_dict(import_state_dict(model, read_state_dict(file), str(file)))  # strict: every tensor
    return model


def _uninitialised(config: ModelConfig) -> NaFlexClip:
    """The model with uninitialised parameters, for a load that writes every one of them (a ViT-B-16's random init
    takes longer than reading its file); its one non-persistent buffer, the causal text mask, is built."""
    with torch.device("meta"):
        model = NaFlexClip(config)
    model.to_empty(device="cpu")
    persistent = set(model.state_dict())
    others = [key for key, _ in model.named_buffers() if key not in persistent]
    if others not in ([], ["text.attn_mask"]):  # a module whose buffers a load does not restore: initialise it
        return NaFlexClip(config)
    if model.text.attn_mask is not None:
        model.text.attn_mask = model.text.build_causal_mask()
    return model


def check_pretrained(name: str, pretrained: str, cache_dir: str | None = None) -> Path:
    """The local weight file of `pretrained` for the name, read and mapped once (one-line OpenClipError otherwise)."""
    model_config(name)
    file = resolve_pretrained(name, pretrained, cache_dir)
    with torch.device("meta"):
        model = NaFlexClip(model_config(name))
    import_state_dict(model, read_state_dict(file), str(file))
    return file


def detect(path: str | Path) -> bool:
    """True for a processor spec of this family (`open_clip:NAME[:DIR]`); the family has no directories."""
    return isinstance(path, str) and path.startswith(PROCESSOR_PREFIX)


def check(path: str | Path) -> None:
    if not detect(path):
        raise OpenClipError(f"{str(path)!r} is not an OpenCLIP model (pass --model NAME with --pretrained FILE or TAG)")


def load(path: str | Path, **overrides: Any) -> NaFlexClip:
    check(path)
    name, _ = _parse_spec(str(path))
    return build(name, **overrides)


# ---------------------------------------------------------------------------------------- processing


def tokenizer_dir(name: str, pretrained_file: str | Path | None = None, cache_dir: str | None = None) -> str | None:
    """The local directory of the name's Hugging Face tokenizer (None for open_clip's SimpleTokenizer names): beside
    the weight file, or the tokenizer repo in a local hub cache; one-line OpenClipError when it is not there."""
    hf_name = (openclip_config(name) or {}).get("text_cfg", {}).get("hf_tokenizer_name")
    if not hf_name:
        return None
    candidates = [Path(pretrained_file).parent] if pretrained_file is not None else []
    if os.path.isdir(hf_name):
        candidates.append(Path(hf_name))
    for directory in candidates:
        if (directory / "tokenizer.json").is_file() or (directory / "spiece.model").is_file():
            return str(directory)
    found, looked = _from_hf_cache(hf_name, ("tokenizer.json", "spiece.model"), cache_dir)
    if found is not None:
        return str(found.parent)
    looked = [str(c) for c in candidates] + looked
    raise OpenClipError(f"--model {name}: its tokenizer {hf_name!r} (tokenizer.json) is not in a local directory "
                        f"(looked in {', '.join(looked)}); nothing is downloaded")


def processor_spec(name: str, tokenizer_directory: str | None = None) -> str:
    """The `DataConfig.hf_processor` value of a model built from the name."""
    return PROCESSOR_PREFIX + name + (f":{tokenizer_directory}" if tokenizer_directory else "")


def _parse_spec(spec: str) -> tuple[str, str | None]:
    name, _, directory = spec[len(PROCESSOR_PREFIX):].partition(":")
    return name, directory or None


def preprocess_cfg(name: str) -> dict[str, Any]:
    """Mean, std and interpolation of the name's images (its pretrained tags', OpenAI CLIP's without one)."""
    import open_clip

    cfg = {"mean": OPENAI_MEAN, "std": OPENAI_STD, "interpolation": "bicubic"}
    tags = open_clip.list_pretrained_tags_by_model(name) or list(SHIPPED_TAGS.get(name, {}))
    if tags:
        tag_cfg = _tag_cfg(name, tags[0])
        cfg.update({k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in tag_cfg.items() if k in cfg})
    return cfg


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(name: str, directory: str, context_length: int) -> Callable[[list[str]], torch.Tensor]:
    from open_clip.tokenizer import HFTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kwargs = dict((openclip_config(name) or {}).get("text_cfg", {}).get("tokenizer_kwargs") or {})
    return HFTokenizer(directory, context_length=context_length, local_files_only=True, **kwargs)


def _tokenize(name: str, directory: str | None, texts: list[str], context_length: int) -> torch.Tensor:
    if directory is None:
        return tokenize(texts, context_length)  # open_clip's SimpleTokenizer, as open_clip.get_tokenizer(name)
    return _hf_tokenizer(name, directory, context_length)(list(texts)).to(torch.long)


def processing(spec: str, patch_size: int, augment: bool = False) -> Processing:
    """timm's NaFlex patching normalised with the name's mean/std, and the name's tokenizer."""
    name, directory = _parse_spec(spec)
    cfg = preprocess_cfg(name)
    if directory is not None:
        _hf_tokenizer(name, directory, 16)  # checked here, not in a loader worker
    return Processing(NaFlexTransform(patch_size, augment=augment, interpolation=cfg["interpolation"]),
                      functools.partial(collate, mean=cfg["mean"], std=cfg["std"]),
                      functools.partial(_tokenize, name, directory))


def patch_budget(spec: str, patch_size: int) -> int:
    """The patches of the name's native image (its `image_seq_len` for the NaFlex names)."""
    name, _ = _parse_spec(spec)
    seq_len = (openclip_config(name) or {}).get("vision_cfg", {}).get("image_seq_len")
    grid = model_config(name).image.pos_embed_grid_size
    return int(seq_len or grid[0] * grid[1])


# ------------------------------------------------------------------------------------------- export


def export(model: torch.nn.Module, path: str | Path, processor_dir: str | Path | None = None) -> Path:
    """Write `model` as an open_clip state dict file (`.safetensors` by its suffix, else `torch.save`) that
    `open_clip.create_model(NAME, pretrained=FILE)` loads."""
    if not isinstance(model, NaFlexClip):
        raise OpenClipError(f"export needs a NaFlexClip model, got {type(model).__name__}")
    state = export_state_dict(model)
    out = Path(path)
    if out.is_dir():
        raise OpenClipError(f"--out {str(out)!r} is a directory; --format openclip writes one file (e.g. model.pt)")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out), metadata={"format": "pt"})
    else:
        torch.save(state, out)
    return out


def export_notes(path: Path) -> list[str]:
    return ["load it with open_clip.create_model(NAME, pretrained=FILE) (the position table at the native grid)"]
