"""The `siglip2` family: a transformers `Siglip2Model` checkpoint directory in (`load`), and out again (`export`).

Our architecture is built from the directory's `config.json` and every tensor goes through the explicit weight
map below, both ways; equality is proven by outputs (tests/test_siglip2.py). `naflex_to_transformers` maps a NaFlex
dict onto transformers' image inputs. Its data processing is `siglip2_processing`: docs/siglip2.md.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from naflexclip.families.siglip2_processing import patch_budget as patch_budget  # the family's data processing
from naflexclip.families.siglip2_processing import processing as processing
from naflexclip.families.siglip2_processing import write_training_tokenizer_config
from naflexclip.models.naflex_clip import ModelConfig, NaFlexClip, siglip2_config

NAME = "siglip2"
LOSS = "siglip"  # trained with the sigmoid loss (its logit_bias)
EXPORT_FORMAT = "transformers"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# files a transformers SigLIP 2 directory carries besides config and weights; copied on export when present
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "preprocessor_config.json", "processor_config.json")
HIDDEN_ACT = "gelu_pytorch_tanh"  # transformers' name for GELU with the tanh approximation


class Siglip2Error(ValueError):
    """A checkpoint directory or a model that does not map; the message is one line naming the problem."""


# ------------------------------------------------------------------------------------------- config


def _require(config: dict[str, Any], key: str, where: str) -> Any:
    if key not in config:
        raise Siglip2Error(f"{where}: config.json has no {key!r}")
    return config[key]


def read_config(path: str | Path) -> dict[str, Any]:
    """The `config.json` of a SigLIP 2 checkpoint directory (error when it is not one)."""
    directory = Path(path)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise Siglip2Error(f"{str(directory)!r} has no {CONFIG_FILE}: not a transformers checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise Siglip2Error(f"{str(config_path)!r} is not valid JSON ({error.msg} at line {error.lineno})") from None
    model_type = config.get("model_type")
    if model_type != "siglip2":
        raise Siglip2Error(f"{str(config_path)!r}: model_type is {model_type!r}, expected 'siglip2' (SigLIP 2 NaFlex)")
    return config


def config_from_transformers(config: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Our `ModelConfig` for a transformers `Siglip2Config` dict (any sizes)."""
    vision = dict(_require(config, "vision_config", where) or {})
    text = dict(_require(config, "text_config", where) or {})
    # transformers' defaults for keys a config may omit (Siglip2VisionConfig / Siglip2TextConfig)
    vision = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_channels": 3, "patch_size": 16, "hidden_act": HIDDEN_ACT, "layer_norm_eps": 1e-6,
              "vision_use_head": True, "num_patches": 256, **vision}
    text = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "max_position_embeddings": 64, "hidden_act": HIDDEN_ACT,
            "layer_norm_eps": 1e-6, "pad_token_id": 1, **text}
    projection = text.get("projection_size") or text["hidden_size"]
    problems = []
    for tower, values in (("vision", vision), ("text", text)):
        if values["hidden_act"] != HIDDEN_ACT:
            problems.append(f"{tower}_config.hidden_act {values['hidden_act']!r} (only {HIDDEN_ACT!r} maps)")
    if not vision["vision_use_head"]:
        problems.append("vision_config.vision_use_head false (the image embedding is the MAP head's output)")
    if vision["num_channels"] != 3:
        problems.append(f"vision_config.num_channels {vision['num_channels']} (RGB only)")
    grid = round(vision["num_patches"] ** 0.5)
    if grid * grid != vision["num_patches"]:
        problems.append(f"vision_config.num_patches {vision['num_patches']} (not a square grid)")
    if projection != vision["hidden_size"]:
        problems.append(f"text_config.projection_size {projection} != vision_config.hidden_size "
                        f"{vision['hidden_size']} (the two embeddings must have one width)")
    if vision["layer_norm_eps"] != text["layer_norm_eps"]:
        problems.append("vision and text layer_norm_eps differ")
    if problems:
        raise Siglip2Error(f"{where}: cannot build SigLIP 2: " + "; ".join(problems))
    patch = vision["patch_size"]
    if isinstance(patch, (list, tuple)):
        if len(set(patch)) != 1:
            raise Siglip2Error(f"{where}: vision_config.patch_size {patch} is not square")
        patch = patch[0]
    pad_id = text["pad_token_id"] if isinstance(text["pad_token_id"], int) else 0
    return siglip2_config(
        width=vision["hidden_size"], depth=vision["num_hidden_layers"], heads=vision["num_attention_heads"],
        mlp_width=vision["intermediate_size"], patch_size=int(patch), pos_grid=grid, vocab_size=text["vocab_size"],
        context_length=text["max_position_embeddings"], text_width=text["hidden_size"],
        text_layers=text["num_hidden_layers"], text_heads=text["num_attention_heads"],
        text_mlp_width=text["intermediate_size"], norm_eps=vision["layer_norm_eps"], pad_id=pad_id,
    )


