"""Distillation in the window (docs/accumulation.md, The window objective): for every split and method the
accumulated gradient equals s(W)·∇θ[contrastive + λ·distill](W) of the full batch, the teacher's features of
the whole window as constants; the teacher runs once per microbatch, in eval mode, and gets no gradient; the
per-microbatch rule fails the same comparison. A teacher with another patch size and context length reads the
microbatches' `teacher_inputs` (its own processing of the same rows), exactly alike."""

from __future__ import annotations

import random

import pytest
import torch
from window_cases import failures, full_batch_gradients, naflex_window, tiny_model

from naflexclip import DistillLoss, accumulate_gradients, create_loss, create_model, window_loss_scale
from naflexclip.audit.openclip_rule import per_microbatch_scale_gradients
from naflexclip.audit.random_windows import random_grouped_batch, random_naflex_batch, random_split_sizes
from naflexclip.batch import TEACHER_INPUTS, split_batch
from naflexclip.loss import MultiPositiveDistillLoss
from naflexclip.window import TeacherFeatures

# (student loss, teacher loss): a softmax student learns from either teacher, a sigmoid one from a sigmoid one
PAIRS = [("clip", "clip"), ("clip", "siglip"), ("siglip", "siglip")]


def _setup(student: str, teacher: str, num_examples: int = 8, seed: int = 3):
    model = tiny_model(student == "siglip")
    teacher_model = tiny_model(teacher == "siglip", seed=1)  # another initialisation: another model
    batch = naflex_window(num_examples, seed=seed)
    return model, teacher_model, batch


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
@pytest.mark.parametrize(("method", "mode"), [("cache", "linear"), ("replay", "sqrt")])
def test_distilled_window_equals_the_full_batch_for_every_split(student, teacher, method, mode):
    model, teacher_model, batch = _setup(student, teacher)
    loss_fn = DistillLoss(student, weight=0.7, tile_size=3)
    rng = random.Random(len(student + teacher + method))
    reference_scale = None
    for count in (1, 4):
        sizes = random_split_sizes(8, count, rng)
        scale = window_loss_scale(sizes, 4, mode)
        if scale != reference_scale:  # s(W) depends on the count only: one reference per count
            reference = full_batch_gradients(model, loss_fn, batch, scale, [TeacherFeatures(teacher_model)])
            reference_scale = scale
        model.zero_grad(set_to_none=True)
        stats = accumulate_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale=mode,
                                     reference_batch_size=4, method=method, terms=[TeacherFeatures(teacher_model)])
        assert failures(model, reference) == {}, sizes
        assert set(stats.terms) == {"contrastive", "distill"}
        assert stats.terms["contrastive"] + stats.terms["distill"] == pytest.approx(stats.loss, rel=1e-12)
        assert all(p.grad is None for p in teacher_model.parameters())


@pytest.mark.parametrize(("student", "teacher"), [PAIRS[0], PAIRS[2]])
def test_teeth_the_distill_term_matters_and_the_per_microbatch_rule_fails(student, teacher):
    model, teacher_model, batch = _setup(student, teacher)
    loss_fn = DistillLoss(student, weight=1.0)
    sizes = [2, 5, 1]
    scale = window_loss_scale(sizes, 4, "linear")
    reference = full_batch_gradients(model, loss_fn, batch, scale, [TeacherFeatures(teacher_model)])
    # the plain loss's gradient is not the distilled one: the teacher changes the update
    plain = full_batch_gradients(model, create_loss(student), batch, scale)
    model.zero_grad(set_to_none=True)
    for name, grad in plain.items():
        model.get_parameter(name).grad = grad.clone()
    assert "text.transformer.resblocks.0.attn.in_proj_weight" in failures(model, reference)
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                   reference_batch_size=4, terms=[TeacherFeatures(teacher_model)])
    wrong = failures(model, reference)
    assert "logit_scale" in wrong and any(name.startswith("visual.blocks") for name in wrong)


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_the_teacher_runs_once_per_microbatch_in_eval_mode(method):
    model, teacher_model, batch = _setup("clip", "clip")
    calls: list[bool] = []
    handle = teacher_model.register_forward_hook(lambda module, args, out: calls.append(module.training))
    teacher_model.train()
    try:
        accumulate_gradients(model, DistillLoss("clip"), split_batch(batch, [4, 1, 3]), method=method,
                             terms=[TeacherFeatures(teacher_model)])
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
        teacher_model.eval()
    assert calls == [False, False, False]


