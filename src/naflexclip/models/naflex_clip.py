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
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from open_clip.transformer import LayerNorm as OpenClipLayerNorm
from open_clip.transformer import QuickGELU, TextTransformer
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg
from torch import nn

from naflexclip.loss import loss_choice
from naflexclip.models import lock

VOCAB_SIZE = 49408  # open_clip's SimpleTokenizer vocabulary (shipped in its wheel)
MAX_LOGIT_SCALE = math.log(100.0)
TEXT_POOL_TYPES = ("argmax", "first", "last", "mean")
# "gelu_tanh": GELU with the tanh approximation (SigLIP 2's); "quick_gelu": x * sigmoid(1.702 x) (OpenAI CLIP's)
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")
# where an objective attaches the module it trains beside the towers (`NaFlexClip.attach_head`): the attribute, the
# state-dict prefix and the `ModelConfig` field of its config (the LocCa decoder, the self-distillation heads)
HEAD_SLOTS = ("decoder", "self_distill")


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
    # SigLIP 2 needs the fields below (defaults keep the original presets): MLP width (None: 4 x width),
    # activation, LayerNorm epsilon, how the learned position table is resized to each image's grid
    mlp_width: int | None = None
    act: str = "gelu"
    norm_eps: float = 1e-6
    pos_embed_interp_mode: str = "bicubic"
    # OpenCLIP's ViTs need the fields below (defaults keep the other models): a class token (pooled by
    # global_pool "token"), a LayerNorm before the blocks (`ln_pre`; then the patch embedding has no bias), the
    # final LayerNorm after pooling instead of before it (`final_ln_after_pool`), LayerScale on the blocks
    class_token: bool = False
    pre_norm: bool = False
    norm_after_pool: bool = False
    ls_init_value: float | None = None
    # timm's PatchEmbedInterpolator: patches of another size ([B, N, Ph, Pw, C]) resample the patch embedding's
    # weights to it (OpenCLIP's --naflex-patch-sizes); off, the embedding takes patch_size patches only
    patch_interpolator: bool = False
    patch_bias: bool | None = None  # None: timm's rule, a bias unless pre_norm (OpenCLIP's conv1 never has one)


@dataclass(frozen=True)
class TextTowerConfig:
    context_length: int = 77
    width: int = 512
    heads: int = 8
    layers: int = 12
    # open_clip's pool types ("argmax": the end-of-text token), or "mean" over the caption's tokens
    pool_type: str = "argmax"
    ls_init_value: float | None = None  # LayerScale on the residual branches (open_clip's name)
    # SigLIP 2 needs the fields below (defaults keep the original presets)
    vocab_size: int = VOCAB_SIZE
    mlp_width: int | None = None  # None: 4 x width
    act: str = "gelu"
    norm_eps: float = 1e-5
    causal_mask: bool = True
    proj_bias: bool = False
    pad_id: int = 0


@dataclass(frozen=True)
class ModelConfig:
    embed_dim: int = 512
    image: ImageTowerConfig = field(default_factory=ImageTowerConfig)
    text: TextTowerConfig = field(default_factory=TextTowerConfig)
    # the contrastive loss it is trained with (a name of naflexclip.loss.LOSSES): it decides whether the model has
    # a logit_bias and where the temperature starts
    loss: str = "clip"
    # False: the image tower's pooled output is the embedding (SigLIP 2: its MAP head is width embed_dim)
    image_projection: bool = True
    # upper clamp of log(logit_scale) after each step (CLIP's ln 100); None: unclamped (SigLIP 2's learned
    # temperature exceeds 100, a clamp would change an imported model at its first step)
    max_logit_scale: float | None = MAX_LOGIT_SCALE
    # where the temperature (log) and bias start; None: the loss's own start (`naflexclip.loss.LOSSES`)
    init_logit_scale: float | None = None
    init_logit_bias: float | None = None
    # the OpenCLIP model name this architecture is (`naflexclip.families.openclip`; export --format openclip)
    openclip_name: str | None = None
    # the configs of the heads objectives attach (`HEAD_SLOTS`; a frozen dataclass of the objective, or its dict as a
    # checkpoint saved it): SigLIP 2's LocCa decoder (`naflexclip.objectives.locca_decoder`), its self-distillation
    # heads and mask token (`naflexclip.objectives.self_distillation`); trained beside the pair loss, dropped at
    # export; None: none
    decoder: Any = None
    self_distill: Any = None