def mapping_problems(config: ModelConfig, has_logit_bias: bool = True) -> list[str]:
    """What keeps `config` from being a transformers `Siglip2Model` (empty when it maps)."""
    img, txt = config.image, config.text
    checks = [
        (img.global_pool == "map", f"image pooling {img.global_pool!r} (SigLIP 2 pools with a MAP head)"),
        (img.reg_tokens == 0, f"{img.reg_tokens} register tokens (SigLIP 2 has none)"),
        (img.pos_embed_grid_size[0] == img.pos_embed_grid_size[1],
         f"position table {img.pos_embed_grid_size} (SigLIP 2's is square)"),
        (img.pos_embed_interp_mode == "bilinear",
         f"position-table resize {img.pos_embed_interp_mode!r} (SigLIP 2 resizes bilinearly)"),
        (not config.image_projection, "an image projection (SigLIP 2's image embedding is the MAP head output)"),
        (config.embed_dim == img.width, f"embed_dim {config.embed_dim} != image width {img.width}"),
        (txt.pool_type == "last", f"text pooling {txt.pool_type!r} (SigLIP 2 pools the last token)"),
        (not txt.causal_mask, "a causal text mask (SigLIP 2's text attention is bidirectional)"),
        (txt.proj_bias, "a text projection without bias (SigLIP 2's has one)"),
        (txt.ls_init_value is None, "text LayerScale (SigLIP 2 has none)"),
        (img.act == "gelu_tanh" and txt.act == "gelu_tanh", "exact GELU (SigLIP 2 uses the tanh approximation)"),
        (img.norm_eps == txt.norm_eps, "different LayerNorm eps in the two towers"),
        (has_logit_bias, "no logit_bias (a CLIP-loss model; SigLIP 2 is trained with the sigmoid loss)"),
    ]
    return [problem for ok, problem in checks if not ok]


def config_to_transformers(config: ModelConfig) -> dict[str, Any]:
    """The transformers `Siglip2Config` dict of a mappable `config` (inverse of `config_from_transformers`)."""
    img, txt = config.image, config.text
    return {
        "architectures": ["Siglip2Model"],
        "model_type": "siglip2",
        "initializer_factor": 1.0,
        "text_config": {
            "model_type": "siglip2_text_model", "vocab_size": txt.vocab_size, "hidden_size": txt.width,
            "intermediate_size": txt.mlp_width or 4 * txt.width, "num_hidden_layers": txt.layers,
            "num_attention_heads": txt.heads, "max_position_embeddings": txt.context_length,
            "hidden_act": HIDDEN_ACT, "layer_norm_eps": txt.norm_eps, "attention_dropout": 0.0,
            "projection_size": config.embed_dim, "pad_token_id": txt.pad_id,
        },
        "vision_config": {
            "model_type": "siglip2_vision_model", "hidden_size": img.width,
            "intermediate_size": img.mlp_width or 4 * img.width, "num_hidden_layers": img.depth,
            "num_attention_heads": img.heads, "num_channels": 3, "patch_size": img.patch_size,
            "hidden_act": HIDDEN_ACT, "layer_norm_eps": img.norm_eps, "attention_dropout": 0.0,
            "vision_use_head": True, "num_patches": img.pos_embed_grid_size[0] * img.pos_embed_grid_size[1],
        },
    }


# --------------------------------------------------------------------------------------- weight map


@dataclass(frozen=True)
class WeightMap:
    """One row of the table: `ours` and `theirs` hold the same numbers.

    kind "copy": one tensor each side, same shape. "rows": the dim-0 concatenation of `ours` equals that of
    `theirs` (fused qkv <- q, k, v; MAP query and key/value <- MultiheadAttention's in_proj). "grid": our
    position table `[1, H, W, D]` is theirs `[H*W, D]` row-major. "scalar": our `[]` is their `[1]`.
    """

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    kind: str = "copy"


