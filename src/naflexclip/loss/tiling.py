"""What every tiled loss shares: the tile size, the input checks, one logit block in one GEMM, and the
backward's walk over the blocks (`tiled_gradients`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# rows × columns of one logit block. 1024² float32 = 4 MiB per temporary; measured on CPU as fast as
# larger tiles (benchmarks/window_loss.py); a GPU wants larger tiles (fewer kernel launches).
DEFAULT_TILE_SIZE = 1024


def no_reduction(column_lse: torch.Tensor) -> torch.Tensor:
    """A loss's default `reduce_column_lse`: one process's column log-sum-exps are already the window's."""
    return column_lse


def check_tile_size(tile_size: int) -> int:
    """`tile_size`, or a one-line ValueError naming --loss-tile-size when it is not a positive integer."""
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"--loss-tile-size / tile_size must be a positive integer, got {tile_size!r}")
    return tile_size


def check_shapes(image_rows: torch.Tensor, text_features: torch.Tensor, row_offset: int) -> None:
    """`image_rows` `[rows, D]` are a non-empty part, from `row_offset`, of the window's `[N, D]` texts."""
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


def scalar_values(logit_scale: torch.Tensor, logit_bias: torch.Tensor | None) -> tuple[float, float]:
    """`(t, b)` as Python numbers (`b` 0 without a bias)."""
    # Python numbers go into addmm's alpha/beta-free form below (one host sync per call, not per tile)
    return float(logit_scale.detach()), 0.0 if logit_bias is None else float(logit_bias.detach())


def tile_ranges(num: int, tile: int) -> list[tuple[int, int]]:
    """`[start, end)` of each block of `tile` rows out of `num`."""
    return [(start, min(start + tile, num)) for start in range(0, num, tile)]


def logit_block(x: torch.Tensor, y: torch.Tensor, scale: float, shift: torch.Tensor | float) -> torch.Tensor:
    """One block `scale · x yᵀ + shift` in one GEMM (`shift`: a number, or a row/column vector view)."""
    if not isinstance(shift, torch.Tensor):
        shift = x.new_tensor(shift)
    return torch.addmm(shift, x, y.T, alpha=scale)


def diagonal_sum(block: torch.Tensor, first_row: int, first_column: int) -> torch.Tensor:
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


def tiled_gradients(
    ctx: Any, grad_out: torch.Tensor, block_dz: Callable[[torch.Tensor, torch.Tensor, slice, slice], torch.Tensor],
    diagonal: float, norm: float, pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """A tiled loss's backward: the gradients of its first four saved inputs (image rows, texts, `logit_scale`,
    `logit_bias`) from `norm · dz`, which is `block_dz(x, y, rows, columns)` on each `tile × tile` block (its image
    rows `x`, texts `y` and their ranges, recomputed from what the forward saved) less `diagonal` on each matching
    pair (global row == global column; 0: none), plus `values` on the few `pairs = (rows, columns, values)`. The
    blocks are summed into `Σ_j dz_ij y_j`, `Σ_i dz_ij x_i` and
    `Σ dz` (with a bias), then `_scalar_grads`."""
    image_rows, text_features, logit_scale, logit_bias = ctx.saved_tensors[:4]
    grad_x, grad_y = torch.zeros_like(image_rows), torch.zeros_like(text_features)
    bias_sum = image_rows.new_zeros(())
    for i0, i1 in tile_ranges(image_rows.shape[0], ctx.tile):
        x = image_rows[i0:i1]
        for j0, j1 in tile_ranges(text_features.shape[0], ctx.tile):
            y = text_features[j0:j1]
            dz = block_dz(x, y, slice(i0, i1), slice(j0, j1))
            grad_x[i0:i1].addmm_(dz, y)
            grad_y[j0:j1].addmm_(dz.T, x)
            if logit_bias is not None:
                bias_sum += dz.sum()
            del dz  # not held while the next block is made
    if diagonal:
        matching = slice(ctx.row_offset, ctx.row_offset + image_rows.shape[0])
        grad_x.sub_(text_features[matching], alpha=diagonal)
        grad_y[matching].sub_(image_rows, alpha=diagonal)
        bias_sum -= diagonal * image_rows.shape[0]
    if pairs is not None:
        rows, columns, values = pairs
        grad_x.index_add_(0, rows, values[:, None] * text_features[columns])
        grad_y.index_add_(0, columns, values[:, None] * image_rows[rows])
        bias_sum += values.sum()
    scale, _ = scalar_values(logit_scale, logit_bias)
    return _scalar_grads(ctx, grad_out, grad_x, grad_y, bias_sum, image_rows, logit_scale, logit_bias, scale, norm)
