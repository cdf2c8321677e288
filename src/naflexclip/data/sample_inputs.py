"""What an objective asks of the data pipeline beyond the student's image and text: `SampleInputs`, built for each
sample in the loader's workers and collated into its microbatch (a decoder's example from the sample's regions,
a self-distillation view seed, a teacher's own processing of the same image). An objective hands its own to the
loader (`naflexclip.objectives.objective.Objective.loader_inputs`); the loader never names one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from naflexclip.data.source import RawSample


@dataclass
class DecodedSample:
    """A sample as its inputs are built from: the raw sample, its decoded image, its captions (its text rows), the
    microbatch's `seed_key` (seed, epoch, ...) and sequence length, and `draws`, the crop generator's state before
    the student's transform (None without --augment: an input that crops replays the student's crop from it).
    `skips`: (reason, detail) of the parts of it an input left out (a bad region), each a skip record of its own."""

    raw: RawSample
    image: Image.Image
    captions: list[str]
    seed_key: tuple[int, ...]
    seq_len: int
    draws: Any = None
    skips: list[tuple[str, str]] = field(default_factory=list)


class SampleInputs:
    """Inputs an objective's examples need from data, built per sample and collated per microbatch; pickled to the
    loader's workers. The defaults add nothing."""

    def check(self, augment: bool, multi_caption: bool) -> None:
        """Refuse (ValueError, one line naming the flags) data settings these inputs cannot be built under."""

    def target_hw(self, hw: tuple[int, int], seq_len: int) -> tuple[int, int] | None:
        """The size an image of `hw` is resized to for these inputs, if it is (a JPEG is decoded at the smallest
        scale that still covers every resize of it)."""
        return None

    def of_sample(self, sample: DecodedSample) -> Any:
        """This sample's inputs (raise `naflexclip.data.samples.SkipSample` to leave the sample out)."""
        return None

    def of_microbatch(self, values: list[Any], texts: list[str], seq_len: int) -> dict[str, dict[str, Any]]:
        """The microbatch's inputs from its samples' (`values`, in row order; `texts`: its text rows), by the item
        key they go under: `naflexclip.batch.EXAMPLE_INPUTS` for per-row columns, `TEACHER_INPUTS` for a teacher's
        own image and text."""
        return {}