def _pairs(ours: str, theirs: str, names: tuple[str, ...] = ("weight", "bias")) -> list[WeightMap]:
    return [WeightMap((f"{ours}.{n}",), (f"{theirs}.{n}",)) for n in names]


def weight_map(config: ModelConfig) -> list[WeightMap]:
    """The explicit table, source key -> our key with its transform, for `config`'s depths."""
    table = [
        WeightMap(("logit_scale",), ("logit_scale",), "scalar"),
        WeightMap(("logit_bias",), ("logit_bias",), "scalar"),
        *_pairs("visual.embeds.proj", "vision_model.embeddings.patch_embedding"),
        WeightMap(("visual.embeds.pos_embed",), ("vision_model.embeddings.position_embedding.weight",), "grid"),
    ]
    for i in range(config.image.depth):
        ours, theirs = f"visual.blocks.{i}", f"vision_model.encoder.layers.{i}"
        table += [
            *_pairs(f"{ours}.norm1", f"{theirs}.layer_norm1"),
            *[WeightMap((f"{ours}.attn.qkv.{n}",), tuple(f"{theirs}.self_attn.{p}_proj.{n}" for p in "qkv"), "rows")
              for n in ("weight", "bias")],
            *_pairs(f"{ours}.attn.proj", f"{theirs}.self_attn.out_proj"),
            *_pairs(f"{ours}.norm2", f"{theirs}.layer_norm2"),
            *_pairs(f"{ours}.mlp.fc1", f"{theirs}.mlp.fc1"),
            *_pairs(f"{ours}.mlp.fc2", f"{theirs}.mlp.fc2"),
        ]
    head = "vision_model.head"
    table += [
        *_pairs("visual.norm", "vision_model.post_layernorm"),
        WeightMap(("visual.attn_pool.latent",), (f"{head}.probe",)),
        WeightMap(("visual.attn_pool.q.weight", "visual.attn_pool.kv.weight"), (f"{head}.attention.in_proj_weight",),
                  "rows"),
        WeightMap(("visual.attn_pool.q.bias", "visual.attn_pool.kv.bias"), (f"{head}.attention.in_proj_bias",), "rows"),
        *_pairs("visual.attn_pool.proj", f"{head}.attention.out_proj"),
        *_pairs("visual.attn_pool.norm", f"{head}.layernorm"),
        *_pairs("visual.attn_pool.mlp.fc1", f"{head}.mlp.fc1"),
        *_pairs("visual.attn_pool.mlp.fc2", f"{head}.mlp.fc2"),
        WeightMap(("text.token_embedding.weight",), ("text_model.embeddings.token_embedding.weight",)),
        WeightMap(("text.positional_embedding",), ("text_model.embeddings.position_embedding.weight",)),
    ]
    for i in range(config.text.layers):
        ours, theirs = f"text.transformer.resblocks.{i}", f"text_model.encoder.layers.{i}"
        table += [
            *_pairs(f"{ours}.ln_1", f"{theirs}.layer_norm1"),
            WeightMap((f"{ours}.attn.in_proj_weight",), tuple(f"{theirs}.self_attn.{p}_proj.weight" for p in "qkv"),
                      "rows"),
            WeightMap((f"{ours}.attn.in_proj_bias",), tuple(f"{theirs}.self_attn.{p}_proj.bias" for p in "qkv"),
                      "rows"),
            *_pairs(f"{ours}.attn.out_proj", f"{theirs}.self_attn.out_proj"),
            *_pairs(f"{ours}.ln_2", f"{theirs}.layer_norm2"),
            *_pairs(f"{ours}.mlp.c_fc", f"{theirs}.mlp.fc1"),
            *_pairs(f"{ours}.mlp.c_proj", f"{theirs}.mlp.fc2"),
        ]
    table += [
        *_pairs("text.ln_final", "text_model.final_layer_norm"),
        *_pairs("text.text_projection", "text_model.head"),
    ]
    return table


