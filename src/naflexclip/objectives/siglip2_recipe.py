"""SigLIP 2's training recipe: the objectives beside the sigmoid loss (`--recipe siglip2`, `--locca-loss-weight`).

Owns what the recipe adds to a run: the LocCa decoder's term (`objectives.locca_decoder`), normalised by the
window's target tokens, and from `--self-distill-start` the self-distillation and masked-prediction terms
(`objectives.self_distillation`), normalised by the window's examples. The recipe: docs/siglip2_recipe.md; the
objective: docs/accumulation.md#the-window-objective-per-example-terms-siglip-2s-decoder.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from naflexclip.data.regions import CaptionTokens, DecoderExamples
from naflexclip.data.sample_inputs import SampleInputs
from naflexclip.models.naflex_clip import PRESETS, ModelConfig, NaFlexClip
from naflexclip.objectives.locca_decoder import (
    DECODER_SIZES,
    LOCCA,
    DecoderConfig,
    LoccaTerm,
    attach_decoder,
    decoder_metrics,
)
from naflexclip.objectives.objective import EvalContext, EvalTask, Objective, TermSchedule
from naflexclip.objectives.self_distill_schedule import SelfDistillation
from naflexclip.objectives.self_distillation import (
    MASKED_PREDICTION,
    SELF_DISTILL,
    EmaTeacher,
    SelfDistillTerm,
    ViewSeeds,
    attach_heads,
    head_config,
)
from naflexclip.processing.naflex_transform import Processing
from naflexclip.settings import APPLY, REFUSE, setting
from naflexclip.window import Term

# the values `--recipe` sets, each with its source
RECIPES: dict[str, dict[str, Any]] = {
    # the paper names no LocCa loss weight (sec. 2.2 adds the decoder loss to the sigmoid loss): ours is 1, the plain
    # sum, with the decoder's loss a mean over target tokens as LocCa's captioning loss is
    # sec. 2.3 (self-distillation and masked prediction): "The weights of the first and the second loss terms are set to
    # 1 and 0.25" (re-weighted per model size: SIZE_FACTORS); "a single global (teacher) view and 8 local (student)
    # views"; "We replace 50% of the embedded image patches"; "We add these losses at 80% of training completion".
    # The EMA momentum is not stated (SigLIP 2 follows SILC, which keeps it fixed rather than DINO's schedule to 1):
    # ours is 0.996, DINO's base momentum held fixed
    "siglip2": {"locca_loss_weight": 1.0, "self_distill_loss_weight": 1.0, "masked_prediction_loss_weight": 0.25,
                "local_crops": 8, "mask_ratio": 0.5, "ema_momentum": 0.996, "self_distill_start": 0.8},
}
_SIGLIP2 = RECIPES["siglip2"]  # the values written once: the flags' help, DEFAULTS and docs/siglip2_recipe.md read them
# SigLIP 2 sec. 2.3 re-weights both terms by a further 0.25 / 0.5 / 1.0 / 0.5 for the B / L / So400m / g models: the
# recipe's self-distillation weights times the factor of the model's size, told apart by the image
# tower's (width, depth) as the paper's towers are (timm's vit_{base,large,so400m,giantopt}_patch16_siglip_*, which
# open_clip's ViT-{B,L,SO400M,gopt}-16-SigLIP2* configs build); other sizes: no paper value, factor 1
SIZE_FACTORS: dict[tuple[int, int], tuple[str, float]] = {
    (768, 12): ("B", 0.25), (1024, 24): ("L", 0.5), (1152, 27): ("So400m", 1.0), (1536, 40): ("g", 0.5)}
SELF_DISTILL_WEIGHTS = ("self_distill_loss_weight", "masked_prediction_loss_weight")
# the pair loss a recipe trains with when --loss is not given (a model built from scratch; pretrained weights keep
# their own): SigLIP 2 is a sigmoid-loss model
RECIPE_LOSS: dict[str, str] = {"siglip2": "siglip"}
# without --recipe: no decoder and no self-distillation terms; the views and teacher flags take SigLIP 2's values
DEFAULTS: dict[str, Any] = {**_SIGLIP2, **dict.fromkeys(("locca_loss_weight", *SELF_DISTILL_WEIGHTS), 0.0)}


_RECIPE = "SigLIP 2's recipe"


@dataclass
class RecipeFlags:
    """The recipe flags, as `naflexclip train` and `naflexclip verify` take them (each field a setting,
    `naflexclip.settings`)."""

    # the recipe decides the objectives and the model's decoder; --locca-loss-weight is a weight (applied: the
    # decoder, in the checkpoint, continues; 0 <-> > 0 adds or drops the decoder, refused as an architecture change)
    recipe: str | None = setting(None, rule=REFUSE, why="the objectives and the model (the recipe's decoder)",
                                 section=_RECIPE, choices=sorted(RECIPES), help=(
        "set the recipe's objectives and weights (siglip2: the LocCa decoder beside the sigmoid loss, SigLIP 2 sec. "
        "2.2, and self-distillation and masked prediction for the last 20%%, sec. 2.3; docs/siglip2_recipe.md)"))
    # None: the recipe's value, or 0 (no decoder) without one
    locca_loss_weight: float | None = setting(None, rule=APPLY, section=_RECIPE, help=(
        "λ of the LocCa decoder's term, normalised by the window's target tokens (default: the recipe's, else 0: "
        "no decoder)"))
    # None: the recipe's value, else DEFAULTS
    self_distill_loss_weight: float | None = setting(None, rule=APPLY, section=_RECIPE, help=(
        "λ of the self-distillation term (SILC: local crops vs the EMA teacher's full image), per window example "
        f"(default: the recipe's, siglip2: {_SIGLIP2['self_distill_loss_weight']:g}, else 0)"))
    masked_prediction_loss_weight: float | None = setting(None, rule=APPLY, section=_RECIPE, help=(
        "λ of the masked-prediction term (TIPS: masked patches vs the EMA teacher's), per window example (default: "
        f"the recipe's, siglip2: {_SIGLIP2['masked_prediction_loss_weight']:g}, else 0)"))
    local_crops: int | None = setting(None, rule=APPLY, section=_RECIPE,
                                      help=f"student local crops per image (default {DEFAULTS['local_crops']})")
    mask_ratio: float | None = setting(None, rule=APPLY, section=_RECIPE, help=(
        f"fraction of each image's patches masked for masked prediction (default {DEFAULTS['mask_ratio']:g})"))
    ema_momentum: float | None = setting(None, rule=APPLY, section=_RECIPE, help=(
        f"the EMA teacher's momentum, fixed (default {DEFAULTS['ema_momentum']:g}; SigLIP 2 does not state it)"))
    self_distill_start: float | None = setting(None, rule=APPLY, section=_RECIPE, help=(
        "fraction of training after which the self-distillation terms are on (default "
        f"{DEFAULTS['self_distill_start']:g})"))


@dataclass
class Recipe(RecipeFlags):
    """The recipe flags' values, checked, and what they decide: each term's weight, the model's modules."""

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"--recipe {self.recipe!r} is not known; choose one of {sorted(RECIPES)}")
        for name in ("locca_loss_weight", "self_distill_loss_weight", "masked_prediction_loss_weight"):
            weight = getattr(self, name)
            if weight is not None and (not math.isfinite(weight) or weight < 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {weight}")
        if self.local_crops is not None and self.local_crops < 1:
            raise ValueError(f"--local-crops must be >= 1, got {self.local_crops}")
        for name in ("mask_ratio", "ema_momentum", "self_distill_start"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")

    def value(self, name: str) -> Any:
        """A recipe flag's value: as given, else the recipe's, else the default."""
        given = getattr(self, name)
        if given is not None:
            return given
        return (RECIPES[self.recipe] if self.recipe else DEFAULTS)[name]

    @property
    def self_distill_enabled(self) -> bool:
        """Either self-distillation term has a positive weight (the heads and the EMA teacher are needed)."""
        return self.value("self_distill_loss_weight") > 0 or self.value("masked_prediction_loss_weight") > 0

    def self_distill_active(self, progress: float) -> bool:
        """Whether the self-distillation terms are on at `progress` (the fraction of training done): from
        `--self-distill-start` on; before it their weight is 0 and they are not computed."""
        return self.self_distill_enabled and progress >= self.value("self_distill_start")

    def for_locked_image(self, image_locked: bool) -> tuple[Recipe, str | None]:
        """This recipe for a run whose image tower is fully locked (`--lock-image`): both self-distillation terms
        are image-side (the image tower learns from them), so they are off, with the line that says so."""
        if not (image_locked and self.self_distill_enabled):
            return self, None
        off = dataclasses.replace(self, self_distill_loss_weight=0.0, masked_prediction_loss_weight=0.0)
        return off, ("--lock-image: the image tower is locked, so self-distillation and masked prediction (both "
                     "image-side) are off")

    def for_model_size(self, width: int, depth: int) -> tuple[Recipe, str | None]:
        """This recipe for a model whose image tower has `width` and `depth`: the self-distillation weights the recipe
        sets (not those given by flag) times SigLIP 2's factor for the model's size (`SIZE_FACTORS`; 1 for a size the
        paper has none for), and what was applied and why (None: no recipe weight to re-weight)."""
        recipe_weights = [flag for flag in SELF_DISTILL_WEIGHTS if getattr(self, flag) is None]
        if self.recipe is None or not self.self_distill_enabled or not recipe_weights:
            return self, None
        size, factor = SIZE_FACTORS.get((width, depth), (None, 1.0))
        tower = f"image tower width {width}, depth {depth}"
        why = (f"SigLIP 2's factor for size {size} ({tower})" if size is not None else
               f"no paper value: the {tower} is none of the paper's B / L / So400m / g")
        given = [flag for flag in SELF_DISTILL_WEIGHTS if flag not in recipe_weights]
        scaled = dataclasses.replace(self, **{flag: RECIPES[self.recipe][flag] * factor for flag in recipe_weights})
        note = (f"--recipe {self.recipe}'s weights × {factor:g}, {why}"
                + "".join(f"; --{flag.replace('_', '-')} as given" for flag in given))
        return scaled, note

    def self_distill_line(self, size_note: str | None = None) -> str:
        """The run's opening line for the self-distillation terms (`size_note`: `for_model_size`'s)."""
        weights = " + ".join(f"{self.value(flag):g} · {name}" for name, flag in zip(
            (SELF_DISTILL, MASKED_PREDICTION), SELF_DISTILL_WEIGHTS, strict=True) if self.value(flag) > 0)
        return (f"SigLIP 2's self-distillation from --self-distill-start {self.value('self_distill_start'):g} of "
                f"the run's steps: + {weights} (per example of the window"
                + (f"; {size_note}" if size_note else "")
                + f"; {self.value('local_crops')} local crops, --mask-ratio {self.value('mask_ratio'):g}), against "
                f"an EMA teacher (--ema-momentum {self.value('ema_momentum'):g}) run once per microbatch without "
                "gradient")

    def ema_teacher(self, model: NaFlexClip) -> EmaTeacher:
        """The EMA teacher, a copy of the student's image tower and heads as they are now (build it at the switch)."""
        return EmaTeacher(model, momentum=float(self.value("ema_momentum")))

    @classmethod
    def pick(cls, values: Any) -> Recipe:
        """The recipe fields of a config or an argparse namespace."""
        # a config without the self-distillation fields (a training config before they are wired) leaves them None
        return cls(**{key: getattr(values, key, None) for key in cls().as_dict()})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def locca_weight(self) -> float:
        if self.locca_loss_weight is not None:
            return self.locca_loss_weight
        return float(RECIPES[self.recipe]["locca_loss_weight"]) if self.recipe else 0.0

    def term_weights(self, progress: float | None = None) -> dict[str, float]:
        """The weights λ of the per-example terms at `progress` (the fraction of training done): the decoder's
        throughout, the self-distillation terms from `--self-distill-start`; `progress=None` (a caller that does not
        schedule them): the decoder's only."""
        weights = {LOCCA: self.locca_weight} if self.locca_weight > 0 else {}
        if progress is not None and self.self_distill_active(progress):
            for name, flag in ((SELF_DISTILL, "self_distill_loss_weight"),
                               (MASKED_PREDICTION, "masked_prediction_loss_weight")):
                if self.value(flag) > 0:
                    weights[name] = float(self.value(flag))
        return weights

    def terms(self, progress: float | None = None, teacher: EmaTeacher | None = None) -> list[Term]:
        """The recipe's terms of the window objective at `progress` (`term_weights`): the decoder's
        (`LoccaTerm`), and with the self-distillation terms on, theirs against the EMA `teacher`
        (`SelfDistillTerm`)."""
        weights = self.term_weights(progress)
        terms: list[Term] = [LoccaTerm(weights[LOCCA])] if LOCCA in weights else []
        self_distill = {name: weight for name, weight in weights.items() if name != LOCCA}
        if self_distill:
            if teacher is None:
                raise ValueError("the self-distillation terms need the EMA teacher (Recipe.ema_teacher)")
            terms.append(SelfDistillTerm(teacher, self_distill))
        return terms

    def prepare(self, model: NaFlexClip, self_distill: bool = False) -> NaFlexClip:
        """`model` with what the recipe trains beside it (a decoder for the LocCa term; with `self_distill`, for a
        caller that schedules those terms, the self-distillation heads and mask token): the checkpoint's, where the
        model was loaded with them, else fresh."""
        if self.locca_weight > 0 and model.decoder is None:
            attach_decoder(model, model.config.decoder or decoder_config(model.config))
        if self_distill and self.self_distill_enabled and model.self_distill is None:
            attach_heads(model, model.config.self_distill or head_config(
                model.config.image.width, int(self.value("local_crops")), float(self.value("mask_ratio"))))
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


def decoder_examples(model: NaFlexClip, processing: Processing) -> DecoderExamples:
    """What the data pipeline builds each sample's LocCa example with: the model's decoder vocabulary and width, and
    the text tower's tokenizer (the processing's)."""
    assert model.decoder is not None
    return DecoderExamples(model.decoder.vocab, model.decoder.config.max_length,
                           CaptionTokens(processing.tokenize, model.context_length))


class Siglip2Recipe(Objective):
    """SigLIP 2's recipe: the LocCa decoder's term throughout, self-distillation and masked prediction against an
    EMA teacher from `--self-distill-start` (`SelfDistillation`, saved as the run state `ema_teacher`)."""

    name = "siglip2_recipe"
    flags = RecipeFlags
    state_name = "ema_teacher"
    head_slots = {"decoder": "--recipe / --locca-loss-weight (the LocCa decoder)",
                  "self_distill": "--local-crops / --mask-ratio (SigLIP 2's self-distillation heads)"}
    switch_flags = ("--recipe siglip2 / --locca-loss-weight / --self-distill-loss-weight / "
                    "--masked-prediction-loss-weight")
    switch_fields = ("recipe", "locca_loss_weight", "self_distill_loss_weight", "masked_prediction_loss_weight")

    def __init__(self, values: Any) -> None:
        # a config without the self-distillation fields (a training config before they are wired) leaves them None
        self.recipe = Recipe.pick(values)
        self.size_note: str | None = None
        self.decoder: DecoderConfig | None = None

    @property
    def enabled(self) -> bool:
        return self.recipe.locca_weight > 0 or self.recipe.self_distill_enabled

    def random_window_flags(self) -> str | None:
        return self.switch_flags

    def pair_loss_kind(self) -> str | None:
        return RECIPE_LOSS.get(self.recipe.recipe or "")

    def check(self, values: Any, training: bool = True) -> None:
        data = getattr(values, "data", values)
        image_locked = bool(getattr(values, "lock_image", False)) and not getattr(values, "lock_image_unlocked_groups",
                                                                                  0)
        recipe, _ = self.recipe.for_locked_image(image_locked)
        distilling, multi_positive = (getattr(values, "distill_model", None) is not None,
                                      bool(getattr(values, "multi_positive", False)))
        patch_sizes = getattr(data, "naflex_patch_sizes", None)
        if patch_sizes is not None:  # the masked tokens need flattened patches of the model's own size
            sizes = " ".join(map(str, patch_sizes))
            for flag in ("self_distill_loss_weight", "masked_prediction_loss_weight"):
                if (getattr(self.recipe, flag) or 0) > 0:
                    raise ValueError(f"--naflex-patch-sizes {sizes} with --{flag.replace('_', '-')}: the masked "
                                     f"tokens need flattened patches of the model's own size; drop one of them")
        if recipe.self_distill_enabled:
            what = "self-distillation or masked prediction (--recipe siglip2 / their weights > 0)"
            for flag, given in (("--distill-model", distilling), ("--multi-positive", multi_positive)):
                if given:
                    raise ValueError(f"{flag} with {what} is not supported yet")
            patch_dropout = getattr(values, "force_patch_dropout", None) or 0
            if recipe.value("masked_prediction_loss_weight") > 0 and patch_dropout > 0:
                raise ValueError(f"--force-patch-dropout {patch_dropout:g} with masked prediction "
                                 f"(--recipe siglip2 / --masked-prediction-loss-weight > 0): patch dropout drops "
                                 f"tokens of the masked pass, whose targets are per patch; drop one of them")
        if not recipe.term_weights():
            return
        what = "a LocCa term (--recipe siglip2 / --locca-loss-weight > 0)"
        if image_locked:
            raise ValueError(f"--lock-image with {what}: the decoder's loss trains the image tower; unlock some "
                             f"groups (--lock-image-unlocked-groups) or drop --lock-image")
        for flag, given in (("--distill-model", distilling), ("--multi-positive", multi_positive),
                            ("--augment", bool(getattr(data, "augment", False)))):
            if given:
                raise ValueError(f"{flag} with {what} is not supported yet")

    def prepare(self, model: nn.Module, image_locked: bool = False) -> list[str]:
        # the self-distillation weights re-weighted for the model's size (the recipe's, not given ones); a locked
        # image tower has no image-side self-distillation (it cannot learn from it): both terms off
        recipe, self.size_note = self.recipe.for_model_size(model.config.image.width, model.config.image.depth)
        self.recipe, image_side_off = recipe.for_locked_image(image_locked)
        self.recipe.prepare(model, self_distill=True)  # the decoder, the self-distillation heads: fresh or loaded
        self.decoder = model.config.decoder
        return [image_side_off] if image_side_off else []

    def loader_inputs(self, student: nn.Module, processing: Any) -> list[SampleInputs]:
        return ([decoder_examples(student, processing)] if self.recipe.locca_weight > 0 else []) + (
            [ViewSeeds()] if self.recipe.self_distill_enabled else [])

    def eval_tasks(self, model: nn.Module, context: EvalContext) -> list[EvalTask]:
        """The LocCa decoder's metrics on the validation split (`locca_decoder.decoder_metrics`), where the model
        has a decoder."""
        if getattr(model, "decoder", None) is None or context.data.source("val") is None:
            return []
        try:  # not a core dependency (~100 MB): the siglip2 and benchmark extras bring it
            import pycocoevalcap  # noqa: F401

            bleu = True
        except ImportError:
            bleu = False
        return [EvalTask("decoder", context.frequency, lambda model, skips: decoder_metrics(
            model, context.data, context.device, context.autocast, skips, bleu=bleu),
            brief=("decoder/caption_bleu4", "decoder/aref_acc"), unsharded="the LocCa decoder",
            note="" if bleu else ("decoder/caption_bleu4 needs pycocoevalcap (pip install 'naflexclip[siglip2]'); "
                                  "the LocCa decoder is evaluated on aref only"))]

    def terms(self) -> list[Term]:
        # with self-distillation the schedule hands each window all of the recipe's terms
        return [] if self.recipe.self_distill_enabled else self.recipe.terms()

    def schedule(self, model: nn.Module, env: Any, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None,
                 notify: Callable[[str], None]) -> TermSchedule | None:
        if not self.recipe.self_distill_enabled:
            return None
        return SelfDistillation(self.recipe, model, env, sum_over_ranks, notify)

    def verify_terms(self, model: nn.Module) -> list[Term]:
        # the window after --self-distill-start: every term on, the EMA teacher as at the switch (a copy of the
        # student, its centres at zero)
        teacher = self.recipe.ema_teacher(model) if self.recipe.self_distill_enabled else None
        return self.recipe.terms(1.0, teacher)

    def describe(self) -> list[str]:
        lines = []
        if self.recipe.locca_weight > 0:
            lines.append(f"SigLIP 2's LocCa decoder ({self.decoder}) trains beside the pair loss: loss = contrastive "
                         f"+ {self.recipe.locca_weight:g} · locca (per target token of the window), logged as "
                         f"train/loss with each term, loss/contrastive and loss/locca")
        if self.recipe.self_distill_enabled:
            lines.append(self.recipe.self_distill_line(self.size_note))
        return lines
