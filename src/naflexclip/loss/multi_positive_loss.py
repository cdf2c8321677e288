"""Several positives per row (captions that share an image), group ids global over the window: the multi-positive
InfoNCE (CLIP) and SigLIP+ (SigLIP), tiled, with the per-rank form; their dense references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.loss.contrastive import loss_choice, pairwise_logits
from naflexclip.loss.distill_loss import DistillLoss
from naflexclip.loss.tiling import (
    DEFAULT_TILE_SIZE,
    check_tile_size,
    logit_block,
    no_reduction,
    scalar_values,
    tile_ranges,
    tiled_gradients,
)

MULTI_POSITIVE_WEIGHTINGS = {"symmetric": (0.5, 0.5), "asymmetric": (1.0, 0.0), "soft": (0.5, 0.5)}


def positive_counts(image_groups: torch.Tensor, text_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`k_i`, the texts of image i's group, and `k'_j`, the images of text j's group, over the whole window;
    ValueError naming the first image or text with no positive."""
    _, inverse = torch.unique(torch.cat([image_groups, text_groups]), return_inverse=True)
    image_ids, text_ids = inverse[: image_groups.shape[0]], inverse[image_groups.shape[0] :]
    size = int(inverse.max()) + 1 if inverse.numel() else 0
    texts_per_group = torch.bincount(text_ids, minlength=size)
    images_per_group = torch.bincount(image_ids, minlength=size)
    per_image, per_text = texts_per_group[image_ids], images_per_group[text_ids]
    for what, counts, groups in (("image", per_image, image_groups), ("text", per_text, text_groups)):
        missing = (counts == 0).nonzero()
        if missing.numel():
            row = int(missing[0])
            raise ValueError(f"{what} row {row} (group id {int(groups[row])}) has no positive in the window: every "
                             f"image needs a caption of its group and every caption its image")
    return per_image, per_text


def multi_positive_targets(image_groups: torch.Tensor, text_groups: torch.Tensor) -> torch.Tensor:
    """`Y_ij = [group of image i == group of text j]`, `[N, M]` (dense reference only)."""
    return (image_groups[:, None] == text_groups[None, :]).to(torch.float64)


def multi_positive_clip_loss_dense(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor,
) -> torch.Tensor:
    """Reference: the multi-positive InfoNCE over `[N, M]` logits, uniform targets over each row's (and column's)
    positives, the directions averaged."""
    logits = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
    targets = multi_positive_targets(image_groups, text_groups).to(logits.dtype)
    image_to_text = -(targets / targets.sum(1, keepdim=True) * logits.log_softmax(dim=1)).sum(1).mean()
    text_to_image = -(targets / targets.sum(0, keepdim=True) * logits.log_softmax(dim=0)).sum(0).mean()
    return (image_to_text + text_to_image) / 2


def multi_positive_siglip_loss_dense(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor,
    weighting: str = "symmetric",
) -> torch.Tensor:
    """Reference: SigLIP+ over `[N, M]` logits: positives weighted `α/k_i + β/k'_j` (`soft`: that weight as the
    label instead), negatives 1, summed over pairs and divided by `N` like the SigLIP loss."""
    logits = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
    targets = multi_positive_targets(image_groups, text_groups).to(logits.dtype)
    alpha, beta = MULTI_POSITIVE_WEIGHTINGS[weighting]
    weights = targets * (alpha / targets.sum(1, keepdim=True) + beta / targets.sum(0, keepdim=True))
    if weighting == "soft":
        return F.binary_cross_entropy_with_logits(logits, weights, reduction="sum") / logits.shape[0]
    pairs = weights * -F.logsigmoid(logits) + (1 - targets) * -F.logsigmoid(-logits)
    return pairs.sum() / logits.shape[0]


