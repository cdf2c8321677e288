"""Pretrained families: model directories and names of other libraries that naflexclip loads, fine-tunes and exports.

A family is one module with the members of `PretrainedFamily` (recognise its directory or processor spec, build and
load our model, export it, the tokenizer and patching its models expect), registered in `FAMILIES`: `siglip2`
(transformers SigLIP 2 directories) and `openclip` (a `NamedFamily` of OpenCLIP's model names). `create_model`
(`factory`, which picks among presets, families and run checkpoints), `train --model`/`--pretrained`, `eval` and
`export` (`export_command`) ask this table; `data_processing` hands the data pipeline, which imports no family, the
processing of the model it feeds. Families build `naflexclip.models`' model: they import it, never the reverse.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from naflexclip.families import openclip, siglip2
from naflexclip.processing.naflex_transform import NaFlexTransform, Processing, collate, default_processing

if TYPE_CHECKING:
    from naflexclip.models.naflex_clip import NaFlexClip


class PretrainedFamily(Protocol):
    """The members of a family module. Errors are `ValueError`s with a one-line message naming the file."""

    NAME: str  # short name, e.g. in the default run name
    LOSS: str  # the loss its models are trained with (a name of `naflexclip.loss.LOSSES`)
    EXPORT_FORMAT: str  # `naflexclip export --format` value that writes this family's directories

    def detect(self, path: str | Path) -> bool:
        """True when `path` is a directory this family claims (cheap: its config, not its weights)."""

    def check(self, path: str | Path) -> None:
        """Raise when `path` is not a usable directory of this family (config, architecture, weight files)."""

    def load(self, path: str | Path, **overrides: Any) -> NaFlexClip:
        """Our model with the directory's architecture and every weight; `overrides` that keep the weights."""

    def export(self, model: NaFlexClip, path: str | Path, processor_dir: str | Path | None = None) -> Path:
        """Write `model` as a directory of this family (with `processor_dir`'s tokenizer/processor files)."""

    def export_notes(self, path: Path) -> list[str]:
        """Lines for the user about an exported directory: how to load it, what it lacks."""

    def processing(self, directory: str, patch_size: int, augment: bool = False) -> Processing:
        """The image transform, collation and tokenizer of the directory's models."""

    def patch_budget(self, directory: str, patch_size: int) -> int:
        """The patches per image the directory's own processor uses (its evaluation default)."""


class NamedFamily(PretrainedFamily, Protocol):
    """A family of model names (`--model NAME`), whose weights come from `--pretrained` files or tags."""

    def claims_name(self, name: str) -> bool:
        """True when `name` is one of the family's model names."""

    def build(self, name: str, pretrained: str | None = None, cache_dir: str | None = None,
              **overrides: Any) -> NaFlexClip:
        """The model of the name, random init or with the weights of `pretrained` (found locally, under `cache_dir`)."""


FAMILIES: tuple[PretrainedFamily, ...] = (siglip2, openclip)
NAMED_FAMILIES: tuple[NamedFamily, ...] = (openclip,)  # those of FAMILIES that claim model names
# those whose models come as directories (a named family's come as a name and a weight file or tag)
DIRECTORY_FAMILIES: tuple[PretrainedFamily, ...] = tuple(f for f in FAMILIES if f not in NAMED_FAMILIES)
EXPORT_FORMATS = tuple(family.EXPORT_FORMAT for family in FAMILIES)


def named_family(name: str) -> NamedFamily | None:
    """The family whose model name `name` is, or None (a preset, a directory, a typo)."""
    return next((family for family in NAMED_FAMILIES if family.claims_name(name)), None)


def find_family(path: str | Path) -> PretrainedFamily | None:
    """The family that claims directory `path`, or None."""
    return next((family for family in FAMILIES if family.detect(path)), None)


def family_of(path: str | Path, families: tuple[PretrainedFamily, ...] = FAMILIES) -> PretrainedFamily:
    """The family of `families` that claims directory `path`; otherwise ValueError with each one's reason, in one
    line."""
    family = next((family for family in families if family.detect(path)), None)
    if family is not None:
        return family
    reasons = []
    for candidate in families:
        try:
            candidate.check(path)
            reasons.append(f"{str(path)!r} is not a {candidate.NAME} directory")
        except ValueError as error:
            reasons.append(str(error))
    raise ValueError("; ".join(reasons))


def data_processing(source: str | None, patch_size: int, augment: bool = False, *,
                    mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                    interpolation: str | None = None, scale: tuple[float, float] | None = None,
                    ratio: tuple[float, float] | None = None) -> Processing:
    """The image transform, collation and tokenizer handed to the loaders for a model: those of the family of
    `source` (`DataConfig.hf_processor`, the pretrained directory the model came from), or our presets' own
    (`source` None). `augment`: random crops (the train split with --augment). `mean`, `std`, `interpolation`:
    OpenCLIP's --image-mean, --image-std, --image-interpolation, and the train crop's `scale` and `ratio` (--aug-cfg)
    (`DataConfig.image_overrides()`), for our NaFlex transform and collation."""
    processing = (default_processing(patch_size, augment) if source is None
                  else family_of(source).processing(source, patch_size, augment))
    if mean is None and std is None and interpolation is None and scale is None and ratio is None:
        return processing
    base = processing.collate
    if not isinstance(processing.transform, NaFlexTransform) or getattr(base, "func", base) is not collate:
        raise ValueError(f"--image-mean/--image-std/--image-interpolation/--aug-cfg: {source!r} brings its own image "
                         f"processor")
    kept = dict(getattr(base, "keywords", {}))
    transform = processing.transform
    if interpolation is not None or scale is not None or ratio is not None:
        transform = NaFlexTransform(patch_size, augment=transform.augment,
                                    interpolation=interpolation or transform.interpolation,
                                    scale=scale or transform.scale, ratio=ratio or transform.ratio)
    normalise = {**kept, **({"mean": tuple(mean)} if mean is not None else {}),
                 **({"std": tuple(std)} if std is not None else {})}
    return dataclasses.replace(processing, transform=transform, collate=functools.partial(collate, **normalise))


def export_family(format: str) -> PretrainedFamily:
    """The family whose directories `format` writes."""
    for family in FAMILIES:
        if family.EXPORT_FORMAT == format:
            return family
    raise ValueError(f"export format {format!r} is not supported; use one of {list(EXPORT_FORMATS)}")
