"""Multi-positive losses (several captions per image, group ids global over the window): tiled equals the dense
definition for any tile, N ≠ M; unique ids give the ordinary CLIP and SigLIP losses; the per-rank parts sum to the
whole loss and gradient; a row with no positive is one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_loss_tiled import _LargestTensor

from naflexclip.loss import (
    DistillLoss,
    MultiPositiveDistillLoss,
    MultiPositiveLoss,
    clip_loss_dense,
    distill_term_dense,
    multi_positive_clip_loss_dense,
    multi_positive_siglip_loss_dense,
    pairwise_logits,
    siglip_loss_dense,
)

KINDS = [("clip", "symmetric"), ("siglip", "symmetric"), ("siglip", "asymmetric"), ("siglip", "soft")]


def _dense(kind: str, weighting: str):
    if kind == "clip":
        return multi_positive_clip_loss_dense
    return lambda *inputs: multi_positive_siglip_loss_dense(*inputs, weighting=weighting)


def _window(captions: list[int], d: int = 5, seed: int = 0, bias: float | None = -1.0):
    """Images with `captions[i]` captions each, texts in shuffled order; group ids are arbitrary integers."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(1000, generator=gen)[: len(captions)] * 7
    text_groups = torch.cat([ids[i].repeat(k) for i, k in enumerate(captions)])
    text_groups = text_groups[torch.randperm(len(text_groups), generator=gen)]
    image = F.normalize(torch.randn(len(captions), d, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    text = F.normalize(torch.randn(len(text_groups), d, generator=gen, dtype=torch.float64),
                       dim=-1).requires_grad_()
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    bias_t = None if bias is None else torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    return [image, text, scale, bias_t, ids, text_groups]


def _value_and_grads(value: torch.Tensor, inputs: list) -> list[torch.Tensor]:
    live = [t for t in inputs[:4] if t is not None]
    return [value.detach(), *torch.autograd.grad(value, live)]


def _close(ours, reference, rtol: float = 1e-12) -> bool:
    return all(torch.allclose(a, b, rtol=rtol, atol=rtol * max(float(b.abs().max()), 1e-3))
               for a, b in zip(ours, reference, strict=True))


@pytest.mark.parametrize(("kind", "weighting"), KINDS)
@pytest.mark.parametrize("tile", [1, 3, 64])
def test_tiled_multi_positive_equals_dense_with_n_not_m(kind, weighting, tile):
    inputs = _window([1, 3, 2, 5, 1, 2], seed=tile)  # 6 images, 14 captions
    reference = _value_and_grads(_dense(kind, weighting)(*inputs), inputs)
    ours = _value_and_grads(MultiPositiveLoss(kind, weighting, tile_size=tile)(*inputs), inputs)
    assert _close(ours, reference)


@pytest.mark.parametrize(("kind", "weighting"), KINDS)
def test_unique_ids_give_the_ordinary_loss(kind, weighting):
    inputs = _window([1] * 7, seed=3)
    image, text, scale, bias, image_groups, text_groups = inputs
    order = torch.argsort(text_groups)[torch.argsort(torch.argsort(image_groups))]  # text of image i at row i
    aligned = [image, text[order], scale, bias]
    ordinary = (clip_loss_dense if kind == "clip" else siglip_loss_dense)(*aligned)
    ours = MultiPositiveLoss(kind, weighting, tile_size=2)(image, text, scale, bias, image_groups, text_groups)
    assert torch.allclose(ours, ordinary, rtol=1e-12)
    # teeth: with a shared group (two images, one group) the loss differs
    shared = image_groups.clone()
    shared[1] = shared[0]
    text_shared = text_groups.clone()
    text_shared[text_groups == image_groups[1]] = shared[0]
    assert not torch.allclose(MultiPositiveLoss(kind, weighting)(image, text, scale, bias, shared, text_shared),
                              ours)


@pytest.mark.parametrize(("kind", "weighting"), KINDS)
@pytest.mark.parametrize("image_rows_per_rank", [[2, 1, 3], [1, 4, 1]])
def test_sharded_multi_positive_parts_sum_to_the_whole(kind, weighting, image_rows_per_rank):
    inputs = _window([1, 3, 2, 5, 1, 2], seed=len(image_rows_per_rank))
    image, text, scale, bias, image_groups, text_groups = inputs
    reference = _value_and_grads(_dense(kind, weighting)(*inputs), inputs)
    column_lse = pairwise_logits(image, text, scale, bias).detach().logsumexp(dim=0)
    text_rows_per_rank = [5, 0, 9] if image_rows_per_rank[0] == 2 else [3, 8, 3]  # texts cut otherwise than images
    loss_fn, offset, text_offset, parts = MultiPositiveLoss(kind, weighting, tile_size=2), 0, 0, []
    for rows, texts in zip(image_rows_per_rank, text_rows_per_rank, strict=True):
        part = loss_fn.sharded(image[offset : offset + rows], text, scale, bias, image_groups, text_groups,
                               row_offset=offset, text_rows=(text_offset, text_offset + texts),
                               reduce_column_lse=lambda _: column_lse)
        parts.append(_value_and_grads(part, inputs))
        offset, text_offset = offset + rows, text_offset + texts
    assert _close([sum(values) for values in zip(*parts, strict=True)], reference)


def test_multi_positive_builds_no_n_by_m_tensor():
    captions = [3] * 150  # 150 images, 450 captions
    inputs = _window(captions, d=4)
    with _LargestTensor() as mode:
        MultiPositiveLoss("clip", tile_size=32)(*inputs).backward()
    assert mode.largest <= 450 * 4 < 150 * 450 // 20, mode.largest


def test_a_row_without_a_positive_is_one_line():
    image, text, scale, bias, image_groups, text_groups = _window([2, 1])
    with pytest.raises(ValueError, match=r"image row 1 \(group id \d+\) has no positive in the window"):
        MultiPositiveLoss("siglip")(image, text[:2], scale, bias, image_groups,
                                    torch.full((2,), int(image_groups[0])))
    with pytest.raises(ValueError, match="--multi-positive-weighting: 'hard'"):
        MultiPositiveLoss("siglip", "hard")


def _teacher(image: torch.Tensor, text: torch.Tensor, sigmoid: bool, d: int = 7) -> list[torch.Tensor | None]:
    """Another model's rows for the same images and captions: another width and temperature (constants)."""
    gen = torch.Generator().manual_seed(11)
    rows = [F.normalize(torch.randn(len(t), d, generator=gen, dtype=torch.float64), dim=-1) for t in (image, text)]
    return [*rows, torch.tensor(6.0, dtype=torch.float64),
            torch.tensor(-2.0, dtype=torch.float64) if sigmoid else None]


def _distilled_dense(kind: str, weighting: str, weight: float):
    def dense(image, text, scale, bias, t_image, t_text, t_scale, t_bias, image_groups, text_groups):
        contrastive = _dense(kind, weighting)(image, text, scale, bias, image_groups, text_groups)
        distill = distill_term_dense(kind, image, text, scale, bias, t_image, t_text, t_scale, t_bias)
        return torch.stack([contrastive, weight * distill])
    return dense


@pytest.mark.parametrize(("kind", "weighting"), KINDS)
@pytest.mark.parametrize("tile", [2, 64])
def test_multi_positive_distillation_is_the_sum_of_the_two_terms_with_n_not_m(kind, weighting, tile):
    image, text, scale, bias, image_groups, text_groups = _window([1, 3, 2, 5, 1, 2], seed=tile)
    inputs = [image, text, scale, bias, *_teacher(image, text, kind == "siglip"), image_groups, text_groups]
    reference = _value_and_grads(_distilled_dense(kind, weighting, 0.7)(*inputs).sum(), inputs)
    loss_fn = MultiPositiveDistillLoss(kind, weighting, weight=0.7, tile_size=tile)
    ours = _value_and_grads(loss_fn(*inputs).sum(), inputs)
    assert _close(ours, reference)
    # teeth: the square distill kernel's normalisation (M texts taken for N images) is not this term
    square = distill_term_dense(kind, image, text, scale, bias, *inputs[4:8]) * len(text) / len(image)
    assert not torch.allclose(loss_fn(*inputs)[1], 0.7 * square, rtol=1e-6)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_multi_positive_distillation_with_one_caption_each_is_distillation(kind):
    image, text, scale, bias, image_groups, text_groups = _window([1] * 7, seed=3, bias=-1.0 if kind == "siglip"
                                                                  else None)
    order = torch.argsort(text_groups)[torch.argsort(torch.argsort(image_groups))]  # text of image i at row i
    teacher = _teacher(image, text[order], kind == "siglip")
    ours = MultiPositiveDistillLoss(kind, weight=0.5, tile_size=2)(image, text[order], scale, bias, *teacher,
                                                                   image_groups, image_groups)
    assert torch.allclose(ours, DistillLoss(kind, 0.5)(image, text[order], scale, bias, *teacher), rtol=1e-12)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_sharded_multi_positive_distillation_parts_sum_to_the_whole(kind):
    image, text, scale, bias, image_groups, text_groups = _window([1, 3, 2, 5, 1, 2], seed=5)
    teacher = _teacher(image, text, kind == "siglip")
    inputs = [image, text, scale, bias, *teacher, image_groups, text_groups]
    reference = _value_and_grads(_distilled_dense(kind, "symmetric", 1.3)(*inputs).sum(), inputs)
    # the column log-sum-exps over every rank's rows: the student's [M], or (student, teacher) [2, M]
    student_lse = pairwise_logits(image, text, scale, bias).detach().logsumexp(dim=0)
    both_lse = torch.stack([student_lse,
                            pairwise_logits(teacher[0], teacher[1], teacher[2], None).logsumexp(dim=0)])
    loss_fn, offset, text_offset, parts = MultiPositiveDistillLoss(kind, weight=1.3, tile_size=2), 0, 0, []
    for rows, texts in ((2, 5), (1, 0), (3, 9)):  # texts cut otherwise than images
        part = loss_fn.sharded(image[offset : offset + rows], text, scale, bias, teacher[0][offset : offset + rows],
                               *teacher[1:], image_groups, text_groups, row_offset=offset,
                               text_rows=(text_offset, text_offset + texts),
                               reduce_column_lse=lambda partial: student_lse if partial.dim() == 1 else both_lse)
        parts.append(_value_and_grads(part.sum(), inputs))
        offset, text_offset = offset + rows, text_offset + texts
    assert _close([sum(values) for values in zip(*parts, strict=True)], reference)
