"""Where the weights of an OpenCLIP name come from (`--pretrained`): a checkpoint file, an OpenCLIP pretrained tag
or `hf-hub:org/name`, the last two found only in local caches (`--cache-dir`, the Hugging Face cache, open_clip's
`~/.cache/clip`); nothing downloads. `read_state_dict` reads a file's tensors: an `open_clip_train` checkpoint
(`{"state_dict": ...}`, `module.` prefixes) or a plain state dict (`.pt`, `.pth`, `.bin`, `.safetensors`).
"""

from __future__ import annotations

import codecs
import logging
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from naflexclip.families.openclip_names import OpenClipError, model_names, openclip_config

_log = logging.getLogger(__name__)

# the weight files of a Hugging Face repo of open_clip, safetensors first (as open_clip prefers it)
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
SIGLIP_MEAN = SIGLIP_STD = (0.5, 0.5, 0.5)
# pretrained tags of the shipped NaFlex names (OpenCLIP main's pretrained.py)
SHIPPED_TAGS: dict[str, dict[str, dict[str, Any]]] = {
    "ViT-B-16-SigLIP2-naflex": {"webli": {"hf_hub": "timm/ViT-B-16-SigLIP2-naflex/", "mean": SIGLIP_MEAN,
                                          "std": SIGLIP_STD, "interpolation": "bicubic"}},
    "ViT-SO400M-16-SigLIP2-naflex": {"webli": {"hf_hub": "timm/ViT-SO400M-16-SigLIP2-naflex/",
                                               "mean": SIGLIP_MEAN, "std": SIGLIP_STD, "interpolation": "bicubic"}},
}


def _hf_cache_dirs(cache_dir: str | None) -> list[Path]:
    """The Hugging Face hub caches to look in: `cache_dir` and the default (HF_HUB_CACHE, HF_HOME/hub)."""
    dirs = [Path(cache_dir).expanduser()] if cache_dir else []
    from huggingface_hub.constants import HF_HUB_CACHE

    dirs.append(Path(HF_HUB_CACHE))
    return dirs


def find_in_hf_cache(repo_id: str, filenames: tuple[str, ...], cache_dir: str | None) -> tuple[Path | None, list[str]]:
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


def pretrained_cfg(name: str, tag: str) -> dict[str, Any]:
    """The config of the name's pretrained tag (open_clip's, else a shipped NaFlex name's); empty when none."""
    import open_clip

    return dict(open_clip.get_pretrained_cfg(name, tag) or SHIPPED_TAGS.get(name, {}).get(tag) or {})


def _activation_name(quick_gelu: bool) -> str:
    return "QuickGELU" if quick_gelu else "GELU"


def warn_activation_mismatch(name: str, tag: str, cfg: dict[str, Any]) -> None:
    """One line when the tag's weights were trained with another activation than the name's (open_clip's own check:
    the tag's `quick_gelu` against the name's config), naming the name of the same architecture with theirs."""
    config = openclip_config(name) or {}
    ours, theirs = bool(config.get("quick_gelu", False)), bool(cfg.get("quick_gelu", False))
    if ours == theirs:
        return
    config.pop("quick_gelu", None)
    twin = {**config, "quick_gelu": True} if theirs else config
    matching = [other for other in model_names() if other != name and openclip_config(other) == twin]
    hint = f"; --model {matching[0]} is this architecture with {_activation_name(theirs)}" if matching else ""
    _log.warning(f"--pretrained {tag}: the weights of {name} {tag} were trained with {_activation_name(theirs)}, "
                 f"--model {name} uses {_activation_name(ours)} (open_clip warns alike: accuracy drops until "
                 f"fine-tuning adapts){hint}")


