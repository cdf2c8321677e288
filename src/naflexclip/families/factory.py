"""Building and exporting models: a preset by name, a pretrained directory or a naflexclip run's checkpoint in
(`create_model`), a pretrained family's directory out (`export_model`). The families are asked through their
registry, `naflexclip.families`; a run's checkpoint is read by `naflexclip.models.run_weights`. It picks among the
families, so it lives above the model side with them (`naflexclip.models` imports no family)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from naflexclip.families import DIRECTORY_FAMILIES, export_family, family_of, find_family, named_family
from naflexclip.loss import LOSSES
from naflexclip.models.naflex_clip import PRESETS, NaFlexClip, model_config
from naflexclip.models.run_weights import is_run_checkpoint, load_run_model
from naflexclip.settings import IGNORE, MODEL_SECTION, REFUSE, setting

DEFAULT_MODEL = "small"  # `naflexclip train`'s model without --model (the demo's)
_THE_MODEL = "the model"


@dataclass(frozen=True)
class ModelSettings:
    """The model a command builds (`create_model`'s name, weights, loss and caches), as `naflexclip train` and
    `naflexclip verify` take them; each field a setting (`naflexclip.settings`)."""

    # None: DEFAULT_MODEL, or with --pretrained a naflexclip checkpoint that checkpoint's model
    model: str | None = setting(None, rule=REFUSE, why=_THE_MODEL, section=MODEL_SECTION, help=(
        f"model preset ({', '.join(sorted(PRESETS))}) or an OpenCLIP model name (ViT-B-16, ViT-B-16-SigLIP2, "
        "naflex_ViT-B-16, ...: open_clip.list_models(); docs/openclip.md)"),
        default_help=f"{DEFAULT_MODEL}, or with --pretrained a naflexclip checkpoint that checkpoint's model")
    # a transformers SigLIP 2 directory (architecture, weights, tokenizer, patching), or with an OpenCLIP --model
    # name that model's weights: a checkpoint file, a pretrained tag or hf-hub:org/name in a local cache; or a
    # naflexclip checkpoint (a run's checkpoints/ or one step_N/epoch_N in it: its architecture and weights only,
    # `naflexclip.models.run_weights`)
    pretrained: str | None = setting(None, rule=REFUSE, why=_THE_MODEL, section=MODEL_SECTION, help=(
        "with an OpenCLIP --model name: its weights, an open_clip checkpoint (.pt, .bin, .safetensors, an "
        "open_clip_train epoch_N.pt), a pretrained tag (laion2b_s34b_b79k) or hf-hub:org/name found in a local cache; "
        "otherwise a transformers SigLIP 2 directory, whose architecture replaces --model and whose tokenizer and "
        "patching the data's; or a naflexclip run's checkpoint (logs/RUN/checkpoints, or one step_N/epoch_N in it): "
        "its model's architecture and weights only (train: a new run from step 0 with its own schedule)"))
    # a name of LOSSES; None: the model's own (clip for tiny/small/base, siglip for SigLIP 2)
    loss: str | None = setting(None, rule=REFUSE, why="the loss", section=MODEL_SECTION, choices=sorted(LOSSES),
                               also=((("--siglip",), {"action": "store_const", "const": "siglip",
                                                      "default": argparse.SUPPRESS,
                                                      "help": "OpenCLIP's name for --loss siglip"}),
                                     (("--no-siglip",), {"action": "store_const", "const": "clip",
                                                         "default": argparse.SUPPRESS,
                                                         "help": "OpenCLIP's --siglip off: --loss clip"})),
                               help="contrastive loss: clip (softmax) or siglip (sigmoid, the model gets a "
                                    "logit_bias)",
                               default_help="the model's own (clip for tiny, small and base; siglip for siglip2-*, "
                                            "SigLIP names and --pretrained SigLIP 2; a checkpoint's, the one it was "
                                            "trained with)")
    # OpenCLIP's --cache-dir: where pretrained tags are looked up (besides HF's cache)
    cache_dir: str | None = setting(None, rule=IGNORE, section=MODEL_SECTION, help=(
        "where --pretrained tags and hf-hub: names are looked up (a Hugging Face hub cache or open_clip's download "
        "folder), besides the default caches; nothing is downloaded"))


def _looks_like_path(name: str) -> bool:
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    return any(sep in name for sep in separators) or name.startswith((".", "~"))


def create_model(name: str, pretrained: str | None = None, cache_dir: str | None = None, **overrides: Any
                 ) -> NaFlexClip:
    """Build a preset (`tiny`, `small`, `base`, `siglip2-base`, `siglip2-so400m`) with optional overrides
    (`loss="siglip"`, `drop_path_rate=0.1`, ...), an OpenCLIP model name (`ViT-B-16`, `ViT-B-16-SigLIP2`, ...;
    `pretrained`: an open_clip checkpoint file, a pretrained tag or `hf-hub:org/name` in a local cache, e.g. under
    `cache_dir`), or load the model of a pretrained directory (a transformers SigLIP 2 directory) when `name` is
    one; ValueError in one line naming the preset, the name or the path otherwise.

    A naflexclip run's checkpoint (its `checkpoints/` folder, one `step_N`/`epoch_N` in it, or a file inside one),
    as `name` or as `pretrained`, gives a new model with its architecture and weights only
    (`naflexclip.models.run_weights`); a `name` beside it must fit that architecture."""
    if pretrained is not None and is_run_checkpoint(pretrained):
        return load_run_model(pretrained, name, **overrides)
    if os.path.exists(name) and is_run_checkpoint(name):
        return load_run_model(name, **overrides)
    family = named_family(name)
    if family is not None:
        return family.build(name, pretrained=pretrained, cache_dir=cache_dir, **overrides)
    if pretrained is not None:
        if name in PRESETS:
            check_preset_pretrained(name, pretrained)
        if name in PRESETS or os.path.isdir(pretrained):  # `train --pretrained DIR`: the directory's architecture
            return create_model(pretrained, **overrides)
        raise ValueError(f"pretrained={pretrained!r} goes with an OpenCLIP model name, not {name!r} (or is a "
                         "naflexclip checkpoint or a pretrained model directory)")
    if os.path.isdir(name):
        return family_of(name).load(name, **overrides)
    if name in PRESETS or not (os.path.exists(name) or _looks_like_path(name)):
        return NaFlexClip(model_config(name, **overrides))  # an unknown name: "unknown model preset"
    takes = (f"create_model takes a preset name ({', '.join(sorted(PRESETS))}), an OpenCLIP model name, a "
             "pretrained model directory or a naflexclip checkpoint")
    if os.path.exists(name):
        parent = os.path.dirname(os.path.abspath(name))
        hint = f"; pass its directory {parent!r}" if find_family(parent) else ""
        raise ValueError(f"{name!r} is a file; {takes}{hint}")
    raise ValueError(f"{name!r} does not exist; {takes}")


def check_preset_pretrained(name: str, pretrained: str) -> None:
    """`pretrained` (not a naflexclip checkpoint) is a pretrained model directory, which preset `name` takes its
    architecture and weights from; else ValueError in one line: what it is, and what a preset's --pretrained takes."""
    takes = (f"--pretrained takes with --model {name} (a preset) a naflexclip checkpoint (a run's checkpoints/ "
             "folder or one checkpoint in it) or a pretrained model directory; an OpenCLIP weights file or tag goes "
             "with an OpenCLIP --model name")
    if not os.path.isdir(pretrained):
        raise ValueError(f"{pretrained!r} {'is a file' if os.path.exists(pretrained) else 'does not exist'}: {takes}")
    try:
        family_of(pretrained, DIRECTORY_FAMILIES)
    except ValueError as error:
        raise ValueError(f"{pretrained!r} is a folder that holds no naflexclip checkpoint and is no pretrained model "
                         f"directory ({error}): {takes}") from None


def export_model(model: NaFlexClip, path: str | Path, format: str = "transformers",
                 processor_dir: str | Path | None = None) -> Path:
    """Write `model` as a directory of the pretrained family of `format` (`transformers`: SigLIP 2, with the
    tokenizer and image-processor files of `processor_dir`, default the directory it was imported from)."""
    return export_family(format).export(model, path, processor_dir)