def _convert(row: WeightMap, source: list[torch.Tensor], target_shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Apply one row's transform to `source` (tensors of one side), giving tensors of `target_shapes`."""
    if row.kind == "copy":
        return [source[0]]
    if row.kind in ("scalar", "grid"):
        return [source[0].reshape(target_shapes[0])]
    if row.kind == "rows":
        joined = torch.cat(source, dim=0) if len(source) > 1 else source[0]
        return list(torch.split(joined, [shape[0] for shape in target_shapes], dim=0))
    raise AssertionError(f"unknown weight-map kind {row.kind!r}")


def _expected_their_shapes(row: WeightMap, ours: list[torch.Tensor]) -> list[tuple[int, ...]]:
    """Their tensors' shapes from ours (export direction)."""
    if row.kind == "copy":
        return [tuple(ours[0].shape)]
    if row.kind == "scalar":
        return [(1,)]
    if row.kind == "grid":
        _, h, w, d = ours[0].shape
        return [(h * w, d)]
    total = sum(t.shape[0] for t in ours)  # "rows": their parts are equal (q, k, v) or one fused tensor
    parts = len(row.theirs)
    return [(total // parts, *ours[0].shape[1:])] * parts


# ------------------------------------------------------------------------------------------ import


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (one file or the shards of an index)."""
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    if (directory / WEIGHTS_INDEX_FILE).is_file():
        index = json.loads((directory / WEIGHTS_INDEX_FILE).read_text())
        files = [directory / name for name in sorted(set(index["weight_map"].values()))]
        for file in files:
            if not file.is_file():
                raise Siglip2Error(f"weights shard {str(file)!r} listed in {WEIGHTS_INDEX_FILE} is missing")
        return files
    others = sorted(p.name for p in directory.glob("*.bin")) if directory.is_dir() else []
    extra = f" (found {', '.join(others)}; convert it to safetensors)" if others else ""
    raise Siglip2Error(f"{str(directory)!r} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}{extra}")


def _read_file(file: Path, tensors: dict[str, torch.Tensor] | None) -> None:
    """Every tensor of one safetensors file into `tensors` (None: only its header, which covers the whole file);
    a truncated or damaged file is a Siglip2Error naming it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            if tensors is not None:  # opening the file has read and checked its header
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
    except SafetensorError as error:
        raise Siglip2Error(f"{str(file)!r} is truncated or damaged ({str(error).strip()})") from None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors (one file or an index of shards)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        _read_file(file, tensors)
    return tensors


def import_state_dict(model: NaFlexClip, theirs: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Our state dict from transformers' tensors; every tensor of both sides accounted for, shapes checked."""
    expected = model.state_dict()
    table = weight_map(model.config)
    mapped_theirs = {key for row in table for key in row.theirs}
    missing = sorted(k for k in mapped_theirs if k not in theirs)
    if missing:
        raise Siglip2Error(f"{source}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
    unexpected = sorted(k for k in theirs if k not in mapped_theirs)
    if unexpected:
        raise Siglip2Error(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unmapped in all)")
    ours: dict[str, torch.Tensor] = {}
    for row in table:
        source_tensors = [theirs[k] for k in row.theirs]
        target_shapes = [tuple(expected[k].shape) for k in row.ours]
        want = _expected_their_shapes(row, [expected[k] for k in row.ours])
        for key, tensor, shape in zip(row.theirs, source_tensors, want, strict=True):
            if tuple(tensor.shape) != shape:
                raise Siglip2Error(f"{source}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                                   f"the config needs {shape}")
        for key, tensor in zip(row.ours, _convert(row, source_tensors, target_shapes), strict=True):
            ours[key] = tensor
    not_loaded = sorted(set(expected) - set(ours))
    if not_loaded:  # the table must cover the model: a gap here is a bug in the table, not in the checkpoint
        raise AssertionError(f"weight map leaves {not_loaded[0]!r} unloaded")
    return ours


def check(path: str | Path) -> None:
    """Siglip2Error unless `path` is a SigLIP 2 directory whose architecture maps and whose weight files are whole
    (their headers are read, not their tensors)."""
    directory = Path(path)
    config_from_transformers(read_config(directory), str(directory / CONFIG_FILE))
    for file in _weight_files(directory):
        _read_file(file, None)


def load(path: str | Path, **overrides: Any) -> NaFlexClip:
    """`NaFlexClip` with the architecture and every weight of a transformers SigLIP 2 checkpoint directory.

    `overrides`: tower fields that do not change the weights (e.g. `drop_path_rate=0.1`)."""
    import dataclasses

    directory = Path(path)
    config = config_from_transformers(read_config(directory), str(directory / CONFIG_FILE))
    if overrides:
        image_fields = {f.name for f in dataclasses.fields(config.image)}
        text_fields = {f.name for f in dataclasses.fields(config.text)}
        image = {k: v for k, v in overrides.items() if k in image_fields}
        text = {k: v for k, v in overrides.items() if k in text_fields and k not in image_fields}
        unknown = sorted(set(overrides) - set(image) - set(text) - {"loss"})
        if unknown or overrides.get("loss", LOSS) != LOSS:
            raise Siglip2Error(f"{str(directory)!r}: override {(unknown or ['loss'])[0]!r} does not apply to an "
                               f"imported SigLIP 2 model")
        config = dataclasses.replace(config, image=dataclasses.replace(config.image, **image),
                                     text=dataclasses.replace(config.text, **text))
    theirs = read_weights(directory)
    model = NaFlexClip(config)
    model.load_state_dict(import_state_dict(model, theirs, str(directory)))
    model.source_dir = str(directory)  # where its tokenizer and image processor live
    return model


def detect(path: str | Path) -> bool:
    """True when `path` is a directory whose config.json says `model_type: siglip2`."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        return False
    try:
        return json.loads(config_path.read_text()).get("model_type") == "siglip2"
    except (json.JSONDecodeError, AttributeError):
        return False


def naflex_to_transformers(image: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our NaFlex dict as `Siglip2Model` inputs (patches must be row-major from (0, 0), as our loaders make them)."""
    coord, valid = image["patch_coord"], image["patch_valid"]
    masked = torch.where(valid.unsqueeze(-1), coord, torch.zeros_like(coord))
    shapes = masked.amax(dim=1) + 1  # (rows, cols) of each image's grid
    return {"pixel_values": image["patches"], "pixel_attention_mask": valid.to(torch.long),
            "spatial_shapes": shapes.to(torch.long)}


# ------------------------------------------------------------------------------------------ export


def export_state_dict(model: NaFlexClip) -> dict[str, torch.Tensor]:
    """transformers' `Siglip2Model` state dict of our model (inverse of `import_state_dict`)."""
    problems = mapping_problems(model.config, model.logit_bias is not None)
    if problems:
        raise Siglip2Error("cannot export to transformers Siglip2Model: " + "; ".join(problems))
    ours = {key: value.detach() for key, value in model.state_dict().items()}
    theirs: dict[str, torch.Tensor] = {}
    for row in weight_map(model.config):
        tensors = [ours[k] for k in row.ours]
        shapes = _expected_their_shapes(row, tensors)
        for key, tensor in zip(row.theirs, _convert(row, tensors, shapes), strict=True):
            theirs[key] = tensor.contiguous().clone()
    return theirs


def export(model: NaFlexClip, path: str | Path, processor_dir: str | Path | None = None) -> Path:
    """Write `model` as a transformers SigLIP 2 directory (`config.json`, `model.safetensors`, and the tokenizer
    and image-processor files of `processor_dir`, default the directory it was imported from; the tokenizer
    returns no attention mask by default, as the text tower was trained)."""
    if not isinstance(model, NaFlexClip):
        raise Siglip2Error(f"export needs a NaFlexClip model, got {type(model).__name__}")
    state = export_state_dict(model)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state.values())).dtype
    config = config_to_transformers(model.config)
    processor_dir = processor_dir or getattr(model, "source_dir", None)
    if processor_dir is not None and detect(processor_dir):
        # keep what the architecture does not decide (token ids, initializer settings) from the source config
        source = read_config(processor_dir)
        for tower in ("text_config", "vision_config"):
            config[tower] = {**(source.get(tower) or {}), **config[tower]}
        config = {**{k: v for k, v in source.items() if k != "transformers_version"}, **config}
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    if processor_dir is not None:
        for name in PROCESSOR_FILES:
            if (Path(processor_dir) / name).is_file() and Path(processor_dir).resolve() != out.resolve():
                shutil.copyfile(Path(processor_dir) / name, out / name)
    write_training_tokenizer_config(out)
    return out


def export_notes(path: Path) -> list[str]:
    """How to load an exported directory, and what it lacks."""
    notes = ["load it with transformers.Siglip2Model.from_pretrained"]
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        # a preset trained from scratch used open_clip's tokenizer and timm's transform: nothing of transformers'
        notes.append("note: no tokenizer or image-processor files (the run did not start from a SigLIP 2 directory; "
                     "it used open_clip's tokenizer and OpenAI CLIP mean/std), add your own before using it in "
                     "transformers")
    return notes
