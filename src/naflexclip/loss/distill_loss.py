"""Distillation from a teacher's features over the whole window: OpenCLIP's `DistillClipLoss` (CLIP) and the
soft-label binary cross-entropy per pair (SigLIP), tiled, with the per-rank form; their dense references."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.loss.contrastive import clip_loss_dense, loss_choice, pairwise_logits, siglip_loss_dense
from naflexclip.loss.tiling import (
    DEFAULT_TILE_SIZE,
    check_shapes,
    check_tile_size,
    diagonal_sum,
    logit_block,
    no_reduction,
    scalar_values,
    tile_ranges,
    tiled_gradients,
)


def distill_clip_loss_dense(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, teacher_image_features: torch.Tensor, teacher_text_features: torch.Tensor,
    teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: `[contrastive, distill]` of OpenCLIP's `DistillClipLoss` through the whole `[N, N]` matrices."""
    distill = distill_term_dense("clip", image_features, text_features, logit_scale, logit_bias,
                                 teacher_image_features, teacher_text_features, teacher_logit_scale, teacher_logit_bias)
    return torch.stack([clip_loss_dense(image_features, text_features, logit_scale, logit_bias), distill])


def distill_term_dense(
    kind: str, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, teacher_image_features: torch.Tensor, teacher_text_features: torch.Tensor,
    teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the distill term alone through the whole `[N, M]` logit matrices (`M ≠ N` allowed). clip: the
    cross-entropy of the student's rows against the teacher's softmax rows (mean over `N`) and of its columns
    against the teacher's columns (mean over `M`), averaged; siglip: Σ of the pairs' BCE against `σ(teacher)`, / N."""
    logits = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
    teacher = pairwise_logits(teacher_image_features, teacher_text_features, teacher_logit_scale, teacher_logit_bias)
    if kind == "siglip":
        return F.binary_cross_entropy_with_logits(logits, teacher.sigmoid(), reduction="sum") / logits.shape[0]

    def cross_entropy(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
        return -(target_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean()

    return (cross_entropy(teacher, logits) + cross_entropy(teacher.T, logits.T)) / 2


def distill_siglip_loss_dense(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, teacher_image_features: torch.Tensor, teacher_text_features: torch.Tensor,
    teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: `[siglip, distill]`, the distill term the binary cross-entropy of every student pair logit
    against the teacher's pair probability `σ(T⟨u_i, v_j⟩ + B)`, summed over pairs and divided by `N`."""
    distill = distill_term_dense("siglip", image_features, text_features, logit_scale, logit_bias,
                                 teacher_image_features, teacher_text_features, teacher_logit_scale, teacher_logit_bias)
    return torch.stack([siglip_loss_dense(image_features, text_features, logit_scale, logit_bias), distill])


def _check_teacher(image_rows: torch.Tensor, text_features: torch.Tensor, teacher_image_rows: torch.Tensor,
                   teacher_text_features: torch.Tensor) -> None:
    if (teacher_image_rows.dim() != 2 or teacher_text_features.dim() != 2
            or teacher_image_rows.shape[1] != teacher_text_features.shape[1]
            or teacher_image_rows.shape[0] != image_rows.shape[0]
            or teacher_text_features.shape[0] != text_features.shape[0]):
        raise ValueError(
            f"teacher features image {tuple(teacher_image_rows.shape)} and text {tuple(teacher_text_features.shape)} "
            f"do not match the student's rows: image {tuple(image_rows.shape)}, text {tuple(text_features.shape)}"
        )


class _TiledDistillClip(torch.autograd.Function):
    """This rank's part of `[contrastive, λ·distill]`, OpenCLIP's `DistillClipLoss`, from the student's logit
    block `z[I, :]` and the teacher's `w[I, :]` (`w_ij = T⟨u_i, v_j⟩`):

        contrastive = (1/2N) [ Σ_{i∈I} (lse_j z_ij − z_ii) + Σ_{j∈I} (lse_i z_ij − z_jj) ]
        distill     = (1/2N) [ Σ_{i∈I} lse_j z_ij + Σ_{j∈I} lse_i z_ij − Σ_{i∈I, j} (P'_ij + Q'_ij) z_ij ]

    `P'`/`Q'` the teacher's row/column softmax (a row's weights sum to 1, so `−Σ_j P'_ij log P_ij` is
    `lse_j z_ij − Σ_j P'_ij z_ij`). The forward walks the blocks twice: the student's and the teacher's row and
    column log-sum-exps first (columns over all ranks' rows, `reduce_column_lse`, both in one exchange), then
    the weighted sums. `dz_ij = [(g_c + λg_d)(P_ij + Q_ij) − λg_d (P'_ij + Q'_ij) − 2 g_c δ_ij] / 2N`; the
    teacher's features are constants (no gradient).

    With `N` images and `M ≠ N` texts (several captions per image) the distill term's text→image part is a mean
    over the `M` texts, this rank's texts `J` (`text_rows`): `(1/2N) Σ_{i∈I} (lse_j z_ij − Σ_j P'_ij z_ij) +
    (1/2M) [Σ_{j∈J} lse_i z_ij − Σ_{i∈I, j} Q'_ij z_ij]`, so `Q` and `Q'` are weighted `N/M`; the contrastive term
    (one-hot) is then meaningless and left to the caller (`MultiPositiveDistillLoss`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, teacher_image_rows: torch.Tensor, teacher_text_features: torch.Tensor,
        teacher_logit_scale: torch.Tensor, weight: float, row_offset: int, tile: int,
        reduce_column_lse: Callable[..., torch.Tensor], num_images: int, text_rows: tuple[int, int],
    ) -> torch.Tensor:
        scale, bias = scalar_values(logit_scale, logit_bias)
        teacher_scale = float(teacher_logit_scale.detach())
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        column_weight = num_images / num_all  # N/M: the text→image terms are a mean over M texts
        # [student, teacher] row and column log-sum-exps (a softmax is shift-invariant: the bias is left out)
        row_lse = image_rows.new_empty((2, num_rows))
        column_lse = image_rows.new_full((2, num_all), float("-inf"))
        diagonal = image_rows.new_zeros(())
        for i0, i1 in tile_ranges(num_rows, tile):
            lse = None
            for j0, j1 in tile_ranges(num_all, tile):
                # one model's block at a time: the student's statistics, then the teacher's
                z = logit_block(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                diagonal += diagonal_sum(z, row_offset + i0, j0)
                student_rows, student_columns = z.logsumexp(dim=1), z.logsumexp(dim=0)
                del z
                w = logit_block(teacher_image_rows[i0:i1], teacher_text_features[j0:j1], teacher_scale, 0.0)
                block_rows = torch.stack([student_rows, w.logsumexp(dim=1)])
                lse = block_rows if lse is None else torch.logaddexp(lse, block_rows)
                column_lse[:, j0:j1] = torch.logaddexp(column_lse[:, j0:j1],
                                                       torch.stack([student_columns, w.logsumexp(dim=0)]))
                del w  # not held while the next block is made
            assert lse is not None  # every row tile meets at least one column tile
            row_lse[:, i0:i1] = lse
        column_lse = reduce_column_lse(column_lse)
        weighted = image_rows.new_zeros(())  # Σ (P' + Q') ⊙ z over the block
        for i0, i1 in tile_ranges(num_rows, tile):
            for j0, j1 in tile_ranges(num_all, tile):
                targets = _teacher_softmaxes(teacher_image_rows[i0:i1], teacher_text_features[j0:j1], teacher_scale,
                                             row_lse[1, i0:i1], column_lse[1, j0:j1], column_weight)
                z = logit_block(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                weighted += torch.dot(targets.view(-1), z.view(-1))  # no third block
                del targets, z
        normalisers = row_lse[0].sum() + column_weight * column_lse[0, text_rows[0] : text_rows[1]].sum()
        terms = torch.stack([normalisers - 2 * diagonal, weight * (normalisers - weighted)]) / (2 * num_images)
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, teacher_image_rows,
                              teacher_text_features, row_lse, column_lse)
        ctx.row_offset, ctx.tile, ctx.weight, ctx.teacher_scale = row_offset, tile, weight, teacher_scale
        ctx.num_images, ctx.column_weight = num_images, column_weight
        return terms

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        _, text_features, logit_scale, logit_bias, teacher_image_rows, teacher_text_features, row_lse, column_lse = \
            ctx.saved_tensors
        scale, bias = scalar_values(logit_scale, logit_bias)
        contrastive, distill = float(grad_out[0]), ctx.weight * float(grad_out[1])

        def block_dz(x: torch.Tensor, y: torch.Tensor, rows: slice, columns: slice) -> torch.Tensor:
            # three blocks at most: the teacher's P' + Q' first (two while made, one kept), then the student's
            # P + Q, Q in z's own buffer
            targets = _teacher_softmaxes(teacher_image_rows[rows], teacher_text_features[columns], ctx.teacher_scale,
                                         row_lse[1, rows], column_lse[1, columns], ctx.column_weight)
            z = logit_block(x, y, scale, bias)
            # P + (N/M)·Q: Q in z's own buffer
            student = (z - row_lse[0, rows, None]).exp_().add_(z.sub_(column_lse[0, None, columns]).exp_(),
                                                               alpha=ctx.column_weight)
            return student.mul_(contrastive + distill).sub_(targets, alpha=distill)  # 2N·dz off the diagonal

        grads = tiled_gradients(ctx, grad_out.new_ones(()), block_dz, diagonal=2 * contrastive,
                                 norm=2 * ctx.num_images)
        return (*grads, None, None, None, None, None, None, None, None, None)


def _teacher_softmaxes(u: torch.Tensor, v: torch.Tensor, teacher_scale: float, row_lse: torch.Tensor,
                       column_lse: torch.Tensor, column_weight: float) -> torch.Tensor:
    """`P' + c·Q'` of one block: the teacher's row softmax plus `column_weight` times its column softmax, from their
    log-sum-exps."""
    w = logit_block(u, v, teacher_scale, 0.0)
    return (w - row_lse[:, None]).exp_().add_(w.sub_(column_lse[None, :]).exp_(), alpha=column_weight)


class _TiledDistillSigLip(torch.autograd.Function):
    """This rank's part of `[siglip, λ·distill]` from the student's block `z[I, :]` and the teacher's pair
    probabilities `p_ij = σ(T⟨u_i, v_j⟩ + B)`:

        siglip  = (1/N) [ Σ_{i∈I, j} softplus(z_ij) − Σ_{i∈I} z_ii ]
        distill = (1/N) Σ_{i∈I, j} [ softplus(z_ij) − p_ij z_ij ]        (BCE(z, p) = softplus(z) − p·z)

    One pass, no statistics; `dz_ij = [(g_s + λg_d) σ(z_ij) − λg_d p_ij − g_s δ_ij] / N`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, teacher_image_rows: torch.Tensor, teacher_text_features: torch.Tensor,
        teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor, weight: float, row_offset: int,
        tile: int, num_images: int,
    ) -> torch.Tensor:
        scale, bias = scalar_values(logit_scale, logit_bias)
        teacher_scale, teacher_bias = scalar_values(teacher_logit_scale, teacher_logit_bias)
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        softplus, diagonal, weighted = (image_rows.new_zeros(()) for _ in range(3))
        for i0, i1 in tile_ranges(num_rows, tile):
            for j0, j1 in tile_ranges(num_all, tile):
                z = logit_block(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                p = logit_block(teacher_image_rows[i0:i1], teacher_text_features[j0:j1], teacher_scale,
                            teacher_bias).sigmoid_()
                diagonal += diagonal_sum(z, row_offset + i0, j0)
                weighted += torch.dot(p.view(-1), z.view(-1))
                del p  # two blocks at most, as the plain loss: not held beside softplus's
                softplus -= F.logsigmoid(z.neg_()).sum()  # exact for every z (see _TiledSigLip); z's buffer
                del z  # not held while the next block is made
        terms = torch.stack([softplus - diagonal, weight * (softplus - weighted)]) / num_images
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, teacher_image_rows,
                              teacher_text_features)
        ctx.row_offset, ctx.tile, ctx.weight, ctx.num_images = row_offset, tile, weight, num_images
        ctx.teacher = (teacher_scale, teacher_bias)
        return terms

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        _, text_features, logit_scale, logit_bias, teacher_image_rows, teacher_text_features = ctx.saved_tensors
        scale, bias = scalar_values(logit_scale, logit_bias)
        siglip, distill = float(grad_out[0]), ctx.weight * float(grad_out[1])

        def block_dz(x: torch.Tensor, y: torch.Tensor, rows: slice, columns: slice) -> torch.Tensor:
            p = logit_block(teacher_image_rows[rows], teacher_text_features[columns], *ctx.teacher).sigmoid_()
            return logit_block(x, y, scale, bias).sigmoid_().mul_(siglip + distill).sub_(p, alpha=distill)

        grads = tiled_gradients(ctx, grad_out.new_ones(()), block_dz, diagonal=siglip, norm=ctx.num_images)
        return (*grads, None, None, None, None, None, None, None, None)


