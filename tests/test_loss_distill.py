"""The distillation losses: at one window the CLIP one equals OpenCLIP's `DistillClipLoss` (loss and every
gradient, float64), both equal their dense formulas for any tile size, never build an N×N tensor of either model,
and their per-rank parts sum to the whole loss and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss
from test_loss_tiled import _LargestTensor, _PeakLiveBytes

from naflexclip.loss import (
    DistillLoss,
    create_loss,
    distill_clip_loss_dense,
    distill_siglip_loss_dense,
    pairwise_logits,
)

DENSE = {"clip": distill_clip_loss_dense, "siglip": distill_siglip_loss_dense}


def _features(n: int, d: int, seed: int, scale: float, bias: float | None) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)
    return [image, text, torch.tensor(scale, dtype=torch.float64),
            None if bias is None else torch.tensor(bias, dtype=torch.float64)]


def _inputs(kind: str, n: int, seed: int = 0, d: int = 6, teacher_d: int = 9) -> list[torch.Tensor | None]:
    bias = -2.0 if kind == "siglip" else None
    student = [t.requires_grad_() if t is not None else None for t in _features(n, d, seed, 4.0, bias)]
    # a different width and temperature: the teacher is another model
    teacher = _features(n, teacher_d, seed + 1, 7.0, -3.0 if kind == "siglip" else None)
    return student + teacher


def _value_and_grads(terms: torch.Tensor, inputs: list) -> list[torch.Tensor]:
    live = [t for t in inputs[:4] if t is not None]
    return [terms.detach(), *torch.autograd.grad(terms.sum(), live)]


def _close(ours: list[torch.Tensor], reference: list[torch.Tensor], rtol: float = 1e-12) -> bool:
    return all(torch.allclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))
               for a, b in zip(ours, reference, strict=True))


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("weight", [1.0, 0.3])
def test_clip_distillation_equals_open_clip_distill_clip_loss(n, weight):
    inputs = _inputs("clip", n, seed=n)
    image, text, scale, _, teacher_image, teacher_text, teacher_scale, _ = inputs
    contrastive, distill = DistillClipLoss()(image, text, scale, teacher_image, teacher_text, teacher_scale)
    reference = _value_and_grads(torch.stack([contrastive, weight * distill]), inputs)
    ours = _value_and_grads(DistillLoss("clip", weight, tile_size=4)(*inputs), inputs)
    assert _close(ours, reference)
    if n == 1:
        return
    # teeth: a teacher whose texts are shuffled gives another distill term
    shuffled = DistillLoss("clip", weight)(*inputs[:5], teacher_text.flip(0), *inputs[6:])
    assert not torch.allclose(shuffled[1], reference[0][1])


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("tile", [1, 3, 5, 64])
def test_tiled_distillation_equals_dense_for_any_tile(kind, tile):
    inputs = _inputs(kind, 13, seed=tile)
    reference = _value_and_grads(DENSE[kind](*inputs), inputs)
    assert _close(_value_and_grads(DistillLoss(kind, tile_size=tile)(*inputs), inputs), reference)


def test_siglip_distillation_is_the_soft_label_bce():
    # the definition the docs state: softplus(z) − p·z summed over pairs, / N; with 0/1 labels it is SigLIP
    inputs = _inputs("siglip", 6)
    image, text, scale, bias, teacher_image, teacher_text, teacher_scale, teacher_bias = inputs
    z = pairwise_logits(image, text, scale, bias).detach()
    p = pairwise_logits(teacher_image, teacher_text, teacher_scale, teacher_bias).sigmoid()
    expected = (F.softplus(z) - p * z).sum() / 6
    assert torch.allclose(DistillLoss("siglip")(*inputs)[1], expected, rtol=1e-12)
    # a teacher that is the identity pairing (p = δ) makes the distill term the SigLIP loss itself
    eye = torch.eye(6, dtype=torch.float64)
    hard = F.binary_cross_entropy_with_logits(z, eye, reduction="sum") / 6
    assert torch.allclose(DistillLoss("siglip")(*inputs)[0], hard, rtol=1e-12)


def test_a_siglip_student_needs_a_sigmoid_teacher():
    inputs = _inputs("siglip", 4)
    with pytest.raises(ValueError, match="teacher has no logit_bias"):
        DistillLoss("siglip")(*inputs[:7], None)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_distillation_builds_no_n_by_n_tensor(kind):
    n, tile = 400, 32
    inputs = _inputs(kind, n, d=4, teacher_d=4)
    with _LargestTensor() as mode:
        DistillLoss(kind, tile_size=tile)(*inputs).sum().backward()
    assert mode.largest <= max(2 * tile * tile, 2 * n) < n * n // 50, mode.largest


@pytest.mark.parametrize(("kind", "extra_blocks"), [("clip", 1), ("siglip", 0)])
def test_distillation_holds_at_most_one_block_more_than_the_plain_loss(kind, extra_blocks):
    # the teacher's blocks are made beside the student's one at a time and none is held while the next is made:
    # at the peak a CLIP backward holds the teacher's P' + Q' beside the student's two blocks, a SigLIP one no more
    # than its plain loss; beyond that only O(N) statistics (the teacher's log-sum-exps). Before, the teacher's
    # blocks were held with the student's and each block while the next was made (CLIP +2.1 blocks, SigLIP +1).
    n, d, tile = 1024, 8, 128
    student = _features(n, d, 0, 14.0, -10.0 if kind == "siglip" else None)
    student = [t.float().requires_grad_() if t is not None else None for t in student]
    teacher = [t.float() for t in _features(n, d, 1, 20.0, -8.0)]
    peaks = {}
    for name, run in (("plain", lambda: create_loss(kind, tile)(*student)),
                      ("distill", lambda: DistillLoss(kind, tile_size=tile)(*student, *teacher).sum())):
        with _PeakLiveBytes() as mode:
            run().backward()
        peaks[name] = mode.peak
    block, statistics = tile * tile * 4, 4 * n * 4
    assert peaks["distill"] - peaks["plain"] <= extra_blocks * block + statistics, (peaks, block)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("rows_per_rank", [[3, 1, 5], [1, 6, 2, 3]])
def test_sharded_distillation_parts_sum_to_the_whole(kind, rows_per_rank):
    n = sum(rows_per_rank)
    inputs = _inputs(kind, n, seed=n)
    image, text, scale, bias, teacher_image, teacher_text, teacher_scale, teacher_bias = inputs
    reference = _value_and_grads(DENSE[kind](*inputs), inputs)
    student = pairwise_logits(image, text, scale, bias).detach()
    teacher = pairwise_logits(teacher_image, teacher_text, teacher_scale, None)
    full_columns = torch.stack([student.logsumexp(dim=0), teacher.logsumexp(dim=0)])
    loss_fn, offset, parts = DistillLoss(kind, tile_size=2), 0, []
    for rows in rows_per_rank:
        own = slice(offset, offset + rows)
        part = loss_fn.sharded(image[own], text, scale, bias, teacher_image[own], teacher_text, teacher_scale,
                               teacher_bias, row_offset=offset, reduce_column_lse=lambda _: full_columns)
        parts.append(_value_and_grads(part, inputs))
        offset += rows
    summed = [sum(values) for values in zip(*parts, strict=True)]
    assert _close(summed, reference)
    # teeth: one rank's part alone is not the whole
    assert not _close(parts[0], reference, rtol=1e-3)
