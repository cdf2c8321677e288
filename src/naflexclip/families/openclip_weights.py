"""The weight map of the `openclip` family: an open_clip state dict of a name as ours (`import_state_dict`, every
tensor of both sides accounted for) and ours as open_clip's (`export_state_dict`, the inverse, which
`open_clip.create_model(NAME, pretrained=FILE)` loads). Equality with open_clip's own model is proven by outputs
(tests/test_openclip_family.py).
"""

from __future__ import annotations

import torch

from naflexclip.families.openclip_names import OpenClipError, weight_layout
from naflexclip.models.naflex_clip import NaFlexClip

_BLOCK_KEYS = (("ln_1.", "norm1."), ("attn.in_proj_", "attn.qkv."), ("attn.out_proj.", "attn.proj."),
               ("ln_2.", "norm2."), ("mlp.c_fc.", "mlp.fc1."), ("mlp.c_proj.", "mlp.fc2."),
               ("ls_1.gamma", "ls1.gamma"), ("ls_2.gamma", "ls2.gamma"))
_CLIP_TEXT_KEYS = ("transformer.", "token_embedding.", "positional_embedding", "ln_final.", "text_projection")


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
    if name is None:
        raise OpenClipError(f"{source}: the model is not an OpenCLIP name's, so open_clip's weights do not map to it")
    layout, img = weight_layout(name), model.config.image
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
    layout, img = weight_layout(name), model.config.image
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

