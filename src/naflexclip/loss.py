"""Contrastive losses over feature rows: CLIP (softmax) and SigLIP (sigmoid), tiled, with a per-rank form.

Memory contract (FlashAttention's online softmax; Inf-CL, Yu et al. 2024, https://arxiv.org/abs/2410.17243):
the `N×N` logit matrix never exists. The forward walks `tile × tile` blocks of it and keeps O(N·D) inputs
plus per-row/per-column statistics (CLIP: log-sum-exp of each row and column; SigLIP: none); the backward
recomputes every block from them. The largest temporary is a few `tile × tile` blocks.

Per-rank form (`sharded`): rank r holds the block of logit rows of its own images against every text,
`z[I_r, :]`. Its terms are the rows' image→text cross-entropies and — CLIP — the text→image terms of its
own texts, whose column normalisers combine every rank's partial column log-sum-exp (`N` numbers per rank,
passed in as `reduce_column_lse`). Its backward gives the gradient of the *whole* `L(W)` with respect to
its block: complete for its image rows, a partial sum for the texts (the caller sums those over ranks,
with one reduce-scatter) and for `logit_scale`/`logit_bias` (summed over ranks once). The per-rank values
sum to `L(W)`. In one process (`forward`) the block is the whole matrix.

`DistillLoss` adds a teacher: the student's contrastive loss and a distillation term over the whole window
(OpenCLIP's `DistillClipLoss` for CLIP; soft-label binary cross-entropy per pair for SigLIP), as the terms
`[contrastive, weight · distill]`, tiled and sharded the same way (the teacher's blocks recomputed beside the
student's, its column log-sum-exps exchanged with the student's).

The dense formulas (`clip_loss_dense`, `siglip_loss_dense`, `distill_*_loss_dense`) are kept as the reference
for the tests. CLIP: Radford et al. 2021; SigLIP: Zhai et al. 2023.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

# rows × columns of one logit block. 1024² float32 = 4 MiB per temporary; measured on CPU as fast as
# larger tiles (benchmarks/window_loss.py); a GPU wants larger tiles (fewer kernel launches).
DEFAULT_TILE_SIZE = 1024


def _identity(column_lse: torch.Tensor) -> torch.Tensor:
    return column_lse


def pairwise_logits(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[N, N]` logits, row i = image i against every text: `t · ⟨x_i, y_j⟩ (+ b)` (dense reference only)."""
    logits = logit_scale * image_features @ text_features.T
    return logits if logit_bias is None else logits + logit_bias


def clip_loss_dense(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the CLIP loss through the whole `[N, N]` logit matrix (O(N²) memory)."""
    logits_per_image = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
    labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2


def siglip_loss_dense(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: the SigLIP loss through the whole `[N, N]` logit matrix (O(N²) memory)."""
    logits = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
    num_pairs = logits.shape[0]
    # +1 on the diagonal (matching pairs), -1 everywhere else
    labels = 2 * torch.eye(num_pairs, device=logits.device, dtype=logits.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / num_pairs


def _check_tile_size(tile_size: int) -> int:
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"--loss-tile-size / tile_size must be a positive integer, got {tile_size!r}")
    return tile_size


def _check_shapes(image_rows: torch.Tensor, text_features: torch.Tensor, row_offset: int) -> None:
    if image_rows.dim() != 2 or text_features.dim() != 2 or image_rows.shape[1] != text_features.shape[1]:
        raise ValueError(
            f"features must be [rows, D] with one D, got image {tuple(image_rows.shape)} "
            f"and text {tuple(text_features.shape)}"
        )
    if not 0 <= row_offset <= text_features.shape[0] - image_rows.shape[0] or image_rows.shape[0] < 1:
        raise ValueError(
            f"image rows [{row_offset}, {row_offset + image_rows.shape[0]}) are not a non-empty part of the "
            f"{text_features.shape[0]} text rows"
        )


def _scalars(logit_scale: torch.Tensor, logit_bias: torch.Tensor | None) -> tuple[float, float]:
    # Python numbers go into addmm's alpha/beta-free form below (one host sync per call, not per tile)
    return float(logit_scale.detach()), 0.0 if logit_bias is None else float(logit_bias.detach())


def _tiles(num: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, num)) for start in range(0, num, tile)]


