"""Distillation from a teacher (OpenCLIP's `--distill-model`, `--distill-pretrained`; `--distill-loss-weight`).

Owns the teacher: built by `create_model`, given its weights, frozen and in eval mode; the window runs it once per
microbatch without gradient and feeds its features to `naflexclip.loss.DistillLoss`. A teacher whose inputs differ
from the student's reads its own (`TeacherInputs`). docs/distillation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from naflexclip.batch import TEACHER_INPUTS
from naflexclip.checkpoints import storage
from naflexclip.data.microbatch import TeacherInputs
from naflexclip.data.sample_inputs import SampleInputs
from naflexclip.families import data_processing, find_family, named_family
from naflexclip.families.factory import create_model
from naflexclip.loss import DistillLoss, MultiPositiveDistillLoss, MultiPositiveLoss
from naflexclip.models.naflex_clip import PRESETS
from naflexclip.models.run_weights import is_run_checkpoint, weights_digest
from naflexclip.objectives.objective import BuildContext, Objective
from naflexclip.settings import APPLY, setting
from naflexclip.window import TeacherFeatures, Term

_DISTILL = "distillation"
_TEACHER_RECORD = "teacher"  # the run state's record of the teacher a run was built with


@dataclass
class DistillFlags:
    """The distillation flags, as `naflexclip train` and `naflexclip verify` take them (each field a setting,
    `naflexclip.settings`)."""

    distill_model: str | None = setting(None, rule=APPLY, section=_DISTILL, help=(
        "teacher: a preset, a pretrained model directory or an OpenCLIP model name (create_model); frozen, run once "
        "per microbatch without gradient"))
    distill_pretrained: str | None = setting(None, rule=APPLY, section=_DISTILL, help=(
        "the teacher's weights: a naflexclip checkpoint, or a run's checkpoints/ (its latest); for an OpenCLIP name "
        "also an open_clip_train checkpoint, a state dict file, a pretrained tag or hf-hub:org/name in a local cache "
        "(--cache-dir)"))
    distill_loss_weight: float = setting(1.0, rule=APPLY, section=_DISTILL, help=(
        "λ of the window objective contrastive + λ·distill (default 1, OpenCLIP's)"))


@dataclass
class Distill(DistillFlags):
    """The distillation flags' values, checked, and what they build: the window's loss and the frozen teacher."""

    def __post_init__(self) -> None:
        if self.distill_pretrained is not None and self.distill_model is None:
            raise ValueError("--distill-pretrained goes with --distill-model (the teacher its weights are for)")
        if not math.isfinite(self.distill_loss_weight) or self.distill_loss_weight < 0:
            raise ValueError(f"--distill-loss-weight must be a finite number >= 0, got {self.distill_loss_weight}")

    @property
    def enabled(self) -> bool:
        return self.distill_model is not None

    @classmethod
    def pick(cls, values: Any) -> Distill:
        """The distillation fields of a config or an argparse namespace."""
        return cls(**{key: getattr(values, key) for key in cls().as_dict()})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def loss(self, kind: str, tile_size: int, multi_positive_weighting: str | None = None
             ) -> DistillLoss | MultiPositiveDistillLoss:
        """The window's loss for a `kind` (`clip`/`siglip`) student; with `multi_positive_weighting` (several
        captions per image, `--multi-positive`) the multi-positive loss and the distill term."""
        if multi_positive_weighting is not None:
            return MultiPositiveDistillLoss(kind, multi_positive_weighting, self.distill_loss_weight, tile_size)
        return DistillLoss(kind, weight=self.distill_loss_weight, tile_size=tile_size)

    def teacher(self, student: nn.Module, student_processor: str | None, kind: str, cache_dir: str | None = None,
                *, augment: bool = False, image_overrides: dict[str, Any] | None = None, own_inputs: bool = False,
                checkpoint: Path | None = None) -> tuple[nn.Module, TeacherInputs | None]:
        """The frozen teacher in eval mode (its tags looked up under `cache_dir` too), checked, for a `siglip`
        student, to give pair probabilities (a `logit_bias`); and the inputs it reads (`teacher_inputs`): None for
        the student's (whose data `student_processor` processes, a `DataConfig.hf_processor`, or the default
        pipeline when None, with `augment` and the student's `image_overrides`, `DataConfig.image_overrides()`;
        `own_inputs`: its own in any case, as when the student's patch size varies per microbatch).
        `checkpoint`: the naflexclip checkpoint to read the weights from instead of --distill-pretrained's (the one
        it named when a resumed run started)."""
        assert self.distill_model is not None
        model, processor = load_teacher(self.distill_model, self.distill_pretrained if checkpoint is None
                                        else str(checkpoint), cache_dir)
        if kind == "siglip" and getattr(model, "logit_bias", None) is None:
            raise ValueError(f"--distill-model {self.distill_model!r}: a siglip student distils from a sigmoid "
                             f"teacher's pair probabilities, and this teacher has no logit_bias (a clip model)")
        return model, teacher_inputs(model, processor, student, student_processor, self.distill_model, augment,
                                     image_overrides or {}, own=own_inputs)


def load_teacher(name: str, pretrained: str | None, cache_dir: str | None = None) -> tuple[nn.Module, str | None]:
    """The teacher `create_model(name, pretrained, cache_dir)` builds, frozen and in eval mode, and the processor
    spec whose tokenizer and patching it reads (`DataConfig.hf_processor`; None: the default pipeline).
    `pretrained`: a naflexclip checkpoint directory (or a run's checkpoints/: its latest) for any `name`; for an
    OpenCLIP name also everything `--pretrained` takes with it (an open_clip_train checkpoint, a state dict file, a
    pretrained tag or `hf-hub:org/name` in a local cache, e.g. under `cache_dir`)."""
    family = named_family(name)
    if family is not None and (pretrained is None or not is_run_checkpoint(pretrained)):
        model, processor = _openclip_teacher(family, name, pretrained, cache_dir)
    elif pretrained is None:
        try:
            model = create_model(name)
        except ValueError as error:
            raise ValueError(f"--distill-model: {error}") from None
        processor = str(Path(name).resolve()) if Path(name).is_dir() and find_family(name) else None
    else:
        model, processor = _run_checkpoint_teacher(name, pretrained)
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval(), processor


def teacher_checkpoint(pretrained: str | None) -> Path | None:
    """The checkpoint folder a run-checkpoint --distill-pretrained reads now (a run's `checkpoints/`: its latest,
    which moves while that run goes on), or None for weights of another kind."""
    if pretrained is None or not is_run_checkpoint(pretrained):
        return None
    path = Path(pretrained)
    path = path.parent if path.is_file() else path
    return path if storage.is_complete(path) else storage.find_latest(path)


def _openclip_teacher(family: Any, name: str, pretrained: str | None, cache_dir: str | None
                      ) -> tuple[nn.Module, str]:
    """An OpenCLIP name's teacher with the weights of a file, a tag or `hf-hub:` (none: random), and its spec."""
    try:
        model = family.build(name, pretrained=pretrained, cache_dir=cache_dir)
        file = None if pretrained is None else family.resolve_pretrained(name, pretrained, cache_dir)
        processor = family.processor_spec(name, family.tokenizer_dir(name, file, cache_dir))
    except ValueError as error:
        message = str(error)
        for prefix in (f"--pretrained {pretrained!r}: ", f"--pretrained {pretrained}: ", f"--model {name}: ",
                       "--model: "):
            message = message.removeprefix(prefix)
        flag = "--distill-model" if pretrained is None or str(error).startswith("--model") else "--distill-pretrained"
        value = name if flag == "--distill-model" else pretrained
        raise ValueError(f"{flag} {value!r}: {message}") from None
    return model, processor


def _run_checkpoint_teacher(name: str, pretrained: str) -> tuple[nn.Module, str | None]:
    """The model of a naflexclip checkpoint, which must be a `name` model, and the processing it was trained with."""
    from naflexclip.models.run_weights import load_checkpoint_model

    try:
        model, trained = load_checkpoint_model(pretrained)
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"--distill-pretrained {pretrained!r}: {error}") from None
    trained_model = str(trained.get("model") or "")
    if named_family(trained_model) is not None:  # an OpenCLIP name's run: its `pretrained` is a weight file
        same = name == trained_model
        built_from = trained_model
    else:
        built_from = trained.get("pretrained") or trained_model
        same = (Path(name).resolve() == Path(str(built_from)).resolve() if trained.get("pretrained")
                else name == built_from)
    if not same:
        raise ValueError(f"--distill-pretrained {pretrained!r} holds a {built_from!r} model, not --distill-model "
                         f"{name!r}")
    return model, trained.get("data", {}).get("hf_processor")