class _TiledMultiPositive(torch.autograd.Function):
    """This rank's part of a multi-positive loss from its logit block `z[I, :]` (its images against all `M` texts),
    with `Y_ij = [g_i == h_j]`, `k_i = Σ_j Y_ij`, `k'_j = Σ_i Y_ij` over the whole window.

    clip (multi-positive InfoNCE, uniform targets over a row's positives), this rank's texts `J`:
        (1/2N) Σ_{i∈I} [lse_j z_ij − Σ_j Y_ij z_ij / k_i] + (1/2M) [Σ_{j∈J} lse_i z_ij − Σ_{i∈I, j} Y_ij z_ij / k'_j]
        dz_ij = (P_ij − Y_ij / k_i) / 2N + (Q_ij − Y_ij / k'_j) / 2M
    siglip (SigLIP+), `w_ij = α/k_i + β/k'_j`:
        (1/N) Σ_{i∈I, j} [Y_ij w_ij softplus(−z_ij) + (1 − Y_ij) softplus(z_ij)],  dz = σ(z) + Y[(w − 1)σ(z) − w]
        soft: (1/N) Σ [softplus(z_ij) − Y_ij w_ij z_ij],  dz = σ(z) − Y w
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor,
        row_offset: int, text_rows: tuple[int, int], kind: str, weighting: str, tile: int,
        reduce_column_lse: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        scale, bias = scalar_values(logit_scale, logit_bias)
        num_rows, num_texts, num_images = image_rows.shape[0], text_features.shape[0], image_groups.shape[0]
        per_image, per_text = (c.to(image_rows.dtype) for c in positive_counts(image_groups, text_groups))
        groups = image_groups[row_offset : row_offset + num_rows]
        inverse_image, inverse_text = 1 / per_image[row_offset : row_offset + num_rows], 1 / per_text
        ctx.kind, ctx.weighting, ctx.tile, ctx.sizes = kind, weighting, tile, (num_images, num_texts)
        # the positive pairs are few (about one per text): their terms are gathered, not built as blocks
        pair_rows, pair_texts = positive_pairs(groups, text_groups)
        z_pairs = scale * (image_rows[pair_rows] * text_features[pair_texts]).sum(-1) + bias
        if kind == "clip":
            row_lse = image_rows.new_empty(num_rows)
            column_lse = image_rows.new_full((num_texts,), float("-inf"))
            for i0, i1 in tile_ranges(num_rows, tile):
                lse = None
                for j0, j1 in tile_ranges(num_texts, tile):
                    z = logit_block(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                    block_rows = torch.logsumexp(z, dim=1)
                    lse = block_rows if lse is None else torch.logaddexp(lse, block_rows)
                    column_lse[j0:j1] = torch.logaddexp(column_lse[j0:j1], torch.logsumexp(z, dim=0))
                    del z  # not held while the next block is made
                assert lse is not None  # every row tile meets at least one column tile
                row_lse[i0:i1] = lse
            column_lse = reduce_column_lse(column_lse)
            t0, t1 = text_rows
            # (1/2N) Σ Y z / k_i + (1/2M) Σ Y z / k'_j over the positive pairs
            positives = (_pair_weights(kind, weighting, inverse_image, inverse_text, pair_rows, pair_texts,
                                       ctx.sizes) * z_pairs).sum()
            loss = row_lse.sum() / (2 * num_images) + column_lse[t0:t1].sum() / (2 * num_texts) - positives
            ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, groups, text_groups,
                                  inverse_image, inverse_text, pair_rows, pair_texts, row_lse, column_lse)
            return loss
        total = image_rows.new_zeros(())
        for i0, i1 in tile_ranges(num_rows, tile):
            for j0, j1 in tile_ranges(num_texts, tile):
                # every pair as a negative first: softplus(z) = −log σ(−z), exact for every z (see _TiledSigLip)
                total -= F.logsigmoid(logit_block(image_rows[i0:i1], text_features[j0:j1], -scale, -bias)).sum()
        w = _pair_weights(kind, weighting, inverse_image, inverse_text, pair_rows, pair_texts, ctx.sizes)
        if weighting == "soft":  # softplus(z) − Y w z
            total -= (w * z_pairs).sum()
        else:  # a positive's w softplus(−z) = w (softplus(z) − z) in place of its softplus(z)
            total += ((w - 1) * -F.logsigmoid(-z_pairs) - w * z_pairs).sum()
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, groups, text_groups,
                              inverse_image, inverse_text, pair_rows, pair_texts)
        return total / num_images

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        image_rows, text_features, logit_scale, logit_bias, _, _, inverse_image, inverse_text, pair_rows, \
            pair_texts = ctx.saved_tensors[:10]
        scale, bias = scalar_values(logit_scale, logit_bias)
        num_images, num_texts = ctx.sizes
        w = _pair_weights(ctx.kind, ctx.weighting, inverse_image, inverse_text, pair_rows, pair_texts, ctx.sizes)
        if ctx.kind == "clip":
            row_lse, column_lse = ctx.saved_tensors[10:]

            def block_dz(x: torch.Tensor, y: torch.Tensor, rows: slice, columns: slice) -> torch.Tensor:
                z = logit_block(x, y, scale, bias)
                dz = (z - row_lse[rows, None]).exp_().div_(2 * num_images)  # P / 2N
                return dz.add_(z.sub_(column_lse[None, columns]).exp_(), alpha=1 / (2 * num_texts))  # + Q / 2M

            pair_dz = -w  # − Y/(2N k_i) − Y/(2M k'_j)
        else:
            def block_dz(x: torch.Tensor, y: torch.Tensor, rows: slice, columns: slice) -> torch.Tensor:
                return logit_block(x, y, scale, bias).sigmoid_().div_(num_images)  # every pair as a negative

            z_pairs = scale * (image_rows[pair_rows] * text_features[pair_texts]).sum(-1) + bias
            # a positive's dz: soft σ − w, else w (σ − 1); less the negative's σ counted in the blocks
            pair_dz = (-w if ctx.weighting == "soft" else (w - 1) * z_pairs.sigmoid() - w) / num_images
        grads = tiled_gradients(ctx, grad_out, block_dz, diagonal=0, norm=1.0, pairs=(pair_rows, pair_texts, pair_dz))
        return (*grads, None, None, None, None, None, None, None, None)


def positive_pairs(image_groups: torch.Tensor, text_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every positive pair `(i, j)` (image i's group is text j's), as index vectors, without an `N × M` tensor: the
    texts sorted by group, each image's run of them found by binary search."""
    order = torch.argsort(text_groups, stable=True)
    sorted_groups = text_groups[order]
    starts = torch.searchsorted(sorted_groups, image_groups)
    counts = torch.searchsorted(sorted_groups, image_groups, right=True) - starts
    rows = torch.repeat_interleave(torch.arange(len(image_groups), device=image_groups.device), counts)
    within = torch.arange(len(rows), device=rows.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return rows, order[torch.repeat_interleave(starts, counts) + within]


def _pair_weights(kind: str, weighting: str, inverse_image: torch.Tensor, inverse_text: torch.Tensor,
                  pair_rows: torch.Tensor, pair_texts: torch.Tensor, sizes: tuple[int, int]) -> torch.Tensor:
    """The positive pairs' weights: clip `1/(2N k_i) + 1/(2M k'_j)`; siglip `α/k_i + β/k'_j`."""
    if kind == "clip":
        return inverse_image[pair_rows] / (2 * sizes[0]) + inverse_text[pair_texts] / (2 * sizes[1])
    alpha, beta = MULTI_POSITIVE_WEIGHTINGS[weighting]
    return alpha * inverse_image[pair_rows] + beta * inverse_text[pair_texts]


class MultiPositiveLoss(nn.Module):
    """Several positives per row from group ids that are global over the window: `N` images and `M` texts, image
    i and text j a positive pair when their group ids are equal (a caption of an image's own group), tiled, with
    the per-rank form.

    kind `clip`: the multi-positive InfoNCE — the cross-entropy of each softmax row (and column) against the
    uniform distribution over its positives (the multi-positive contrastive loss of StableRep, Tian et al. 2023,
    https://arxiv.org/abs/2306.00984), the two directions averaged, image→text over `N` rows, text→image over `M`.
    kind `siglip`: SigLIP+ — every pair's sigmoid loss, positives weighted `α/k_i + β/k'_j` (`k_i`: image i's
    captions, `k'_j`: text j's images), summed and divided by `N`; weighting `symmetric` α = β = ½, `asymmetric`
    α = 1, β = 0; `soft` uses the symmetric weight as the pair's label instead (binary cross-entropy with
    `y_ij = Y_ij (½/k_i + ½/k'_j)`). With one caption per image (unique ids) each is the ordinary loss."""

    takes_groups = True

    def __init__(self, kind: str, weighting: str = "symmetric", tile_size: int = DEFAULT_TILE_SIZE) -> None:
        super().__init__()
        loss_choice(kind)
        if weighting not in MULTI_POSITIVE_WEIGHTINGS:
            raise ValueError(f"--multi-positive-weighting: {weighting!r} is not one of "
                             f"{sorted(MULTI_POSITIVE_WEIGHTINGS)}")
        self.kind, self.weighting, self.tile_size = kind, weighting, check_tile_size(tile_size)

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor
                ) -> torch.Tensor:
        """image_features `[N, D]`, text_features `[M, D]`, group ids `[N]` and `[M]` → the scalar loss."""
        return self.sharded(image_features, text_features, logit_scale, logit_bias, image_groups, text_groups,
                            row_offset=0, text_rows=(0, text_features.shape[0]))

    def sharded(self, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor, *,
                row_offset: int, text_rows: tuple[int, int] | None = None,
                reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = no_reduction) -> torch.Tensor:
        """This rank's part: image rows `[row_offset, row_offset + n)` of the window's `N` (`image_groups`: all
        `N` ids) against all `M` texts (`text_groups`: their ids); `text_rows`: the `[start, end)` of the texts
        this rank owns (their text→image terms; default the same range as its images)."""
        num_rows, num_images = image_rows.shape[0], image_groups.shape[0]
        if (image_rows.dim() != 2 or text_features.dim() != 2 or image_rows.shape[1] != text_features.shape[1]
                or text_groups.shape != (text_features.shape[0],) or not 0 <= row_offset <= num_images - num_rows):
            raise ValueError(f"multi-positive inputs do not fit: image rows {tuple(image_rows.shape)} at "
                             f"{row_offset} of {num_images} group ids, texts {tuple(text_features.shape)} with "
                             f"{tuple(text_groups.shape)} group ids")
        text_rows = text_rows if text_rows is not None else (row_offset, row_offset + num_rows)
        return _TiledMultiPositive.apply(image_rows, text_features, logit_scale, logit_bias, image_groups,
                                         text_groups, row_offset, tuple(text_rows), self.kind, self.weighting,
                                         self.tile_size, reduce_column_lse)