def resolve_pretrained(name: str, pretrained: str, cache_dir: str | None = None) -> Path:
    """The local file of a `--pretrained` weight source for the name: a file, an OpenCLIP pretrained tag or
    `hf-hub:org/name` found in a local cache (nothing downloads); one-line OpenClipError naming where it looked."""
    path = Path(pretrained).expanduser()
    if path.is_file():
        return path.resolve()
    if pretrained.startswith("hf-hub:"):
        repo_id = pretrained[len("hf-hub:"):].strip("/")
        found, looked = find_in_hf_cache(repo_id, WEIGHT_FILES, cache_dir)
        if found is None:
            raise OpenClipError(f"--pretrained {pretrained}: {' or '.join(WEIGHT_FILES)} of {repo_id!r} is not in a "
                                f"local cache (looked in {', '.join(looked)}); nothing is downloaded")
        return found
    cfg = pretrained_cfg(name, pretrained)
    if not cfg:
        if path.exists() or os.sep in pretrained or pretrained.startswith("."):
            raise OpenClipError(f"--pretrained {pretrained}: not a file (a checkpoint, .pt, .bin or .safetensors)")
        import open_clip

        tags = open_clip.list_pretrained_tags_by_model(name) or list(SHIPPED_TAGS.get(name, {}))
        raise OpenClipError(f"--pretrained {pretrained!r}: not a file, nor a pretrained tag of {name} "
                            f"(its tags: {', '.join(tags) or 'none'})")
    warn_activation_mismatch(name, pretrained, cfg)
    looked = []
    if cfg.get("hf_hub"):
        filenames: tuple[str, ...]
        repo_id, filename = os.path.split(cfg["hf_hub"].rstrip("/") if cfg["hf_hub"].endswith("/") else cfg["hf_hub"])
        if cfg["hf_hub"].endswith("/"):
            repo_id, filenames = cfg["hf_hub"].rstrip("/"), WEIGHT_FILES
        else:
            stem = filename.rsplit(".", 1)[0]
            filenames = (f"{stem}.safetensors", filename) if not filename.endswith(".safetensors") else (filename,)
        found, looked = find_in_hf_cache(repo_id, filenames, cache_dir)
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


def _load_weights_only(path: Path) -> Any:
    """`torch.load` of tensors and plain containers only (no other object is unpickled: that could run code);
    a file it cannot read is a one-line OpenClipError saying what the file is not, never torch's advice to load
    it with `weights_only=False`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the refusal below says what matters
        try:  # memory-mapped: the tensors are read from the page cache as they are copied into the model
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            try:  # a file of torch's legacy (non-zip) format cannot be mapped
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as error:
                raise OpenClipError(f"{str(path)!r} {_not_a_checkpoint(path, error)}") from None


def _not_a_checkpoint(path: Path, error: Exception) -> str:
    """What a file `torch.load(weights_only=True)` refused is, in a few words (torch's message is a paragraph)."""
    checkpoint = "a checkpoint (a torch.save file of tensors, or .safetensors)"
    if path.stat().st_size == 0:
        return f"is empty, not {checkpoint}"
    if isinstance(error, pickle.UnpicklingError):
        try:
            others = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # not torch.save's zip archive: a pickle of some other program
            others = []
        if others:
            return (f"holds objects other than tensors ({', '.join(sorted(others))}): a checkpoint is read as only "
                    f"tensors and plain containers (unpickling others could run code); save its tensors with "
                    f"torch.save(model.state_dict()) or as .safetensors")
        return f"is a pickle torch.save did not write, not {checkpoint}"
    with open(path, "rb") as handle:
        head = handle.read(4096)
    if zipfile.is_zipfile(path) or head.startswith(b"PK\x03\x04"):
        return f"is a zip archive torch.save did not write (or a damaged one), not {checkpoint}"
    try:  # incremental: the 4096 bytes may end inside a character
        text = b"\0" not in head and codecs.getincrementaldecoder("utf-8")().decode(head, final=False) is not None
    except UnicodeDecodeError:
        text = False
    return f"reads as text, not {checkpoint}" if text else f"is not {checkpoint}"


def read_state_dict(file: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file: `open_clip_train`'s `{"state_dict": ...}`, a plain state dict (`.pt`,
    `.bin`) or `.safetensors`; the `module.` (DDP) and `_orig_mod.` (torch.compile) prefixes removed."""
    path = Path(file)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        state: Any
        try:
            state = load_file(str(path))
        except SafetensorError as error:
            raise OpenClipError(f"{str(path)!r} is truncated or damaged ({str(error).strip()})") from None
    else:
        state = _load_weights_only(path)
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