# what the teacher and the student are fed, compared when their processor specs differ (e.g. the same tokenizer
# read from two directories): uppercase, punctuation, digits, accents and CJK, and a text longer than the context
_PROBE_TEXTS = ("a photo of a Red Circle.", "Two blue squares, 3 green triangles!", "café déjà-vu", "画像の猫",
                "x", " ".join(["the quick brown fox jumps over the lazy dog"] * 12))


def _probe_inputs(processor: str | None, patch_size: int, context_length: int) -> tuple[torch.Tensor, ...]:
    """The patches of a fixed non-square image and the tokens of `_PROBE_TEXTS` under `processor`."""
    from PIL import Image

    processing = data_processing(processor, patch_size)
    rows = torch.arange(29 * 41 * 3, dtype=torch.int64).reshape(29, 41, 3)
    image = Image.fromarray(((rows * 37 + rows // 7) % 256).to(torch.uint8).numpy(), "RGB")
    seq_len = 12
    pixels = processing.collate([processing.transform(image, seq_len)], seq_len, patch_size)
    tokens = processing.tokenize(list(_PROBE_TEXTS), context_length)
    return pixels["patches"], pixels["patch_coord"], pixels["patch_valid"], tokens


def _same_inputs(teacher_processor: str | None, student_processor: str | None, patch_size: int,
                 context_length: int) -> bool:
    if teacher_processor == student_processor:
        return True
    theirs = _probe_inputs(teacher_processor, patch_size, context_length)
    ours = _probe_inputs(student_processor, patch_size, context_length)
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))


def teacher_inputs(teacher: nn.Module, teacher_processor: str | None, student: nn.Module,
                   student_processor: str | None, name: str, augment: bool = False,
                   image_overrides: dict[str, Any] | None = None, own: bool = False) -> TeacherInputs | None:
    """None when the teacher can read the student's microbatches (the same patch size, context length, tokenizer
    and image processing: processor specs that differ are compared by what they produce; no --image-mean/-std/
    --image-interpolation of the student's own) and not `own` (the student's patch size varies per microbatch:
    --naflex-patch-sizes), else the teacher's own processing of the same samples: its tokenizer, patching and
    normalisation, cropping as the student does (`augment`, the --aug-cfg ranges)."""
    overrides = dict(image_overrides or {})
    crop = {key: overrides.pop(key) for key in ("scale", "ratio") if key in overrides}
    if (not own and not overrides and student.image_patch_size == teacher.image_patch_size
            and student.context_length == teacher.context_length
            and _same_inputs(teacher_processor, student_processor, student.image_patch_size, student.context_length)):
        return None
    try:
        processing = data_processing(teacher_processor, teacher.image_patch_size, augment,
                                     **(crop if augment else {}))
    except ValueError as error:  # what still cannot work: a processing that cannot crop as the student's does
        raise ValueError(f"--distill-model {name!r}: the teacher reads its own inputs, which its processing "
                         f"cannot give here: {error}") from None
    return TeacherInputs(processing, teacher.image_patch_size, teacher.context_length)


class Distillation(Objective):
    """Distillation from a frozen teacher: the pair loss takes the teacher's features (`DistillLoss`), which the
    window computes once per microbatch as constants (`TeacherFeatures`)."""

    name = "distillation"
    flags = DistillFlags
    switch_flags = "--distill-model"
    switch_fields = ("distill_model",)
    compares_processing = True

    def __init__(self, values: Any) -> None:
        self.distill = Distill.pick(values)
        self.teacher: nn.Module | None = None
        self.teacher_inputs: TeacherInputs | None = None
        # the teacher built: its flags, the checkpoint folder it was read from and its weights' digest
        self.teacher_record: dict[str, Any] | None = None
        self.kept_teacher: str | None = None  # a resume's note: the teacher kept where the flag now reads another

    @property
    def enabled(self) -> bool:
        return self.distill.enabled

    def check(self, values: Any, training: bool = True) -> None:
        name = self.distill.distill_model
        if not training:  # verify audits the window with a random teacher as well
            return
        if self.enabled and self.distill.distill_pretrained is None and name in PRESETS:
            raise ValueError(f"--distill-model {name} is a preset: give the teacher's weights with "
                             f"--distill-pretrained (a naflexclip checkpoint)")
        if self.enabled and self.distill.distill_pretrained is None and named_family(str(name)):
            raise ValueError(f"--distill-model {name} is an OpenCLIP name: give the teacher's weights "
                             f"with --distill-pretrained (a checkpoint file, a tag, hf-hub:org/name)")

    def loss(self, loss: nn.Module, kind: str, tile_size: int) -> nn.Module:
        # several captions per image keep their weighting: the multi-positive loss beside the distill term
        weighting = loss.weighting if isinstance(loss, MultiPositiveLoss) else None
        return self.distill.loss(kind, tile_size, weighting)

    def build(self, context: BuildContext) -> None:
        flags = {"distill_model": self.distill.distill_model, "distill_pretrained": self.distill.distill_pretrained}
        now = teacher_checkpoint(self.distill.distill_pretrained)
        # a resume keeps the checkpoint folder the run started from (a run's `latest` moves while it goes on),
        # unless the teacher's flags changed
        saved = (context.resumed_run or {}).get(_TEACHER_RECORD)
        kept = None
        if (now is not None and saved is not None and saved.get("path") is not None
                and {key: saved.get(key) for key in flags} == flags and storage.is_complete(Path(saved["path"]))):
            kept = Path(saved["path"])
            if kept.resolve() != now.resolve():
                self.kept_teacher = (f"--distill-pretrained {self.distill.distill_pretrained}: distilling from "
                                     f"{kept}, the teacher the resumed run started from (its latest is now {now})")
        teacher, self.teacher_inputs = self.distill.teacher(
            context.student, context.processor, context.loss, context.cache_dir, augment=context.augment,
            image_overrides=context.image_overrides, own_inputs=context.own_inputs, checkpoint=kept)
        path = kept if kept is not None else now
        self.teacher_record = {**flags, "path": None if path is None else str(path),
                               "weights_sha256": weights_digest(teacher)}
        self.teacher = (teacher.to(context.device) if context.dtype is None
                        else teacher.to(context.device, context.dtype))

    def run_record(self) -> dict[str, Any]:
        return {} if self.teacher_record is None else {_TEACHER_RECORD: self.teacher_record}

    def resume_error(self, saved_run: dict[str, Any], run: dict[str, Any]) -> str | None:
        """Under the same teacher flags, a teacher with other weights than the checkpoint's is refused (another
        --distill-pretrained is the way to take a new teacher on)."""
        saved, current = saved_run.get(_TEACHER_RECORD), run.get(_TEACHER_RECORD)
        if saved is None or current is None or saved["weights_sha256"] == current["weights_sha256"]:
            return None
        if any(saved.get(key) != current.get(key) for key in ("distill_model", "distill_pretrained")):
            return None  # a changed teacher flag, applied and named as every changed flag is
        was, now = (record.get("path") or record.get("distill_pretrained") for record in (saved, current))
        where = "which now holds other weights" if was == now else f"this run would read {now}"
        return (f"--distill-pretrained {self.distill.distill_pretrained}: the checkpoint distilled from {was} "
                f"(weights sha256 {saved['weights_sha256'][:12]}), {where} "
                f"(sha256 {current['weights_sha256'][:12]}); give the teacher its weights back, or name the folder "
                f"of the teacher to go on with in --distill-pretrained (a changed flag is applied)")

    def loader_inputs(self, student: nn.Module, processing: Any) -> list[SampleInputs]:
        # a teacher that reads other inputs than the student's gets its own of the same samples from the loader
        return [] if self.teacher_inputs is None else [self.teacher_inputs]

    def terms(self) -> list[Term]:
        assert self.teacher is not None, "build the teacher first"
        return [TeacherFeatures(self.teacher)]

    def add_random_inputs(self, batch: dict[str, Any], num_examples: int, draw: Callable[..., dict[str, Any]],
                          seed: int) -> None:
        if self.teacher_inputs is None or self.teacher is None:
            return
        # the teacher's own random inputs of the same images and texts
        teacher = self.teacher
        own = draw(max(num_examples, batch["text"].shape[0]), patch_size=teacher.image_patch_size,
                   context_length=teacher.context_length, generator=torch.Generator().manual_seed(seed + 2),
                   vocab_size=teacher.vocab_size)
        batch[TEACHER_INPUTS] = {"image": {key: value[:num_examples] for key, value in own["image"].items()},
                                 "text": own["text"][: batch["text"].shape[0]]}

    def describe(self) -> list[str]:
        kept = [] if self.kept_teacher is None else [self.kept_teacher]
        own = ("" if self.teacher_inputs is None else
               f"; it reads its own inputs of the same samples (patch size {self.teacher_inputs.patch_size}, "
               f"context length {self.teacher_inputs.context_length})")
        return [f"distilling from --distill-model {self.distill.distill_model} (frozen, one forward per microbatch "
                f"without gradient): loss = contrastive + {self.distill.distill_loss_weight:g} · distill, logged as "
                f"loss/contrastive and loss/distill{own}", *kept]