def _logits(x: torch.Tensor, y: torch.Tensor, scale: float, shift: torch.Tensor | float) -> torch.Tensor:
    """One block `scale · x yᵀ + shift` in one GEMM (`shift`: a number, or a row/column vector view)."""
    if not isinstance(shift, torch.Tensor):
        shift = x.new_tensor(shift)
    return torch.addmm(shift, x, y.T, alpha=scale)


def _diagonal_sum(block: torch.Tensor, first_row: int, first_column: int) -> torch.Tensor:
    """Σ of the block's entries on the window's diagonal (global row == global column); 0 if it misses it."""
    offset = first_row - first_column  # local column − local row of a diagonal entry
    if not -block.shape[0] < offset < block.shape[1]:
        return block.new_zeros(())
    return block.diagonal(offset).sum()


def _scalar_grads(
    ctx: Any, grad_out: torch.Tensor, grad_x: torch.Tensor, grad_y: torch.Tensor, bias_sum: torch.Tensor,
    image_rows: torch.Tensor, logit_scale: torch.Tensor, logit_bias: torch.Tensor | None, scale: float, norm: float,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """From the block sums `Σ_j dz_ij y_j` (grad_x), `Σ_i dz_ij x_i` (grad_y) and `Σ dz` to the input gradients.

    `∂z_ij/∂t = ⟨x_i, y_j⟩`, so `∂L/∂t = Σ_ij dz_ij ⟨x_i, y_j⟩ = Σ_i ⟨x_i, (grad_x)_i⟩`: no per-block product."""
    coeff = grad_out / norm
    d_scale = (coeff * (image_rows * grad_x).sum()).reshape(logit_scale.shape).to(logit_scale.dtype)
    d_bias = None
    if logit_bias is not None and ctx.needs_input_grad[3]:
        d_bias = (coeff * bias_sum).reshape(logit_bias.shape).to(logit_bias.dtype)
    return (
        grad_x * (coeff * scale) if ctx.needs_input_grad[0] else None,
        grad_y * (coeff * scale) if ctx.needs_input_grad[1] else None,
        d_scale if ctx.needs_input_grad[2] else None,
        d_bias,
    )


class _TiledClip(torch.autograd.Function):
    """This rank's part of the CLIP loss from its logit block `z[I, :]`, `I = [offset, offset + n)`:

        (1/2N) [ Σ_{i∈I} (lse_j z_ij − z_ii) + Σ_{j∈I} (lse_i z_ij − z_jj) ]

    with the column log-sum-exps over *all* ranks' rows (`reduce_column_lse`). The backward returns the
    gradient of the whole loss through this block: `dz_ij = (P_ij + Q_ij − 2δ_ij) / 2N`,
    `P = softmax over the row`, `Q = softmax over the column`, both recomputed from the saved statistics."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, row_offset: int, tile: int, reduce_column_lse: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        scale, bias = _scalars(logit_scale, logit_bias)
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        row_lse = image_rows.new_empty(num_rows)
        column_lse = image_rows.new_full((num_all,), float("-inf"))
        diagonal = image_rows.new_zeros(())  # Σ z_ii, taken from the same blocks as the log-sum-exps
        for i0, i1 in _tiles(num_rows, tile):
            x, lse = image_rows[i0:i1], None
            for j0, j1 in _tiles(num_all, tile):
                z = _logits(x, text_features[j0:j1], scale, bias)
                diagonal += _diagonal_sum(z, row_offset + i0, j0)
                # online log-sum-exp: rows across column tiles, columns across row tiles
                block_rows = torch.logsumexp(z, dim=1)
                lse = block_rows if lse is None else torch.logaddexp(lse, block_rows)
                column_lse[j0:j1] = torch.logaddexp(column_lse[j0:j1], torch.logsumexp(z, dim=0))
            row_lse[i0:i1] = lse
        column_lse = reduce_column_lse(column_lse)  # every rank's rows: the full column normaliser
        loss = (row_lse.sum() + column_lse[row_offset : row_offset + num_rows].sum() - 2 * diagonal) / (2 * num_all)
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, row_lse, column_lse)
        ctx.row_offset, ctx.tile = row_offset, tile
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        image_rows, text_features, logit_scale, logit_bias, row_lse, column_lse = ctx.saved_tensors
        scale, bias = _scalars(logit_scale, logit_bias)
        num_rows, num_all, offset = image_rows.shape[0], text_features.shape[0], ctx.row_offset
        grad_x = torch.zeros_like(image_rows)  # Σ_j dz_ij y_j, before the 1/2N and t factors
        grad_y = torch.zeros_like(text_features)  # Σ_i dz_ij x_i
        bias_sum = image_rows.new_zeros(())
        for i0, i1 in _tiles(num_rows, ctx.tile):
            x, shift = image_rows[i0:i1], (bias - row_lse[i0:i1])[:, None]
            for j0, j1 in _tiles(num_all, ctx.tile):
                y = text_features[j0:j1]
                u = _logits(x, y, scale, shift)  # z − row_lse
                probs = u.exp()  # P
                # z − column_lse, then Q; P + Q is dz without the diagonal and the 1/2N
                probs.add_(u.add_(row_lse[i0:i1, None]).sub_(column_lse[None, j0:j1]).exp_())
                grad_x[i0:i1].addmm_(probs, y)
                grad_y[j0:j1].addmm_(probs.T, x)
                if logit_bias is not None:
                    bias_sum += probs.sum()
        # the matching pairs: −1 in each direction
        grad_x.sub_(text_features[offset : offset + num_rows], alpha=2)
        grad_y[offset : offset + num_rows].sub_(image_rows, alpha=2)
        bias_sum -= 2 * num_rows
        grads = _scalar_grads(ctx, grad_out, grad_x, grad_y, bias_sum, image_rows, logit_scale, logit_bias,
                              scale, 2 * num_all)
        return (*grads, None, None, None)


class _TiledSigLip(torch.autograd.Function):
    """This rank's part of the SigLIP loss from its logit block `z[I, :]`:

        (1/N) [ Σ_{i∈I, j} softplus(z_ij) − Σ_{i∈I} z_ii ]

    (`−log σ(z)` on the diagonal is `softplus(z) − z`, `−log σ(−z)` elsewhere is `softplus(z)`), so no label
    matrix is needed; `dz_ij = (σ(z_ij) − δ_ij) / N`. No statistics are saved: the rows are independent."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, row_offset: int, tile: int,
    ) -> torch.Tensor:
        scale, bias = _scalars(logit_scale, logit_bias)
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        total = image_rows.new_zeros(())
        negative_diagonal = image_rows.new_zeros(())
        for i0, i1 in _tiles(num_rows, tile):
            for j0, j1 in _tiles(num_all, tile):
                negative_z = _logits(image_rows[i0:i1], text_features[j0:j1], -scale, -bias)
                negative_diagonal += _diagonal_sum(negative_z, row_offset + i0, j0)
                # softplus(z) = −log σ(−z), exact for every z (torch's softplus switches to z above 20)
                total -= F.logsigmoid(negative_z).sum()
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias)
        ctx.row_offset, ctx.tile = row_offset, tile
        return (total + negative_diagonal) / num_all

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        image_rows, text_features, logit_scale, logit_bias = ctx.saved_tensors
        scale, bias = _scalars(logit_scale, logit_bias)
        num_rows, num_all, offset = image_rows.shape[0], text_features.shape[0], ctx.row_offset
        grad_x, grad_y = torch.zeros_like(image_rows), torch.zeros_like(text_features)
        bias_sum = image_rows.new_zeros(())
        for i0, i1 in _tiles(num_rows, ctx.tile):
            x = image_rows[i0:i1]
            for j0, j1 in _tiles(num_all, ctx.tile):
                y = text_features[j0:j1]
                probs = _logits(x, y, scale, bias).sigmoid_()
                grad_x[i0:i1].addmm_(probs, y)
                grad_y[j0:j1].addmm_(probs.T, x)
                if logit_bias is not None:
                    bias_sum += probs.sum()
        grad_x.sub_(text_features[offset : offset + num_rows])
        grad_y[offset : offset + num_rows].sub_(image_rows)
        bias_sum -= num_rows
        grads = _scalar_grads(ctx, grad_out, grad_x, grad_y, bias_sum, image_rows, logit_scale, logit_bias,
                              scale, num_all)
        return (*grads, None, None)


