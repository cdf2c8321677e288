"""Several captions per image in the window (docs/accumulation.md, The window objective): grouped microbatches of
N images and M ≠ N texts, group ids global over the window; for every split and method the accumulated gradient
equals s(W)·∇θ L(W) of the full batch with the multi-positive loss; the per-microbatch rule fails the same check;
with one caption per image the grouped window equals the ordinary one; with a teacher too (the multi-positive loss
plus the distill term)."""

from __future__ import annotations

import pytest
import torch
from window_cases import failures, full_batch_gradients, tiny_model

from naflexclip import MultiPositiveLoss, accumulate_gradients, create_loss, window_loss_scale
from naflexclip.audit.openclip_rule import per_microbatch_scale_gradients
from naflexclip.audit.random_windows import random_grouped_batch
from naflexclip.batch import batch_size, split_batch, text_rows
from naflexclip.loss import MultiPositiveDistillLoss
from naflexclip.window import TeacherFeatures

KINDS = [("clip", "symmetric"), ("siglip", "symmetric"), ("siglip", "asymmetric"), ("siglip", "soft")]


def _batch(num_images: int = 7, seed: int = 2, max_captions: int = 3) -> dict:
    return random_grouped_batch(num_images, max_captions=max_captions, generator=torch.Generator().manual_seed(seed),
                                patch_size=4, context_length=16, dtype=torch.float64)


@pytest.mark.parametrize(("kind", "weighting"), KINDS)
@pytest.mark.parametrize("method", ["cache", "replay"])
def test_grouped_window_equals_the_full_batch_for_every_split(kind, weighting, method):
    model, batch = tiny_model(kind == "siglip"), _batch()
    assert text_rows(batch) != batch_size(batch)
    loss_fn = MultiPositiveLoss(kind, weighting, tile_size=3)
    for sizes in ([7], [2, 1, 4]):
        scale = window_loss_scale(sizes, 3, "linear")
        reference = full_batch_gradients(model, loss_fn, batch, scale)
        model.zero_grad(set_to_none=True)
        stats = accumulate_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                     reference_batch_size=3, method=method)
        assert stats.num_examples == 7 and stats.scale == scale
        assert failures(model, reference) == {}, sizes


@pytest.mark.parametrize(("kind", "weighting", "method"), [("clip", "symmetric", "cache"),
                                                            ("siglip", "asymmetric", "replay")])
def test_grouped_distilled_window_equals_the_full_batch_and_the_per_microbatch_rule_fails(kind, weighting, method):
    model, batch = tiny_model(kind == "siglip"), _batch()
    teacher = tiny_model(kind == "siglip", seed=1)  # another initialisation: another model
    loss_fn = MultiPositiveDistillLoss(kind, weighting, weight=0.7, tile_size=3)
    for sizes in ([7], [2, 1, 4]):
        scale = window_loss_scale(sizes, 3, "linear")
        reference = full_batch_gradients(model, loss_fn, batch, scale, [TeacherFeatures(teacher)])
        model.zero_grad(set_to_none=True)
        stats = accumulate_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                     reference_batch_size=3, method=method, terms=[TeacherFeatures(teacher)])
        assert failures(model, reference) == {}, sizes
        assert set(stats.terms) == {"contrastive", "distill"} and stats.terms["distill"] > 0
        assert all(p.grad is None for p in teacher.parameters())
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                   reference_batch_size=3, terms=[TeacherFeatures(teacher)])
    wrong = failures(model, reference)
    assert "logit_scale" in wrong and any(name.startswith("visual.blocks") for name in wrong)
    # teeth: the teacher changes the update (the multi-positive loss alone is not this window's objective)
    model.zero_grad(set_to_none=True)
    for name, grad in full_batch_gradients(model, MultiPositiveLoss(kind, weighting), batch, scale).items():
        model.get_parameter(name).grad = grad.clone()
    assert failures(model, reference)
    model.zero_grad(set_to_none=True)


def test_teeth_the_per_microbatch_rule_and_one_hot_targets_fail():
    model, batch = tiny_model(True), _batch()
    loss_fn = MultiPositiveLoss("siglip")
    sizes = [2, 1, 4]
    scale = window_loss_scale(sizes, 3, "linear")
    reference = full_batch_gradients(model, loss_fn, batch, scale)
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, split_batch(batch, sizes), loss_scale="linear",
                                   reference_batch_size=3)
    wrong = failures(model, reference)
    assert "logit_scale" in wrong and any(name.startswith("visual.blocks") for name in wrong)


def test_one_caption_per_image_equals_the_ordinary_window():
    model, batch = tiny_model(False), _batch(max_captions=1)
    assert text_rows(batch) == batch_size(batch)
    plain = {"image": batch["image"], "text": batch["text"]}
    reference = full_batch_gradients(model, create_loss("clip"), plain, 1.0)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, MultiPositiveLoss("clip"), split_batch(batch, [3, 4]))
    assert failures(model, reference) == {}
    model.zero_grad(set_to_none=True)


def test_group_ids_need_a_multi_positive_loss_and_back():
    model, batch = tiny_model(False), _batch()
    with pytest.raises(ValueError, match="group ids .* go with a multi-positive loss"):
        accumulate_gradients(model, create_loss("clip"), split_batch(batch, [3, 4]))
    plain = {"image": batch["image"], "text": batch["text"][:7]}
    with pytest.raises(ValueError, match="go with a multi-positive loss"):
        accumulate_gradients(model, MultiPositiveLoss("clip"), split_batch(plain, [3, 4]))


def test_verify_proves_a_multi_positive_window(capsys: pytest.CaptureFixture) -> None:
    from naflexclip.cli import main

    assert main(["verify", "--multi-positive", "--splits", "1", "--accum-freq", "3", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "multi-positive InfoNCE (symmetric)" in out
    assert main(["verify", "--multi-positive", "--distill-model", "tiny", "--splits", "1", "--accum-freq", "2",
                 "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "multi-positive InfoNCE" in out and "distilling from --distill-model tiny" in out
