"""CLIP (softmax) and SigLIP (sigmoid) over `N` pairs, tiled, with the per-rank form; their dense references;
the table of losses by name (`LOSSES`, `create_loss`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

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
        scale, bias = scalar_values(logit_scale, logit_bias)
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        row_lse = image_rows.new_empty(num_rows)
        column_lse = image_rows.new_full((num_all,), float("-inf"))
        diagonal = image_rows.new_zeros(())  # Σ z_ii, taken from the same blocks as the log-sum-exps
        for i0, i1 in tile_ranges(num_rows, tile):
            x, lse = image_rows[i0:i1], None
            for j0, j1 in tile_ranges(num_all, tile):
                z = logit_block(x, text_features[j0:j1], scale, bias)
                diagonal += diagonal_sum(z, row_offset + i0, j0)
                # online log-sum-exp: rows across column tiles, columns across row tiles
                block_rows = torch.logsumexp(z, dim=1)
                lse = block_rows if lse is None else torch.logaddexp(lse, block_rows)
                column_lse[j0:j1] = torch.logaddexp(column_lse[j0:j1], torch.logsumexp(z, dim=0))
            assert lse is not None  # every row tile meets at least one column tile
            row_lse[i0:i1] = lse
        column_lse = reduce_column_lse(column_lse)  # every rank's rows: the full column normaliser
        loss = (row_lse.sum() + column_lse[row_offset : row_offset + num_rows].sum() - 2 * diagonal) / (2 * num_all)
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias, row_lse, column_lse)
        ctx.row_offset, ctx.tile = row_offset, tile
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        image_rows, text_features, logit_scale, logit_bias, row_lse, column_lse = ctx.saved_tensors
        scale, bias = scalar_values(logit_scale, logit_bias)

        def block_dz(x: torch.Tensor, y: torch.Tensor, rows: slice, columns: slice) -> torch.Tensor:
            u = logit_block(x, y, scale, (bias - row_lse[rows])[:, None])  # z − row_lse
            probs = u.exp()  # P
            # z − column_lse, then Q; P + Q is dz without the diagonal and the 1/2N
            return probs.add_(u.add_(row_lse[rows, None]).sub_(column_lse[None, columns]).exp_())

        # the matching pairs: −1 in each direction
        grads = tiled_gradients(ctx, grad_out, block_dz, diagonal=2, norm=2 * text_features.shape[0])
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
        scale, bias = scalar_values(logit_scale, logit_bias)
        num_rows, num_all = image_rows.shape[0], text_features.shape[0]
        total = image_rows.new_zeros(())
        negative_diagonal = image_rows.new_zeros(())
        for i0, i1 in tile_ranges(num_rows, tile):
            for j0, j1 in tile_ranges(num_all, tile):
                negative_z = logit_block(image_rows[i0:i1], text_features[j0:j1], -scale, -bias)
                negative_diagonal += diagonal_sum(negative_z, row_offset + i0, j0)
                # softplus(z) = −log σ(−z), exact for every z (torch's softplus switches to z above 20)
                total -= F.logsigmoid(negative_z).sum()
        ctx.save_for_backward(image_rows, text_features, logit_scale, logit_bias)
        ctx.row_offset, ctx.tile = row_offset, tile
        return (total + negative_diagonal) / num_all

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        scale, bias = scalar_values(*ctx.saved_tensors[2:4])
        grads = tiled_gradients(ctx, grad_out, lambda x, y, rows, columns: logit_block(x, y, scale, bias).sigmoid_(),
                                 diagonal=1, norm=ctx.saved_tensors[1].shape[0])
        return (*grads, None, None)


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
        reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = no_reduction,
    ) -> torch.Tensor: ...


class _TiledLoss(nn.Module):
    """A tiled contrastive loss over `N` pairs: `forward` is the one-process case of `sharded`.

    tile_size: rows/columns of one logit block; memory is O(N·D + tile²) whatever `N`."""

    def __init__(self, tile_size: int = DEFAULT_TILE_SIZE) -> None:
        super().__init__()
        self.tile_size = check_tile_size(tile_size)

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
        reduce_column_lse: Callable[[torch.Tensor], torch.Tensor] = no_reduction,
    ) -> torch.Tensor:
        """This rank's part of L: image_rows `[n, D]` are rows `[row_offset, row_offset + n)` of the window,
        text_features `[N, D]` all of its texts; reduce_column_lse maps this rank's `[N]` partial column
        log-sum-exps to the log-sum-exp over all ranks (identity in one process)."""
        check_shapes(image_rows, text_features, row_offset)
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