def distill_clip_loss_dense(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, teacher_image_features: torch.Tensor, teacher_text_features: torch.Tensor,
    teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: `[contrastive, distill]` of OpenCLIP's `DistillClipLoss` through the whole `[N, N]` matrices."""
    logits = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
    teacher = pairwise_logits(teacher_image_features, teacher_text_features, teacher_logit_scale, teacher_logit_bias)

    def cross_entropy(target_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
        return -(target_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean()

    distill = (cross_entropy(teacher, logits) + cross_entropy(teacher.T, logits.T)) / 2
    return torch.stack([clip_loss_dense(image_features, text_features, logit_scale, logit_bias), distill])


def distill_siglip_loss_dense(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None, teacher_image_features: torch.Tensor, teacher_text_features: torch.Tensor,
    teacher_logit_scale: torch.Tensor, teacher_logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: `[siglip, distill]`, the distill term the binary cross-entropy of every student pair logit
    against the teacher's pair probability `σ(T⟨u_i, v_j⟩ + B)`, summed over pairs and divided by `N`."""
    logits = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
    targets = pairwise_logits(teacher_image_features, teacher_text_features, teacher_logit_scale,
                              teacher_logit_bias).sigmoid()
    distill = F.binary_cross_entropy_with_logits(logits, targets, reduction="sum") / logits.shape[0]
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
    teacher's features are constants (no gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None, teacher_image_rows: torch.Tensor, teacher_text_features: torch.Tensor,
        teacher_logit_scale: torch.Tensor, weight: float, row_offset: int, tile: int,
        reduce_column_lse: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        scale, bias = _scalars(logit_scale, logit_bias)
        teacher_scale = float(teacher_logit_scale.detach())
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        # [student, teacher] row and column log-sum-exps (a softmax is shift-invariant: the bias is left out)
        row_lse = image_rows.new_empty((2, num_rows))
        column_lse = image_rows.new_full((2, num_all), float("-inf"))
        diagonal = image_rows.new_zeros(())
        for i0, i1 in _tiles(num_rows, tile):
            lse = None
            for j0, j1 in _tiles(num_all, tile):
                z = _logits(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                w = _logits(teacher_image_rows[i0:i1], teacher_text_features[j0:j1], teacher_scale, 0.0)
                diagonal += _diagonal_sum(z, row_offset + i0, j0)
                block_rows = torch.stack([z.logsumexp(dim=1), w.logsumexp(dim=1)])
                lse = block_rows if lse is None else torch.logaddexp(lse, block_rows)
                column_lse[:, j0:j1] = torch.logaddexp(column_lse[:, j0:j1],
                                                       torch.stack([z.logsumexp(dim=0), w.logsumexp(dim=0)]))
            row_lse[:, i0:i1] = lse
        column_lse = reduce_column_lse(column_lse)
        weighted = image_rows.new_zeros(())  # Σ (P' + Q') ⊙ z over the block
        for i0, i1 in _tiles(num_rows, tile):
            for j0, j1 in _tiles(num_all, tile):
                z = _logits(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                targets = _teacher_softmaxes(teacher_image_rows[i0:i1], teacher_text_features[j0:j1], teacher_scale,
                                             row_lse[1, i0:i1], column_lse[1, j0:j1])
                weighted += torch.dot(targets.view(-1), z.view(-1))  # no third block
        normalisers = row_lse[0].sum() + column_lse[0, row_offset : row_offset + num_rows].sum()
        terms = torch.stack([normalisers - 2 * diagonal, weight * (normalisers - weighted)]) / (2 * num_all)
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, teacher_image_rows,
                              teacher_text_features, row_lse, column_lse)
        ctx.row_offset, ctx.tile, ctx.weight, ctx.teacher_scale = row_offset, tile, weight, teacher_scale
        return terms

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (image_rows, text_features, logit_scale, logit_bias, teacher_image_rows, teacher_text_features, row_lse,
         column_lse) = ctx.saved_tensors
        scale, bias = _scalars(logit_scale, logit_bias)
        num_rows, num_all, offset = image_rows.shape[0], text_features.shape[0], ctx.row_offset
        contrastive, distill = float(grad_out[0]), ctx.weight * float(grad_out[1])
        grad_x, grad_y = torch.zeros_like(image_rows), torch.zeros_like(text_features)
        bias_sum = image_rows.new_zeros(())
        for i0, i1 in _tiles(num_rows, ctx.tile):
            x = image_rows[i0:i1]
            for j0, j1 in _tiles(num_all, ctx.tile):
                y = text_features[j0:j1]
                z = _logits(x, y, scale, bias)
                # P + Q in two blocks: Q is computed in z's own buffer (blocks held: these two and the teacher's two)
                student = (z - row_lse[0, i0:i1, None]).exp_().add_(z.sub_(column_lse[0, None, j0:j1]).exp_())
                targets = _teacher_softmaxes(teacher_image_rows[i0:i1], teacher_text_features[j0:j1],
                                             ctx.teacher_scale, row_lse[1, i0:i1], column_lse[1, j0:j1])
                dz = student.mul_(contrastive + distill).sub_(targets, alpha=distill)  # 2N·dz off the diagonal
                grad_x[i0:i1].addmm_(dz, y)
                grad_y[j0:j1].addmm_(dz.T, x)
                if logit_bias is not None:
                    bias_sum += dz.sum()
        grad_x.sub_(text_features[offset : offset + num_rows], alpha=2 * contrastive)
        grad_y[offset : offset + num_rows].sub_(image_rows, alpha=2 * contrastive)
        bias_sum -= 2 * contrastive * num_rows
        grads = _scalar_grads(ctx, grad_out.new_ones(()), grad_x, grad_y, bias_sum, image_rows, logit_scale,
                              logit_bias, scale, 2 * num_all)
        return (*grads, None, None, None, None, None, None, None)


def _teacher_softmaxes(u: torch.Tensor, v: torch.Tensor, teacher_scale: float, row_lse: torch.Tensor,
                       column_lse: torch.Tensor) -> torch.Tensor:
    """`P' + Q'` of one block: the teacher's row softmax plus its column softmax, from their log-sum-exps."""
    w = _logits(u, v, teacher_scale, 0.0)
    return (w - row_lse[:, None]).exp_().add_(w.sub_(column_lse[None, :]).exp_())


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
        tile: int,
    ) -> torch.Tensor:
        scale, bias = _scalars(logit_scale, logit_bias)
        teacher_scale, teacher_bias = _scalars(teacher_logit_scale, teacher_logit_bias)
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        softplus, diagonal, weighted = (image_rows.new_zeros(()) for _ in range(3))
        for i0, i1 in _tiles(num_rows, tile):
            for j0, j1 in _tiles(num_all, tile):
                z = _logits(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                p = _logits(teacher_image_rows[i0:i1], teacher_text_features[j0:j1], teacher_scale,
                            teacher_bias).sigmoid_()
                diagonal += _diagonal_sum(z, row_offset + i0, j0)
                weighted += torch.dot(p.view(-1), z.view(-1))
                softplus -= F.logsigmoid(z.neg_()).sum()  # exact for every z (see _TiledSigLip); z's buffer
        terms = torch.stack([softplus - diagonal, weight * (softplus - weighted)]) / num_all
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, teacher_image_rows,
                              teacher_text_features)
        ctx.row_offset, ctx.tile, ctx.weight = row_offset, tile, weight
        ctx.teacher = (teacher_scale, teacher_bias)
        return terms

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        image_rows, text_features, logit_scale, logit_bias, teacher_image_rows, teacher_text_features = \
            ctx.saved_tensors
        scale, bias = _scalars(logit_scale, logit_bias)
        num_rows, num_all, offset = image_rows.shape[0], text_features.shape[0], ctx.row_offset
        siglip, distill = float(grad_out[0]), ctx.weight * float(grad_out[1])
        grad_x, grad_y = torch.zeros_like(image_rows), torch.zeros_like(text_features)
        bias_sum = image_rows.new_zeros(())
        for i0, i1 in _tiles(num_rows, ctx.tile):
            x = image_rows[i0:i1]
            for j0, j1 in _tiles(num_all, ctx.tile):
                y = text_features[j0:j1]
                p = _logits(teacher_image_rows[i0:i1], teacher_text_features[j0:j1], *ctx.teacher).sigmoid_()
                dz = _logits(x, y, scale, bias).sigmoid_().mul_(siglip + distill).sub_(p, alpha=distill)
                grad_x[i0:i1].addmm_(dz, y)
                grad_y[j0:j1].addmm_(dz.T, x)
                if logit_bias is not None:
                    bias_sum += dz.sum()
        grad_x.sub_(text_features[offset : offset + num_rows], alpha=siglip)
        grad_y[offset : offset + num_rows].sub_(image_rows, alpha=siglip)
        bias_sum -= siglip * num_rows
        grads = _scalar_grads(ctx, grad_out.new_ones(()), grad_x, grad_y, bias_sum, image_rows, logit_scale,
                              logit_bias, scale, num_all)
        return (*grads, None, None, None, None, None, None, None)


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
        scale, bias = _scalars(logit_scale, logit_bias)
        num_rows, num_texts, num_images = image_rows.shape[0], text_features.shape[0], image_groups.shape[0]
        per_image, per_text = (c.to(image_rows.dtype) for c in positive_counts(image_groups, text_groups))
        groups = image_groups[row_offset : row_offset + num_rows]
        inverse_image, inverse_text = 1 / per_image[row_offset : row_offset + num_rows], 1 / per_text
        ctx.kind, ctx.weighting, ctx.tile, ctx.sizes = kind, weighting, tile, (num_images, num_texts)
        if kind == "clip":
            row_lse = image_rows.new_empty(num_rows)
            column_lse = image_rows.new_full((num_texts,), float("-inf"))
            positives = image_rows.new_zeros(())  # (1/2N) Σ Y z / k_i + (1/2M) Σ Y z / k'_j
            for i0, i1 in _tiles(num_rows, tile):
                lse = None
                for j0, j1 in _tiles(num_texts, tile):
                    z = _logits(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                    y = (groups[i0:i1, None] == text_groups[None, j0:j1]).to(z.dtype)
                    weights = inverse_image[i0:i1, None] / (2 * num_images) + inverse_text[None, j0:j1] / (
                        2 * num_texts)
                    positives += (y * weights * z).sum()
                    block_rows = torch.logsumexp(z, dim=1)
                    lse = block_rows if lse is None else torch.logaddexp(lse, block_rows)
                    column_lse[j0:j1] = torch.logaddexp(column_lse[j0:j1], torch.logsumexp(z, dim=0))
                row_lse[i0:i1] = lse
            column_lse = reduce_column_lse(column_lse)
            t0, t1 = text_rows
            loss = row_lse.sum() / (2 * num_images) + column_lse[t0:t1].sum() / (2 * num_texts) - positives
            ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, groups, text_groups,
                                  inverse_image, inverse_text, row_lse, column_lse)
            return loss
        alpha, beta = MULTI_POSITIVE_WEIGHTINGS[weighting]
        total = image_rows.new_zeros(())
        for i0, i1 in _tiles(num_rows, tile):
            for j0, j1 in _tiles(num_texts, tile):
                z = _logits(image_rows[i0:i1], text_features[j0:j1], scale, bias)
                y = (groups[i0:i1, None] == text_groups[None, j0:j1]).to(z.dtype)
                w = y * (alpha * inverse_image[i0:i1, None] + beta * inverse_text[None, j0:j1])
                softplus = -F.logsigmoid(-z)  # exact for every z (see _TiledSigLip)
                if weighting == "soft":
                    total += (softplus - w * z).sum()
                else:  # Y w softplus(−z) + (1 − Y) softplus(z), softplus(−z) = softplus(z) − z
                    total += ((1 + w - y) * softplus - w * z).sum()
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, groups, text_groups,
                              inverse_image, inverse_text)
        return total / num_images

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        image_rows, text_features, logit_scale, logit_bias, groups, text_groups, inverse_image, inverse_text = \
            ctx.saved_tensors[:8]
        scale, bias = _scalars(logit_scale, logit_bias)
        num_images, num_texts = ctx.sizes
        num_rows = image_rows.shape[0]
        grad_x, grad_y = torch.zeros_like(image_rows), torch.zeros_like(text_features)
        bias_sum = image_rows.new_zeros(())
        alpha, beta = MULTI_POSITIVE_WEIGHTINGS[ctx.weighting]
        for i0, i1 in _tiles(num_rows, ctx.tile):
            x = image_rows[i0:i1]
            for j0, j1 in _tiles(num_texts, ctx.tile):
                y_features = text_features[j0:j1]
                z = _logits(x, y_features, scale, bias)
                y = (groups[i0:i1, None] == text_groups[None, j0:j1]).to(z.dtype)
                if ctx.kind == "clip":
                    row_lse, column_lse = ctx.saved_tensors[8:]
                    dz = ((z - row_lse[i0:i1, None]).exp() - y * inverse_image[i0:i1, None]) / (2 * num_images)
                    dz += ((z - column_lse[None, j0:j1]).exp() - y * inverse_text[None, j0:j1]) / (2 * num_texts)
                else:
                    w = y * (alpha * inverse_image[i0:i1, None] + beta * inverse_text[None, j0:j1])
                    probs = z.sigmoid()
                    dz = (probs - w if ctx.weighting == "soft" else (1 + w - y) * probs - w) / num_images
                grad_x[i0:i1].addmm_(dz, y_features)
                grad_y[j0:j1].addmm_(dz.T, x)
                if logit_bias is not None:
                    bias_sum += dz.sum()
        grads = _scalar_grads(ctx, grad_out, grad_x, grad_y, bias_sum, image_rows, logit_scale, logit_bias,
                              scale, 1.0)
        return (*grads, None, None, None, None, None, None, None, None)


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
        self.kind, self.weighting, self.tile_size = kind, weighting, _check_tile_size(tile_size)

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor
                ) -> torch.Tensor:
        """image_features `[N, D]`, text_features `[M, D]`, group ids `[N]` and `[M]` → the scalar loss."""
        return self.sharded(image_features, text_features, logit_scale, logit_bias, image_groups, text_groups,
                            row_offset=0, text_rows=(0, text_features.shape[0]))

    def sharded(self, image_rows: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor,
                logit_bias: torch.Tensor | None, image_groups: torch.Tensor, text_groups: torch.Tensor, *,
                row_offset: int, text_rows: tuple[int, int] | None = None,
                reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = _identity) -> torch.Tensor:
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


@runtime_checkable
class ShardedLoss(Protocol):
    """A loss the window can split over ranks (see the module docstring for what `sharded` returns)."""

    def sharded(
        self,
        image_rows: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
        *,
        row_offset: int,
        reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = _identity,
    ) -> torch.Tensor: ...


class _TiledLoss(nn.Module):
    """A tiled contrastive loss over `N` pairs: `forward` is the one-process case of `sharded`.

    tile_size: rows/columns of one logit block; memory is O(N·D + tile²) whatever `N`."""

    def __init__(self, tile_size: int = DEFAULT_TILE_SIZE) -> None:
        super().__init__()
        self.tile_size = _check_tile_size(tile_size)

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """image_features, text_features: `[N, D]`; logit_scale: exponentiated scalar → scalar loss."""
        if image_features.shape[0] != text_features.shape[0]:
            raise ValueError(f"{image_features.shape[0]} image rows but {text_features.shape[0]} text rows")
        return self.sharded(image_features, text_features, logit_scale, logit_bias, row_offset=0)

    def sharded(
        self,
        image_rows: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
        *,
        row_offset: int,
        reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = _identity,
    ) -> torch.Tensor:
        """This rank's part of L: image_rows `[n, D]` are rows `[row_offset, row_offset + n)` of the window,
        text_features `[N, D]` all of its texts; reduce_column_lse maps this rank's `[N]` partial column
        log-sum-exps to the log-sum-exp over all ranks (identity in one process)."""
        _check_shapes(image_rows, text_features, row_offset)
        return self._tiled(image_rows, text_features, logit_scale, logit_bias, row_offset, reduce_column_lse)

    def _tiled(
        self,
        image_rows: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None,
        row_offset: int,
        reduce_column_lse: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        raise NotImplementedError


class ClipLoss(_TiledLoss):
    """Mean of image→text and text→image cross-entropy over `N` pairs (Radford et al. 2021), tiled."""

    def _tiled(self, image_rows, text_features, logit_scale, logit_bias, row_offset, reduce_column_lse):
        return _TiledClip.apply(image_rows, text_features, logit_scale, logit_bias, row_offset, self.tile_size,
                                reduce_column_lse)


class SigLipLoss(_TiledLoss):
    """Pairwise sigmoid loss over all `N×N` pairs, normalised by `N` (Zhai et al. 2023), tiled."""

    def _tiled(self, image_rows, text_features, logit_scale, logit_bias, row_offset, reduce_column_lse):
        # the rows are independent: no column statistic crosses ranks, reduce_column_lse is not needed
        return _TiledSigLip.apply(image_rows, text_features, logit_scale, logit_bias, row_offset, self.tile_size)


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
        self.kind, self.weight, self.tile_size = kind, float(weight), _check_tile_size(tile_size)

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
        reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = _identity,
    ) -> torch.Tensor:
        """This rank's part: its image rows (student and teacher) against every text (student and teacher);
        `reduce_column_lse` maps a `[2, N]` partial (student, teacher) to the log-sum-exps over all ranks."""
        _check_shapes(image_rows, text_features, row_offset)
        _check_teacher(image_rows, text_features, teacher_image_rows, teacher_text_features)
        teacher = (teacher_image_rows.detach(), teacher_text_features.detach(), teacher_logit_scale.detach())
        if self.kind == "clip":
            return _TiledDistillClip.apply(image_rows, text_features, logit_scale, logit_bias, *teacher, self.weight,
                                           row_offset, self.tile_size, reduce_column_lse)
        if teacher_logit_bias is None:
            raise ValueError("a siglip student distils from a sigmoid teacher: the teacher has no logit_bias "
                             "(--distill-model must be a siglip model)")
        return _TiledDistillSigLip.apply(image_rows, text_features, logit_scale, logit_bias, *teacher,
                                         teacher_logit_bias.detach(), self.weight, row_offset, self.tile_size)


@dataclass(frozen=True)
class LossChoice:
    """A loss chosen by name (`--loss`): its class, and where the model's temperature and bias start."""

    loss: type[_TiledLoss]
    init_logit_scale: float  # log t
    init_logit_bias: float | None  # None: the model has no logit_bias


# the one table of losses: model, train, verify and checkpoints choose from it by name
LOSSES: dict[str, LossChoice] = {
    "clip": LossChoice(ClipLoss, math.log(1 / 0.07), None),  # t = 1/0.07 (Radford et al. 2021)
    "siglip": LossChoice(SigLipLoss, math.log(10.0), -10.0),  # t' = log 10, b = -10 (Zhai et al. 2023, 3.2)
}


def loss_choice(name: str) -> LossChoice:
    """The `LOSSES` entry `name`, or ValueError naming the value and the choices."""
    if not isinstance(name, str) or name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name]


def create_loss(name: str, tile_size: int = DEFAULT_TILE_SIZE) -> nn.Module:
    """The loss `name` of `LOSSES` (`clip`, `siglip`), tiled; `tile_size` tunes speed, not results."""
    return loss_choice(name).loss(tile_size)
