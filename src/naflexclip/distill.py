"""Distillation from a teacher (OpenCLIP's `--distill-model`, `--distill-pretrained`; `--distill-loss-weight`).

The teacher is anything `create_model` builds (a preset, a pretrained directory such as SigLIP 2's), with the
weights of a naflexclip checkpoint when `--distill-pretrained` names one. It is frozen (no parameter requires a
gradient) and in eval mode; the window (`accumulate_gradients(teacher=...)`) runs it once per microbatch without
gradient and feeds its features, exchanged like the student's, to `naflexclip.loss.DistillLoss`. As in OpenCLIP,
the teacher reads the student's inputs, so it must take the same patches and tokens: the same patch size, text
context length and tokenizer/patching (`hf_processor`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from naflexclip.factory import create_model
from naflexclip.families import find_family
from naflexclip.loss import DistillLoss


@dataclass(frozen=True)
class Distill:
    """The distillation flags, as `naflexclip train` and `naflexclip verify` take them."""

    distill_model: str | None = None
    distill_pretrained: str | None = None
    distill_loss_weight: float = 1.0

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

    def loss(self, kind: str, tile_size: int) -> DistillLoss:
        """The window's loss for a `kind` (`clip`/`siglip`) student."""
        return DistillLoss(kind, weight=self.distill_loss_weight, tile_size=tile_size)

    def teacher(self, student: nn.Module, student_processor: str | None, kind: str) -> nn.Module:
        """The frozen teacher in eval mode, checked to read `student`'s inputs (its data processed by the
        pretrained directory `student_processor`, or by the default pipeline when None) and, for a `siglip`
        student, to give pair probabilities (a `logit_bias`)."""
        assert self.distill_model is not None
        model, processor = load_teacher(self.distill_model, self.distill_pretrained)
        check_teacher_inputs(model, processor, student, student_processor, self.distill_model)
        if kind == "siglip" and getattr(model, "logit_bias", None) is None:
            raise ValueError(f"--distill-model {self.distill_model!r}: a siglip student distils from a sigmoid "
                             f"teacher's pair probabilities, and this teacher has no logit_bias (a clip model)")
        return model


def load_teacher(name: str, pretrained: str | None) -> tuple[nn.Module, str | None]:
    """The teacher `create_model(name)` builds, with `pretrained`'s weights (a naflexclip checkpoint directory, or a
    run's checkpoints/: its latest) when given; frozen and in eval mode. Also the pretrained directory whose
    tokenizer and patching it reads (None: the default pipeline)."""
    from naflexclip.train.components import load_checkpoint_model  # train imports the window: only when asked

    if pretrained is None:
        try:
            model = create_model(name)
        except ValueError as error:
            raise ValueError(f"--distill-model: {error}") from None
        processor = str(Path(name).resolve()) if Path(name).is_dir() and find_family(name) else None
    else:
        try:
            model, trained = load_checkpoint_model(pretrained)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"--distill-pretrained {pretrained!r}: {error}") from None
        built_from = trained.get("pretrained") or trained.get("model")
        same = (Path(name).resolve() == Path(str(built_from)).resolve() if trained.get("pretrained")
                else name == built_from)
        if not same:
            raise ValueError(f"--distill-pretrained {pretrained!r} holds a {built_from!r} model, not --distill-model "
                             f"{name!r}")
        processor = trained.get("data", {}).get("hf_processor")
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval(), processor


def check_teacher_inputs(teacher: nn.Module, teacher_processor: str | None, student: nn.Module,
                         student_processor: str | None, name: str) -> None:
    """One line when the teacher cannot read the student's microbatches."""
    for what, ours, theirs in (("patch size", student.image_patch_size, teacher.image_patch_size),
                               ("text context length", student.context_length, teacher.context_length)):
        if ours != theirs:
            raise ValueError(f"--distill-model {name!r}: the teacher reads the student's inputs, but its {what} is "
                             f"{theirs} and the student's {ours}")
    if teacher_processor != student_processor:
        raise ValueError(f"--distill-model {name!r}: the teacher reads the student's inputs, but it tokenizes and "
                         f"patches with {teacher_processor or 'the default pipeline'} and the student with "
                         f"{student_processor or 'the default pipeline'}")


def add_distill_args(parser: argparse.ArgumentParser) -> None:
    """OpenCLIP's distillation flags."""
    g = parser.add_argument_group("distillation")
    g.add_argument("--distill-model", default=None,
                   help="teacher: a preset or a pretrained model directory (create_model); frozen, run once per "
                        "microbatch without gradient")
    g.add_argument("--distill-pretrained", default=None,
                   help="the teacher's weights: a naflexclip checkpoint, or a run's checkpoints/ (its latest)")
    g.add_argument("--distill-loss-weight", type=float, default=1.0,
                   help="λ of the window objective contrastive + λ·distill (default 1, OpenCLIP's)")