class DistillLoss(nn.Module):
    """The student's contrastive loss and a distillation term from a teacher's features, over the whole window,
    tiled, with the per-rank form: `[contrastive, weight · distill]` (their sum is the window's L(W)).

    kind `clip`: OpenCLIP's `DistillClipLoss` — the cross-entropy of the student's logit rows (and columns)
    against the teacher's softmax rows (and columns), the two directions averaged.
    kind `siglip`: the binary cross-entropy of every student pair logit against the teacher's pair probability
    `σ(T⟨u_i, v_j⟩ + B)`, summed over the `N×N` pairs and divided by `N` like the SigLIP loss — ours: the SigLIP
    loss with the teacher's probabilities as soft labels in place of the ±1 ones; it needs a teacher with a
    `logit_bias` (a sigmoid teacher).

    The teacher's features and scalars are constants: they get no gradient."""

    term_names = ("contrastive", "distill")
    takes_teacher = True

    def __init__(self, kind: str, weight: float = 1.0, tile_size: int = DEFAULT_TILE_SIZE) -> None:
        super().__init__()
        loss_choice(kind)
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"--distill-loss-weight must be a finite number >= 0, got {weight!r}")
        self.kind, self.weight, self.tile_size = kind, float(weight), check_tile_size(tile_size)

    def forward(
        self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, teacher_image_features: torch.Tensor, teacher_text_features: torch.Tensor,
        teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Student `[N, D]` rows and scalars, teacher `[N, D']` rows and scalars → `[contrastive, weight·distill]`."""
        if image_features.shape[0] != text_features.shape[0]:
            raise ValueError(f"{image_features.shape[0]} image rows but {text_features.shape[0]} text rows")
        return self.sharded(image_features, text_features, logit_scale, logit_bias, teacher_image_features,
                            teacher_text_features, teacher_logit_scale, teacher_logit_bias, row_offset=0)

    def sharded(
        self, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, teacher_image_rows: torch.Tensor, teacher_text_features: torch.Tensor,
        teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor | None = None, *, row_offset: int,
        reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = no_reduction, num_images: int | None = None,
        text_rows: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """This rank's part: its image rows (student and teacher) against every text (student and teacher);
        `reduce_column_lse` maps a `[2, M]` partial (student, teacher) to the log-sum-exps over all ranks.
        `num_images` / `text_rows`: the window's `N` images and the `[start, end)` of this rank's texts when they
        are not the texts' (several captions per image; then only the distill term is meaningful)."""
        check_shapes(image_rows, text_features, row_offset)
        _check_teacher(image_rows, text_features, teacher_image_rows, teacher_text_features)
        num_images = text_features.shape[0] if num_images is None else num_images
        text_rows = ((row_offset, row_offset + image_rows.shape[0]) if text_rows is None
                     else (text_rows[0], text_rows[1]))
        teacher = (teacher_image_rows.detach(), teacher_text_features.detach(), teacher_logit_scale.detach())
        if self.kind == "clip":
            return _TiledDistillClip.apply(image_rows, text_features, logit_scale, logit_bias, *teacher, self.weight,
                                           row_offset, self.tile_size, reduce_column_lse, num_images, text_rows)
        if teacher_logit_bias is None:
            raise ValueError("a siglip student distils from a sigmoid teacher: the teacher has no logit_bias "
                             "(--distill-model must be a siglip model)")
        return _TiledDistillSigLip.apply(image_rows, text_features, logit_scale, logit_bias, *teacher,
                                         teacher_logit_bias.detach(), self.weight, row_offset, self.tile_size,
                                         num_images)
