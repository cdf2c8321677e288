"""Building and exporting models: a preset by name or a pretrained directory in (`create_model`), a pretrained
family's directory out (`export_model`). The families are asked through their registry, `naflexclip.families`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from naflexclip.families import export_family, family_of
from naflexclip.model import NaFlexClip, model_config


def create_model(name: str, **overrides: Any) -> NaFlexClip:
    """Build a preset (`tiny`, `small`, `base`, `siglip2-base`, `siglip2-so400m`) with optional overrides
    (`drop_path_rate=0.1`, ...), or load the model of a pretrained directory (a transformers SigLIP 2 directory)
    when `name` is one."""
    if os.path.isdir(name):
        return family_of(name).load(name, **overrides)
    return NaFlexClip(model_config(name, **overrides))


def export_model(model: NaFlexClip, path: str | Path, format: str = "transformers",
                 processor_dir: str | Path | None = None) -> Path:
    """Write `model` as a directory of the pretrained family of `format` (`transformers`: SigLIP 2, with the
    tokenizer and image-processor files of `processor_dir`, default the directory it was imported from)."""
    return export_family(format).export(model, path, processor_dir)