def _text_activation(act: str) -> Any:
    """open_clip's activation class for the text tower's MLPs."""
    if act == "gelu_tanh":
        return partial(nn.GELU, approximate="tanh")
    return QuickGELU if act == "quick_gelu" else nn.GELU


def _mlp_ratio(width: int, mlp_width: int | None) -> float:
    """The ratio timm/open_clip turn back into `int(width * ratio) == mlp_width` (half a unit of margin)."""
    return 4.0 if mlp_width is None else (mlp_width + 0.5) / width


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


def siglip2_config(*, width: int, depth: int, heads: int, mlp_width: int, patch_size: int = 16,
                   pos_grid: int = 16, vocab_size: int = 256000, context_length: int = 64,
                   text_width: int | None = None, text_layers: int | None = None, text_heads: int | None = None,
                   text_mlp_width: int | None = None, norm_eps: float = 1e-6, pad_id: int = 0) -> ModelConfig:
    """The SigLIP 2 NaFlex architecture (transformers' `Siglip2Model`) in our terms: MAP-pooled NaFlexVit whose
    pooled output is the embedding, bilinear position-table resize; bidirectional text tower pooled at the last
    token with a biased projection; GELU-tanh, SigLIP loss (Tschannen et al. 2025, https://arxiv.org/abs/2502.14786)."""
    return ModelConfig(
        embed_dim=width,
        image=ImageTowerConfig(patch_size=patch_size, width=width, depth=depth, heads=heads, global_pool="map",
                               pos_embed_grid_size=(pos_grid, pos_grid), mlp_width=mlp_width, act="gelu_tanh",
                               norm_eps=norm_eps, pos_embed_interp_mode="bilinear"),
        text=TextTowerConfig(context_length=context_length, width=text_width or width, heads=text_heads or heads,
                             layers=text_layers or depth, pool_type="last", vocab_size=vocab_size,
                             mlp_width=text_mlp_width or mlp_width, act="gelu_tanh", norm_eps=norm_eps,
                             causal_mask=False, proj_bias=True, pad_id=pad_id),
        loss="siglip",
        image_projection=False,
        max_logit_scale=None,
    )


# the published SigLIP 2 NaFlex architectures (google/siglip2-{base,so400m}-patch16-naflex), for training from scratch
PRESETS["siglip2-base"] = siglip2_config(width=768, depth=12, heads=12, mlp_width=3072)
PRESETS["siglip2-so400m"] = siglip2_config(width=1152, depth=27, heads=16, mlp_width=4304)