def test_a_teacher_needs_a_distillation_loss_and_back():
    model, teacher_model, batch = _setup("clip", "clip")
    microbatches = split_batch(batch, [5, 3])
    with pytest.raises(ValueError, match="needs a teacher"):
        accumulate_gradients(model, create_loss("clip"), microbatches, terms=[TeacherFeatures(teacher_model)])
    with pytest.raises(ValueError, match="needs a teacher"):
        accumulate_gradients(model, DistillLoss("clip"), microbatches)
    model.zero_grad(set_to_none=True)
    assert torch.is_grad_enabled()


def _own_inputs_setup(num_examples: int = 8):
    """A tiny student (patches of 4 px, 16 tokens) and a teacher with patches of 8 px and 24 tokens, which reads its
    own inputs of the same rows (`teacher_inputs`)."""
    model = tiny_model(False)
    torch.manual_seed(2)
    teacher_model = create_model("tiny", patch_size=8, context_length=24).to(torch.float64).eval()
    batch = naflex_window(num_examples, seed=5)
    batch[TEACHER_INPUTS] = random_naflex_batch(num_examples, patch_size=8, context_length=24,
                                                generator=torch.Generator().manual_seed(6))
    return model, teacher_model, batch


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_a_teacher_with_its_own_inputs_equals_the_full_batch_and_the_per_microbatch_rule_fails(method):
    model, teacher_model, batch = _own_inputs_setup()
    loss_fn = DistillLoss("clip", weight=1.0, tile_size=3)
    sizes = [3, 1, 4]
    scale = window_loss_scale(sizes, 4, "linear")
    reference = full_batch_gradients(model, loss_fn, batch, scale, [TeacherFeatures(teacher_model)])
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear", reference_batch_size=4,
                         method=method, terms=[TeacherFeatures(teacher_model)])
    assert failures(model, reference) == {}
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                   reference_batch_size=4, terms=[TeacherFeatures(teacher_model)])
    wrong = failures(model, reference)
    model.zero_grad(set_to_none=True)
    assert "logit_scale" in wrong and any(name.startswith("visual.blocks") for name in wrong)


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_a_teacher_with_its_own_inputs_reads_them_once_per_microbatch(method):
    model, teacher_model, batch = _own_inputs_setup()
    read: list[tuple[int, int, int]] = []  # (rows, patch dim, text length) of each teacher forward
    handle = teacher_model.register_forward_hook(
        lambda module, args, kwargs, out: read.append((kwargs["image"]["patches"].shape[0],
                                                       kwargs["image"]["patches"].shape[2], kwargs["text"].shape[1])),
        with_kwargs=True)
    try:
        accumulate_gradients(model, DistillLoss("clip"), split_batch(batch, [4, 1, 3]), method=method,
                             terms=[TeacherFeatures(teacher_model)])
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    assert read == [(4, 8 * 8 * 3, 24), (1, 8 * 8 * 3, 24), (3, 8 * 8 * 3, 24)]


def test_teacher_inputs_of_other_rows_are_one_line():
    model, teacher_model, batch = _own_inputs_setup()
    microbatches = split_batch(batch, [5, 3])
    microbatches[1][TEACHER_INPUTS] = microbatches[0][TEACHER_INPUTS]
    with pytest.raises(ValueError, match="microbatch 1 has 3 images / 3 texts but its teacher_inputs 5 / 5"):
        accumulate_gradients(model, DistillLoss("clip"), microbatches, terms=[TeacherFeatures(teacher_model)])
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_a_grouped_window_with_a_teacher_reading_its_own_inputs_equals_the_full_batch(method):
    """Several captions per image: the teacher's own inputs are the window's images and every caption."""
    model, teacher_model, _ = _own_inputs_setup()
    batch = random_grouped_batch(7, max_captions=3, generator=torch.Generator().manual_seed(2), patch_size=4,
                                 context_length=16, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    batch[TEACHER_INPUTS] = {
        "image": random_naflex_batch(7, patch_size=8, context_length=24, generator=gen)["image"],
        "text": random_naflex_batch(batch["text"].shape[0], patch_size=8, context_length=24, generator=gen)["text"]}
    loss_fn = MultiPositiveDistillLoss("clip", "symmetric", weight=0.7, tile_size=3)
    sizes = [2, 1, 4]
    scale = window_loss_scale(sizes, 3, "linear")
    reference = full_batch_gradients(model, loss_fn, batch, scale, [TeacherFeatures(teacher_model)])
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear", reference_batch_size=3,
                         method=method, terms=[TeacherFeatures(teacher_model)])
    assert failures(model, reference) == {}
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                   reference_batch_size=3, terms=[TeacherFeatures(teacher_model)])
    wrong = failures(model, reference)
    model.zero_grad(set_to_none=True)
    assert "logit_scale" in wrong