class MultiPositiveDistillLoss(nn.Module):
    """Distillation with several captions per image: the window's objective is the sum of the two window terms,
    `[contrastive, weight · distill]` — the multi-positive loss of the student (`MultiPositiveLoss`) and the
    distill term of `DistillLoss` over the `N × M` logits (clip: the teacher's softmax rows over the `M` texts, mean
    over `N`, and columns over the `N` images, mean over `M`; siglip: every pair's BCE against the teacher's
    probability, / N). Group ids and the teacher's rows as the two losses take them; tiled, with the per-rank form.
    With one caption per image it is `DistillLoss`."""

    term_names = ("contrastive", "distill")
    takes_teacher = True
    takes_groups = True

    def __init__(self, kind: str, weighting: str = "symmetric", weight: float = 1.0,
                 tile_size: int = DEFAULT_TILE_SIZE) -> None:
        super().__init__()
        self.contrastive = MultiPositiveLoss(kind, weighting, tile_size)
        self.distill = DistillLoss(kind, weight, tile_size)

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None, teacher_image_features: torch.Tensor,
                teacher_text_features: torch.Tensor, teacher_logit_scale: torch.Tensor,
                teacher_logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor
                ) -> torch.Tensor:
        """Student `[N, D]` / `[M, D]` rows and scalars, the teacher's likewise, group ids `[N]` and `[M]` →
        `[contrastive, weight·distill]`."""
        return self.sharded(image_features, text_features, logit_scale, logit_bias, teacher_image_features,
                            teacher_text_features, teacher_logit_scale, teacher_logit_bias, image_groups,
                            text_groups, row_offset=0, text_rows=(0, text_features.shape[0]))

    def sharded(self, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None, teacher_image_rows: torch.Tensor,
                teacher_text_features: torch.Tensor, teacher_logit_scale: torch.Tensor,
                teacher_logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor, *,
                row_offset: int, text_rows: tuple[int, int] | None = None,
                reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = no_reduction) -> torch.Tensor:
        """This rank's part, as `MultiPositiveLoss.sharded` (its image rows, every text, its texts `text_rows`)."""
        text_rows = text_rows if text_rows is not None else (row_offset, row_offset + image_rows.shape[0])
        contrastive = self.contrastive.sharded(image_rows, text_features, logit_scale, logit_bias, image_groups,
                                               text_groups, row_offset=row_offset, text_rows=text_rows,
                                               reduce_column_lse=reduce_column_lse)
        terms = self.distill.sharded(image_rows, text_features, logit_scale, logit_bias, teacher_image_rows,
                                     teacher_text_features, teacher_logit_scale, teacher_logit_bias,
                                     row_offset=row_offset, reduce_column_lse=reduce_column_lse,
                                     num_images=image_groups.shape[0], text_rows=text_rows)
        return torch.stack([contrastive, terms[1]])  # the distill kernel's one-hot term is not this window's