class NaFlexClip(nn.Module):
    """Dual-encoder contrastive model with a NaFlex ViT image tower.

    Attributes used by data code: `image_patch_size`, `context_length`, `vocab_size`.
    """

    source_dir: str | None = None  # a pretrained directory's model: where its tokenizer and processor files are

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
                mlp_ratio=_mlp_ratio(img.width, img.mlp_width),
                act_layer=img.act,
                pos_embed_interp_mode=img.pos_embed_interp_mode,
                class_token=img.class_token,
                pre_norm=img.pre_norm,
                final_norm=True,
                fc_norm=img.norm_after_pool,
                init_values=img.ls_init_value,
                enable_patch_interpolator=img.patch_interpolator,
                # dense [B, C, H, W] inputs whose sides are not multiples of the patch size are padded
                dynamic_img_pad=True,
            ),
            num_classes=0,
        )
        proj = self.visual.embeds.proj
        if img.patch_bias is not None and (proj.bias is not None) != img.patch_bias:
            self.visual.embeds.proj = nn.Linear(proj.in_features, proj.out_features, bias=img.patch_bias)
        for module in self.visual.modules():  # timm builds its LayerNorms with eps 1e-6; a config may differ
            if isinstance(module, nn.LayerNorm):
                module.eps = img.norm_eps
        if config.image_projection:
            self.image_projection: nn.Module = nn.Linear(img.width, config.embed_dim, bias=False)
        elif img.width != config.embed_dim:
            raise ValueError(f"without an image projection embed_dim must equal the image width {img.width}, "
                             f"got {config.embed_dim}")
        else:
            self.image_projection = nn.Identity()
        txt = config.text
        if txt.pool_type not in TEXT_POOL_TYPES:
            raise ValueError(f"text pool_type must be one of {TEXT_POOL_TYPES}, got {txt.pool_type!r}")
        for tower, act in (("image", img.act), ("text", txt.act)):
            if act not in ACTIVATIONS:
                raise ValueError(f"{tower} act must be one of {ACTIVATIONS}, got {act!r}")
        self.text = TextTransformer(
            context_length=txt.context_length,
            vocab_size=txt.vocab_size,
            width=txt.width,
            heads=txt.heads,
            layers=txt.layers,
            mlp_ratio=_mlp_ratio(txt.width, txt.mlp_width),
            output_dim=config.embed_dim,
            ls_init_value=txt.ls_init_value,
            no_causal_mask=not txt.causal_mask,
            pad_id=txt.pad_id,
            # "none" returns every token's projection; encode_text averages the caption's own tokens
            pool_type="none" if txt.pool_type == "mean" else txt.pool_type,
            proj_bias=txt.proj_bias,
            act_layer=_text_activation(txt.act),
            norm_layer=partial(OpenClipLayerNorm, eps=txt.norm_eps),
        )
        self.text_pool_type = txt.pool_type
        self.image_patch_size = img.patch_size
        self.context_length = txt.context_length
        self.vocab_size = txt.vocab_size
        start = loss_choice(config.loss)
        init_scale = start.init_logit_scale if config.init_logit_scale is None else config.init_logit_scale
        self.logit_scale = nn.Parameter(torch.tensor(float(init_scale)))
        init_bias = start.init_logit_bias
        if init_bias is not None and config.init_logit_bias is not None:
            init_bias = config.init_logit_bias
        self.logit_bias = None if init_bias is None else nn.Parameter(torch.tensor(float(init_bias)))
        # an objective attaches its module here (`attach_head`); a saved head's weights wait for it (`load_weights`)
        self.decoder: nn.Module | None = None
        self.self_distill: nn.Module | None = None
        self.pending_heads: dict[str, dict[str, torch.Tensor]] = {}

    def encode_image(self, image: torch.Tensor | dict[str, torch.Tensor], normalize: bool = True) -> torch.Tensor:
        """image: dense `[B, C, H, W]` or a NaFlex dict (`patches [B, L, P*P*C]`,
        `patch_coord [B, L, 2]`, `patch_valid [B, L]`) → features `[B, embed_dim]`."""
        pooled = self.visual(image)
        features = self.image_projection(pooled)
        return F.normalize(features, dim=-1) if normalize else features

    def attach_head(self, slot: str, module: nn.Module, config: Any) -> nn.Module:
        """Attach the module an objective trains beside the towers as the child `slot` (`HEAD_SLOTS`: DDP, FSDP2, the
        optimizer and checkpoints see it as part of the model), on the model's device and dtype, with the weights a
        loaded checkpoint held for it if any; the config records `config` (the objective's)."""
        if slot not in HEAD_SLOTS:
            raise ValueError(f"unknown head slot {slot!r}; choose one of {HEAD_SLOTS}")
        reference = self.logit_scale
        module = module.to(reference.device, reference.dtype)
        saved = self.pending_heads.pop(slot, None)
        if saved is not None:
            module.load_state_dict(saved)
        setattr(self, slot, module)
        self.config = dataclasses.replace(self.config, **{slot: config})
        return module

    def encode_image_tokens(self, image: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward of the image tower (a NaFlex dict) giving both its normalised features `[B, embed_dim]` and its
        un-pooled tokens `[B, prefix + L, width]` with their validity `[B, prefix + L]` (what a decoder reads): the
        same computation as `encode_image`, which timm's `NaFlexVit.forward` splits the same way."""
        visual: Any = self.visual  # timm's NaFlexVit: a dict of tokens and validity for NaFlex inputs
        tokens = visual.forward_features(image["patches"], patch_coord=image["patch_coord"],
                                         patch_valid=image["patch_valid"], attn_mask=image.get("attn_mask"))
        valid = tokens["patch_valid"]
        pooled = self.visual.forward_head(tokens["patches"], patch_valid=valid)
        features = F.normalize(self.image_projection(pooled), dim=-1)
        prefix = tokens["patches"].shape[1] - valid.shape[1]
        valid = torch.cat([valid.new_ones(valid.shape[0], prefix), valid], dim=1)
        return features, tokens["patches"], valid

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
        output_tokens: bool = False,
    ) -> dict[str, Any]:
        """OpenCLIP's output dict for the inputs given; with `output_tokens` (a NaFlex image) also the image tower's
        un-pooled tokens `image_tokens` `[B, prefix + L, width]` and their validity `image_tokens_valid` (what an
        objective's head reads, e.g. a decoder), from the same forward."""
        out: dict[str, Any] = {"logit_scale": self.logit_scale.exp()}
        if image is not None and output_tokens:
            if not isinstance(image, dict):
                raise ValueError("output_tokens needs a NaFlex image (a dict of patches, patch_coord, patch_valid)")
            out["image_features"], out["image_tokens"], out["image_tokens_valid"] = self.encode_image_tokens(image)
        elif image is not None:
            out["image_features"] = self.encode_image(image)
        if text is not None:
            out["text_features"] = self.encode_text(text)
        if self.logit_bias is not None:
            out["logit_bias"] = self.logit_bias
        return out

    def sharding_units(self) -> list[nn.Module]:
        """The modules a sharded wrapper (FSDP2) gathers one at a time: every transformer block of both towers, then
        those of the attached heads that name theirs (`sharding_units()`)."""
        heads = [getattr(self, slot) for slot in HEAD_SLOTS]
        head_units = [unit for head in heads if callable(getattr(head, "sharding_units", None))
                      for unit in head.sharding_units()]
        return [*self.visual.blocks, *self.text.transformer.resblocks, *head_units]

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each transformer block's activations in backward instead of keeping them (both towers).

        timm and open_clip checkpoint with `torch.utils.checkpoint(use_reentrant=False)`, which keeps its
        default `preserve_rng_state=True`: the recomputation draws the dropout / drop-path numbers of the
        forward it replaces, so the window stays exact with stochastic layers on.
        """
        self.visual.set_grad_checkpointing(enable)
        self.text.set_grad_checkpointing(enable)

    def compile_towers(self, *, dynamic: bool | None = True, backend: str = "inductor") -> None:
        """`torch.compile` the towers in place (parameter names unchanged): every block of the image tower
        and its attention pool, and the whole text tower.

        The image tower's embedding stays eager: timm resamples the position table once per distinct
        image grid in a Python loop over `.item()` values, which would recompile for every new set of
        grids. `dynamic=True` traces batch size and sequence length symbolically from the first call,
        so the token-budget schedule's varying shapes reuse one graph per grad mode (no-grad cache
        forward, grad forward); only a microbatch of one row gets its own (torch specialises sizes 0/1).
        """
        for block in self.visual.blocks:
            block.compile(dynamic=dynamic, backend=backend)
        if self.visual.attn_pool is not None:
            self.visual.attn_pool.compile(dynamic=dynamic, backend=backend)
        self.text.compile(dynamic=dynamic, backend=backend)

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Clamp the temperature to [0, ln 100] (CLIP's rule; no upper bound for SigLIP 2), after each step; a
        locked (`requires_grad` False) temperature is left as it is."""
        if self.logit_scale.requires_grad:
            self.logit_scale.clamp_(0, self.config.max_logit_scale)

    def lock_image_tower(self, unlocked_groups: int = 0) -> None:
        """LiT: lock the image tower but its last `unlocked_groups` layer groups (OpenCLIP's method;
        `naflexclip.models.lock`).
        Call it before DDP/FSDP wrap the model and before the optimizer is built."""
        lock.lock_image_tower(self, unlocked_groups)

    def lock_text_tower(self, unlocked_layers: int = 0, freeze_layer_norm: bool = True) -> None:
        """Lock the text tower but its last `unlocked_layers` layer groups; `freeze_layer_norm=False` leaves the locked
        groups' LayerNorms trainable (OpenCLIP's method; `naflexclip.models.lock`)."""
        lock.lock_text_tower(self, unlocked_layers, freeze_layer_norm)

    def locked_towers(self) -> frozenset[str]:
        """The towers (`image`, `text`) none of whose parameters trains: the window computes their features once
        per microbatch without gradient, never replayed."""
        return lock.locked_towers(self)

    def train(self, mode: bool = True) -> NaFlexClip:
        """As `nn.Module.train`, except that a fully locked tower stays in eval mode: a fixed function, whose
        features are those evaluation sees (no dropout, drop-path or patch dropout)."""
        super().train(mode)
        if mode:
            towers = lock.tower_modules(self)
            for name in self.locked_towers():
                for module in towers[name]:
                    module.eval()
        return self


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset `name` with top-level or tower overrides, e.g. `loss="siglip"`, `drop_path_rate=0.1`."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[name]
    image_fields = {f.name for f in dataclasses.fields(ImageTowerConfig)}
    text_fields = {f.name for f in dataclasses.fields(TextTowerConfig)}
    top, image, text = {}, {}, {}
    for key, value in overrides.items():
        if key in ("embed_dim", "loss"):
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
    """Inverse of `config_to_dict` (fields added later take their defaults when absent)."""
    values = dict(values)
    image = dict(values.pop("image"))
    image["pos_embed_grid_size"] = tuple(image["pos_embed_grid_size"])
    # a head's config stays the dict it was saved as: the objective that attaches the head reads it
    return ModelConfig(image=ImageTowerConfig(**image), text=TextTowerConfig(**values.pop("text")), **values)


