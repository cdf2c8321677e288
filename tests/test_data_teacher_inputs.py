"""A distillation teacher that reads other inputs than the student (another patch size, context length or
tokenizer) gets its own of the same samples in each training microbatch (`teacher_inputs`): the same images (the
same crop with --augment) on its own patch grid at the microbatch's sequence length, and the same captions in its
own tokens; a teacher with the student's processing gets nothing extra; what cannot work is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from naflexclip import create_model
from naflexclip.batch import TEACHER_INPUTS
from naflexclip.data import DataConfig, TeacherInputs, build_loader
from naflexclip.data.microbatch import split_rows
from naflexclip.data.samples import SkipSample
from naflexclip.data.synthetic import synthetic_sample
from naflexclip.objectives.distillation import teacher_inputs
from naflexclip.processing.naflex_transform import default_processing, tokenize

DATA = dict(synthetic_train_size=24, synthetic_val_size=8, naflex_seq_lens=(16, 36), naflex_max_tokens_per_batch=144,
            workers=0, synthetic_shape_group_size=1)  # single scenes: the test reads them with synthetic_sample


def _pixels(image: dict[str, torch.Tensor], patch: int) -> torch.Tensor:
    """The (normalised) images a NaFlex dict's patches tile, [B, H, W, 3] on the microbatch's largest grid."""
    coord, valid = image["patch_coord"], image["patch_valid"]
    rows, cols = int(coord[..., 0].max()) + 1, int(coord[..., 1].max()) + 1
    out = torch.zeros(coord.shape[0], rows * patch, cols * patch, 3)
    for b, i in valid.nonzero().tolist():
        r, c = coord[b, i].tolist()
        out[b, r * patch:(r + 1) * patch, c * patch:(c + 1) * patch] = image["patches"][b, i].view(patch, patch, 3)
    return out


@pytest.mark.parametrize("augment", [False, True])
def test_the_teachers_inputs_are_the_same_samples_on_its_own_patch_grid(augment: bool) -> None:
    teacher = TeacherInputs(default_processing(16, augment), patch_size=16, context_length=32)
    loader = build_loader(DataConfig(**DATA, augment=augment), split="train", patch_size=4, context_length=16,
                          inputs=[teacher])
    rows = 0
    for item in loader:
        own = item[TEACHER_INPUTS]
        # the microbatch's sequence length on the teacher's grid: the same patches, 16 px instead of 4
        assert own["image"]["patches"].shape == (*item["image"]["patches"].shape[:2], 16 * 16 * 3)
        assert torch.equal(own["image"]["patch_coord"], item["image"]["patch_coord"])
        assert torch.equal(own["image"]["patch_valid"], item["image"]["patch_valid"])
        # the same image content (the same crop): the teacher's pixels averaged 4×4 are the student's, within
        # resampling, and far from every other row's
        student = _pixels(item["image"], 4)
        taught = torch.nn.functional.avg_pool2d(_pixels(own["image"], 16).permute(0, 3, 1, 2), 4).permute(0, 2, 3, 1)
        distance = ((student[:, None] - taught[None]) ** 2).flatten(2).mean(-1)
        others = distance + torch.eye(len(distance)) * 1e9
        assert distance.diag().max() < 0.01 < others.min()
        # the same captions in the teacher's context length
        captions = [synthetic_sample(0, "train", int(key))[1] for key in item["keys"]]
        assert torch.equal(item["text"], tokenize(captions, 16)) and torch.equal(own["text"], tokenize(captions, 32))
        # a microbatch cut to cover an empty one keeps each piece's teacher rows
        pieces = split_rows(item, 2)
        assert torch.equal(torch.cat([p[TEACHER_INPUTS]["text"] for p in pieces]), own["text"])
        assert [p[TEACHER_INPUTS]["image"]["patches"].shape[0] for p in pieces] == [len(p["keys"]) for p in pieces]
        rows += len(item["keys"])
    assert rows == 24


def test_a_teacher_with_the_students_processing_gets_nothing_extra() -> None:
    student = create_model("tiny")
    assert teacher_inputs(create_model("tiny"), None, student, None, "tiny") is None
    # the student's own normalisation (--image-mean) is not the teacher's: it gets its own inputs
    own = teacher_inputs(create_model("tiny"), None, student, None, "tiny", image_overrides={"mean": (0.5,) * 3})
    assert own is not None and (own.patch_size, own.context_length) == (4, 16)
    own = teacher_inputs(create_model("small"), None, student, None, "small", augment=True,
                         image_overrides={"scale": (0.9, 1.0)})
    assert own is not None and (own.patch_size, own.context_length) == (16, 32)
    assert own.processing.transform.augment and own.processing.transform.scale == (0.9, 1.0)
    item = next(iter(build_loader(DataConfig(**DATA), split="train", patch_size=4, context_length=16)))
    assert TEACHER_INPUTS not in item


def test_a_teacher_whose_processing_cannot_crop_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from siglip2_cases import make_checkpoint

    from naflexclip.objectives.distillation import load_teacher

    make_checkpoint(tmp_path / "siglip2")
    teacher, processor = load_teacher(str(tmp_path / "siglip2"), None)
    own = teacher_inputs(teacher, processor, create_model("tiny"), None, "siglip2")
    assert own is not None and own.context_length == teacher.context_length != 16
    with pytest.raises(ValueError, match=r"^--distill-model 'siglip2': .*--augment") as error:
        teacher_inputs(teacher, processor, create_model("tiny"), None, "siglip2", augment=True)
    assert "\n" not in str(error.value)


def test_with_a_patch_size_drawn_per_microbatch_the_teacher_reads_its_own_inputs() -> None:
    """--naflex-patch-sizes: the student's patches are of each microbatch's size, so even a teacher of the student's
    preset reads its own (flattened, of its size) on the same grid."""
    student = create_model("tiny")
    assert teacher_inputs(create_model("tiny"), None, student, None, "tiny", own=True) is not None
    teacher = TeacherInputs(default_processing(4), patch_size=4, context_length=16)
    loader = build_loader(DataConfig(**DATA, naflex_patch_sizes=(4, 8)), split="train", patch_size=4,
                          context_length=16, inputs=[teacher])
    sizes = set()
    for item in loader:
        sizes.add(item["patch_size"])
        own = item[TEACHER_INPUTS]
        assert item["image"]["patches"].shape[2:] == (item["patch_size"], item["patch_size"], 3)
        assert own["image"]["patches"].shape == (*item["image"]["patches"].shape[:2], 4 * 4 * 3)
        assert torch.equal(own["image"]["patch_coord"], item["image"]["patch_coord"])
        assert torch.equal(own["text"], item["text"])
    assert sizes == {4, 8}


def test_with_several_captions_per_image_the_teacher_gets_every_caption() -> None:
    teacher = TeacherInputs(default_processing(16), patch_size=16, context_length=32)
    data = DataConfig(**DATA, synthetic_multi_caption=True, multi_caption=True)
    for item in build_loader(data, split="train", patch_size=4, context_length=16, inputs=[teacher]):
        own = item[TEACHER_INPUTS]
        assert own["image"]["patches"].shape[0] == len(item["keys"]) < own["text"].shape[0] == item["text"].shape[0]
        pieces = split_rows(item, 2)
        assert [p[TEACHER_INPUTS]["text"].shape[0] for p in pieces] == [p["text"].shape[0] for p in pieces]


def test_a_sample_the_teachers_transform_skips_is_left_out_of_both_inputs() -> None:
    class SkipsEveryOther:  # a teacher's transform that finds every other image unusable
        def __init__(self) -> None:
            self.inner, self.calls = default_processing(16).transform, 0

        def target_hw(self, image_hw: tuple[int, int], seq_len: int) -> tuple[int, int]:
            return self.inner.target_hw(image_hw, seq_len)

        def __call__(self, image, seq_len):
            self.calls += 1
            if self.calls % 2 == 0:
                raise SkipSample("degenerate_image", "the teacher's transform")
            return self.inner(image, seq_len)

    processing = dataclasses.replace(default_processing(16), transform=SkipsEveryOther())
    loader = build_loader(DataConfig(**DATA), split="train", patch_size=4, context_length=16,
                          inputs=[TeacherInputs(processing, patch_size=16, context_length=32)])
    rows = 0
    for item in loader:
        own = item[TEACHER_INPUTS]
        assert item["image"]["patches"].shape[0] == own["image"]["patches"].shape[0] == len(item["keys"])
        assert item["text"].shape[0] == own["text"].shape[0] == len(item["keys"])
        rows += len(item["keys"])
    assert 0 < rows < 24 and loader.skip_counts["degenerate_image"] == 24 - rows
