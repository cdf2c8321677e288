"""The `openclip` family: OpenCLIP's model names and checkpoints in, as NaFlex models, and out again.

`build(NAME, pretrained=...)` maps the name onto our `ModelConfig` (`openclip_names`), finds its weights locally
(`openclip_sources`; nothing downloads) and loads every tensor through the explicit map (`openclip_weights`);
`export` writes the inverse, a state dict `open_clip.create_model(NAME, pretrained=FILE)` loads. The processing is
the name's own (its mean, std and tokenizer). Equality with open_clip's model, tested by outputs: docs/openclip.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from naflexclip.families.openclip_names import OpenClipError, claims_name, model_config, openclip_config
from naflexclip.families.openclip_sources import (
    SHIPPED_TAGS,
    find_in_hf_cache,
    pretrained_cfg,
    read_state_dict,
    resolve_pretrained,
)
from naflexclip.families.openclip_weights import export_state_dict, import_state_dict
from naflexclip.models.naflex_clip import ModelConfig, NaFlexClip
from naflexclip.processing.naflex_transform import NaFlexTransform, Processing, collate, tokenize

__all__ = [
    "EXPORT_FORMAT", "LOSS", "NAME", "build", "check", "check_pretrained", "claims_name", "detect", "export",
    "export_notes", "load", "model_config", "patch_budget", "preprocess_cfg", "processing", "processor_spec",
    "resolve_pretrained", "tokenizer_dir",
]

NAME = "openclip"
LOSS = "clip"  # the loss of most names; `model_config(name).loss` is the name's own
EXPORT_FORMAT = "openclip"
# the DataConfig.hf_processor of a model built from a name: "open_clip:NAME[:TOKENIZER_DIR]"
PROCESSOR_PREFIX = "open_clip:"
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


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
    file, state = _pretrained_state(name, pretrained, cache_dir)
    model = _uninitialised(config)
    model.load_state_dict(import_state_dict(model, state, str(file)))  # strict: every tensor
    return model


def _pretrained_state(name: str, pretrained: str, cache_dir: str | None) -> tuple[Path, dict[str, torch.Tensor]]:
    """The local file of `pretrained` and its tensors; a file that is not a checkpoint is one line naming the flag."""
    file = resolve_pretrained(name, pretrained, cache_dir)
    try:
        return file, read_state_dict(file)
    except OpenClipError as error:
        raise OpenClipError(f"--pretrained {pretrained}: {error}") from None


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
    file, state = _pretrained_state(name, pretrained, cache_dir)
    with torch.device("meta"):
        model = NaFlexClip(model_config(name))
    import_state_dict(model, state, str(file))
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
    found, looked = find_in_hf_cache(hf_name, ("tokenizer.json", "spiece.model"), cache_dir)
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
        tag_cfg = pretrained_cfg(name, tags[0])
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