def _waiting_heads(model: nn.Module) -> tuple[str, ...]:
    """The head slots whose config the model records but whose module no objective has attached yet."""
    config = getattr(model, "config", None)
    return tuple(slot for slot in HEAD_SLOTS if isinstance(config, ModelConfig) and getattr(config, slot) is not None
                 and getattr(model, slot, None) is None)


def _split_heads(model: nn.Module, state: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """`state` without the weights of heads waiting for their objective, and those weights by slot."""
    waiting = _waiting_heads(model)
    heads: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for key, value in state.items():
        slot, _, name = key.partition(".")
        if slot in waiting:
            heads.setdefault(slot, {})[name] = value
        else:
            rest[key] = value
    return rest, heads


def weights_mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """Why `state` cannot be loaded into `model` (names or shapes differ), or None when it fits (the weights of a
    head the model's config records but no objective has attached yet wait for it)."""
    state, _ = _split_heads(model, state)
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if not (missing or unexpected or reshaped):
        return None
    first = (missing or unexpected or reshaped)[0]
    shapes = (f" {tuple(state[first].shape)} in the checkpoint, {expected[first]} in the model"
              if not (missing or unexpected) else "")
    return (f"weights do not fit the model ({len(missing)} tensors missing, {len(unexpected)} unexpected, "
            f"{len(reshaped)} of another shape, e.g. {first!r}{shapes}); was it written by another version of the "
            f"preset?")


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """`model.load_state_dict(state)`, or one line naming `source` when the tensors do not fit; a head's weights
    wait in `model.pending_heads` for the objective that attaches it."""
    mismatch = weights_mismatch(model, state)
    if mismatch is not None:
        raise ValueError(f"{source}: {mismatch}")
    state, heads = _split_heads(model, state)
    model.load_state_dict(state)
    if heads and isinstance(model, NaFlexClip):  # the objective that attaches the head loads them (`attach_head`)
        model.pending_heads.update(heads)
