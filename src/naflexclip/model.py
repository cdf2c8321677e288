"""The NaFlex CLIP/SigLIP model: timm NaFlexVit image tower + open_clip TextTransformer text tower.

Both towers are projected to a shared embedding and L2-normalised; `forward(image=..., text=...)`
returns OpenCLIP's output dict (`image_features`, `text_features`, `logit_scale` already exponentiated,
and `logit_bias` for SigLIP), which is all the window and the losses rely on.
CLIP: Radford et al. 2021, https://arxiv.org/abs/2103.00020. SigLIP: Zhai et al. 2023,
https://arxiv.org/abs/2303.15343. NaFlex: Dehghani et al. 2023 (NaViT), https://arxiv.org/abs/2307.06304.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from open_clip.transformer import TextTransformer
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg
from torch import nn

VOCAB_SIZE = 49408  # open_clip's SimpleTokenizer vocabulary (shipped in its wheel)
MAX_LOGIT_SCALE = math.log(100.0)
TEXT_POOL_TYPES = ("argmax", "first", "last", "mean")


@dataclass(frozen=True)
class ImageTowerConfig:
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    global_pool: str = "map"
    pos_embed_grid_size: tuple[int, int] = (16, 16)
    reg_tokens: int = 0
    drop_path_rate: float = 0.0
    proj_drop_rate: float = 0.0
    patch_drop_rate: float = 0.0


@dataclass(frozen=True)
class TextTowerConfig:
    context_length: int = 77
    width: int = 512
    heads: int = 8
    layers: int = 12
    # open_clip's pool types ("argmax": the end-of-text token), or "mean" over the caption's tokens
    pool_type: str = "argmax"
    ls_init_value: float | None = None  # LayerScale on the residual branches (open_clip's name)


@dataclass(frozen=True)
class ModelConfig:
    embed_dim: int = 512
    image: ImageTowerConfig = field(default_factory=ImageTowerConfig)
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    siglip: bool = False


# `tiny`: exactness tests (seconds on a CPU, float64); `small`: the CPU demo; `base`: the real size.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        embed_dim=16,
        image=ImageTowerConfig(patch_size=4, width=32, depth=2, heads=2, global_pool="avg",
                               pos_embed_grid_size=(8, 8)),
        text=TextTowerConfig(context_length=16, width=32, heads=2, layers=2),
    ),
    "small": ModelConfig(
        embed_dim=128,
        # max pooling: with avg the few object tokens are diluted by the background and a supervised shape
        # probe stays at chance (0.13-0.16 after 300 steps with avg or map, 0.63 with max)
        image=ImageTowerConfig(patch_size=16, width=128, depth=4, heads=4, global_pool="max",
                               pos_embed_grid_size=(16, 16)),
        # mean pooling + LayerScale (near-identity blocks at init) keep a bag-of-words path from every word to
        # the output: with EOT pooling, attention learns to read only the colour words within ~50 steps (colour
        # alone matches most pairs) and shape words lose their gradient; zero-shot shape then stays at chance
        text=TextTowerConfig(context_length=32, width=128, heads=4, layers=4, pool_type="mean",
                             ls_init_value=1e-4),
    ),
    "base": ModelConfig(
        embed_dim=512,
        image=ImageTowerConfig(patch_size=16, width=768, depth=12, heads=12, global_pool="map",
                               pos_embed_grid_size=(16, 16), reg_tokens=4),
        text=TextTowerConfig(context_length=77, width=512, heads=8, layers=12),
    ),
}


class NaFlexClip(nn.Module):
    """Dual-encoder contrastive model with a NaFlex ViT image tower.

    Attributes used by data code: `image_patch_size`, `context_length`, `vocab_size`.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        img = config.image
        self.visual = NaFlexVit(
            NaFlexVitCfg(
                patch_size=img.patch_size,
                embed_dim=img.width,
                depth=img.depth,
                num_heads=img.heads,
                global_pool=img.global_pool,
                pos_embed_grid_size=img.pos_embed_grid_size,
                reg_tokens=img.reg_tokens,
                drop_path_rate=img.drop_path_rate,
                proj_drop_rate=img.proj_drop_rate,
                patch_drop_rate=img.patch_drop_rate,
                fc_norm=False,
                # dense [B, C, H, W] inputs whose sides are not multiples of the patch size are padded
                dynamic_img_pad=True,
            ),
            num_classes=0,
        )
        self.image_projection = nn.Linear(img.width, config.embed_dim, bias=False)
        txt = config.text
        if txt.pool_type not in TEXT_POOL_TYPES:
            raise ValueError(f"text pool_type must be one of {TEXT_POOL_TYPES}, got {txt.pool_type!r}")
        self.text = TextTransformer(
            context_length=txt.context_length,
            vocab_size=VOCAB_SIZE,
            width=txt.width,
            heads=txt.heads,
            layers=txt.layers,
            output_dim=config.embed_dim,
            ls_init_value=txt.ls_init_value,
            # "none" returns every token's projection; encode_text averages the caption's own tokens
            pool_type="none" if txt.pool_type == "mean" else txt.pool_type,
        )
        self.text_pool_type = txt.pool_type
        self.image_patch_size = img.patch_size
        self.context_length = txt.context_length
        self.vocab_size = VOCAB_SIZE
        self.siglip = config.siglip
        if config.siglip:
            # SigLIP's initialisation: t' = log 10, b = -10 (Zhai et al. 2023, section 3.2)
            self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
            self.logit_bias = nn.Parameter(torch.tensor(-10.0))
        else:
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
            self.logit_bias = None

    def encode_image(self, image: torch.Tensor | dict[str, torch.Tensor], normalize: bool = True) -> torch.Tensor:
        """image: dense `[B, C, H, W]` or a NaFlex dict (`patches [B, L, P*P*C]`,
        `patch_coord [B, L, 2]`, `patch_valid [B, L]`) → features `[B, embed_dim]`."""
        pooled = self.visual(image)
        features = self.image_projection(pooled)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """text: token ids `[B, T]` → features `[B, embed_dim]`."""
        features = self.text(text)
        if self.text_pool_type == "mean":
            # start, words and end-of-text; not the padding after it
            valid = (text != self.text.pad_id).unsqueeze(-1).to(features.dtype)
            features = (features * valid).sum(dim=1) / valid.sum(dim=1).clamp(min=1)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(
        self,
        image: torch.Tensor | dict[str, torch.Tensor] | None = None,
        text: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {"logit_scale": self.logit_scale.exp()}
        if image is not None:
            out["image_features"] = self.encode_image(image)
        if text is not None:
            out["text_features"] = self.encode_text(text)
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Clamp the temperature to [0, ln 100] (CLIP's rule), called after each optimizer step."""
        self.logit_scale.clamp_(0, MAX_LOGIT_SCALE)


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset `name` with top-level or tower overrides, e.g. `siglip=True`, `drop_path_rate=0.1`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[name]
    image_fields = {f.name for f in dataclasses.fields(ImageTowerConfig)}
    text_fields = {f.name for f in dataclasses.fields(TextTowerConfig)}
    top, image, text = {}, {}, {}
    for key, value in overrides.items():
        if key in ("embed_dim", "siglip"):
            top[key] = value
        elif key in image_fields:
            image[key] = value
        elif key in text_fields:
            text[key] = value
        else:
            raise ValueError(f"unknown model override {key!r} for preset {name!r}")
    return dataclasses.replace(
        config,
        image=dataclasses.replace(config.image, **image),
        text=dataclasses.replace(config.text, **text),
        **top,
    )


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """The architecture as plain types (for checkpoints: loadable with `weights_only=True`)."""
    return dataclasses.asdict(config)


def config_from_dict(values: dict[str, Any]) -> ModelConfig:
    """Inverse of `config_to_dict`."""
    image = dict(values["image"])
    image["pos_embed_grid_size"] = tuple(image["pos_embed_grid_size"])
    return ModelConfig(embed_dim=values["embed_dim"], image=ImageTowerConfig(**image),
                       text=TextTowerConfig(**values["text"]), siglip=values["siglip"])


def weights_mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """Why `state` cannot be loaded into `model` (names or shapes differ), or None when it fits."""
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if not (missing or unexpected or reshaped):
        return None
    first = (missing or unexpected or reshaped)[0]
    return (f"weights do not fit the model ({len(missing)} tensors missing, {len(unexpected)} unexpected, "
            f"{len(reshaped)} of another shape, e.g. {first!r}); was it written by another version of the preset?")


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """`model.load_state_dict(state)`, or one line naming `source` when the tensors do not fit."""
    mismatch = weights_mismatch(model, state)
    if mismatch is not None:
        raise ValueError(f"{source}: {mismatch}")
    model.load_state_dict(state)


def create_model(name: str, **overrides: Any) -> NaFlexClip:
    """Build a preset (`tiny`, `small`, `base`) with optional overrides (`siglip=True`, ...)."""
    return NaFlexClip(model_config(name, **overrides))
