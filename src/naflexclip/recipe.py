"""SigLIP 2's training recipe: the objectives beside the sigmoid loss (`--recipe siglip2`, `--locca-loss-weight`).

SigLIP 2 (Tschannen et al. 2025, https://arxiv.org/abs/2502.14786, sec. 2.2) trains the image tower with a LocCa
decoder (`naflexclip.locca`) beside the sigmoid loss. The decoder's term is a
per-example term of the window objective (`naflexclip.window.ExampleTerm`), normalised by the window's target tokens:

    J(W) = s(W) · [ L_sigmoid(W) + λ_locca · (1 / T(W)) · Σ_{i ∈ W} Σ_{t ∈ targets(i)} CE_i,t ]

The self-distillation and masked-prediction terms of the paper's last 20% of training are not implemented yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

from naflexclip.locca import DECODER_SIZES, DecoderConfig, target_tokens
from naflexclip.model import PRESETS, ModelConfig, NaFlexClip
from naflexclip.window import ExampleTerm

# the values `--recipe` sets, each with its source
RECIPES: dict[str, dict[str, Any]] = {
    # the paper names no LocCa loss weight (sec. 2.2 adds the decoder loss to the sigmoid loss): ours is 1, the plain
    # sum, with the decoder's loss a mean over target tokens as LocCa's captioning loss is
    "siglip2": {"locca_loss_weight": 1.0},
}


@dataclass(frozen=True)
class Recipe:
    """The recipe flags, as `naflexclip train` and `naflexclip verify` take them."""

    recipe: str | None = None
    locca_loss_weight: float | None = None  # None: the recipe's value, or 0 (no decoder) without one

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"--recipe {self.recipe!r} is not known; choose one of {sorted(RECIPES)}")
        weight = self.locca_loss_weight
        if weight is not None and (not math.isfinite(weight) or weight < 0):
            raise ValueError(f"--locca-loss-weight must be a finite number >= 0, got {weight}")

    @classmethod
    def pick(cls, values: Any) -> Recipe:
        """The recipe fields of a config or an argparse namespace."""
        return cls(**{key: getattr(values, key) for key in cls().as_dict()})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def locca_weight(self) -> float:
        if self.locca_loss_weight is not None:
            return self.locca_loss_weight
        return float(RECIPES[self.recipe]["locca_loss_weight"]) if self.recipe else 0.0

    def example_terms(self) -> list[ExampleTerm]:
        """The per-example terms of the window objective."""
        return [ExampleTerm("locca", self.locca_weight, target_tokens)] if self.locca_weight > 0 else []

    def prepare(self, model: NaFlexClip) -> NaFlexClip:
        """`model` with what the recipe trains beside it (a decoder for the LocCa term; it starts fresh)."""
        if self.locca_weight > 0 and model.decoder is None:
            model.add_decoder(decoder_config(model.config))
        return model


def decoder_config(config: ModelConfig) -> DecoderConfig:
    """The decoder size for a model: the preset's (`DECODER_SIZES`), else one from its text tower (width and heads,
    half its layers, room for its captions plus a box)."""
    for name, preset in PRESETS.items():
        if name in DECODER_SIZES and dataclasses.replace(preset, loss=config.loss) == dataclasses.replace(
                config, decoder=None):
            return DECODER_SIZES[name]
    text = config.text
    return DecoderConfig(width=text.width, layers=max(1, text.layers // 2), heads=text.heads,
                         max_length=text.context_length + 8)


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("SigLIP 2's recipe")
    g.add_argument("--recipe", default=None, choices=sorted(RECIPES),
                   help="set the recipe's objectives and weights (siglip2: the LocCa decoder beside the sigmoid loss, "
                        "SigLIP 2 sec. 2.2; docs/accumulation.md)")
    g.add_argument("--locca-loss-weight", type=float, default=None,
                   help="λ of the LocCa decoder's term, normalised by the window's target tokens (default: the "
                        "recipe's, else 0: no decoder)")
