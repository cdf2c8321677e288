"""The `cache` method (GradCache, Gao et al. 2021, https://arxiv.org/abs/2101.06983):
  cache  — forward every microbatch without grad, recording its RNG state;
  loss   — `s · L(W)` once over the cached features; backward gives every feature row's gradient and the gradient of
           `logit_scale`/`logit_bias` (counted here, once). With R ranks and a `ShardedLoss` each rank computes only
           its own rows' block of the loss (~N²/R work); the text-row gradients it gives other ranks go to them in
           one reduce-scatter;
  replay — per microbatch: restore RNG, forward with grad, backward the cached row gradients and the terms'
           per-example parts.
"""

from __future__ import annotations

import torch

from naflexclip.loss import ShardedLoss
from naflexclip.window.outputs import FEATURE_KEYS, SCALAR_KEYS, loss_precision
from naflexclip.window.state import Window, backward, total


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient after the loss's backward (every live leaf the loss reads has one)."""
    assert leaf.grad is not None
    return leaf.grad


def _scalar_leaves(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: local[key].detach().requires_grad_() for key in SCALAR_KEYS if key in local}


def whole_loss(window: Window, local: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
    """Phase 2 with every rank computing all of L(W) (one process, or a loss that cannot be sharded):
    returns L(W), this rank's row gradients and the scalar gradients."""
    # a locked tower's rows are constants: no gradient is taken for them
    leaves = {key: window.gather(local[key], key).detach().requires_grad_(key in window.live_keys)
              for key in FEATURE_KEYS}
    leaves.update(_scalar_leaves(local))
    leaves.update(window.constant_leaves(local, gather_images=True))
    leaves.update(window.groups or {})
    value = window.window_loss(leaves)
    loss = total(value)
    # the leaves are detached from the towers: this backward touches no parameter
    window.scaled_for_backward(loss).backward()
    # DDP/FSDP average gradients over ranks; the rows of this rank carry all of their gradient,
    # so multiply by R here and the average becomes the sum over ranks.
    rank, world = window.exchange.rank, window.exchange.world_size
    row_grads = {
        key: _grad(leaves[key])[window.offset(key) : window.offset(key) + window.counts(key)[rank]] * world
        for key in window.live_keys
    }
    # every rank computed the same scalar gradients: the average over ranks is that value, once
    scalar_grads = {key: leaves[key].grad for key in SCALAR_KEYS if key in leaves}
    return value.detach(), row_grads, scalar_grads


def sharded_loss(window: Window, local: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict, dict]:
    """Phase 2 split over ranks: this rank's block of logit rows (its images against every text).

    Its backward gives the gradient of the whole L(W) through the block: complete for this rank's
    image rows, a partial sum for every text row and for `logit_scale`/`logit_bias`. The text-row
    partials go to their owners summed (one reduce-scatter), the scalar partials and the per-rank loss
    values are summed over ranks (one all-reduce of a few numbers), so every rank ends with the same
    L(W) and scalar gradients as in the unsharded phase."""
    exchange, world = window.exchange, window.exchange.world_size
    leaves = {
        # only the texts are gathered: this rank's rows of the logit matrix need only its own images
        "image_features": local["image_features"].detach(),
        "text_features": window.gather(local["text_features"], "text_features").detach(),
    }
    for key in window.live_keys:  # a locked tower's rows are constants: no gradient is taken for them
        leaves[key].requires_grad_()
    leaves.update(_scalar_leaves(local))
    leaves.update(window.constant_leaves(local, gather_images=False))
    leaves.update(window.groups or {})
    assert isinstance(window.loss_fn, ShardedLoss)
    # a grouped window's texts are cut over ranks otherwise than its images: the loss learns which are this rank's
    texts = {} if window.groups is None else {"text_rows": (
        window.offset("text_features"), window.offset("text_features") + window.counts("text_features")[exchange.rank])}
    part = window.loss_fn.sharded(*window.loss_inputs(leaves), row_offset=window.local_offset,
                                  reduce_column_lse=window.reduce_column_lse, **texts)
    window.scaled_for_backward(total(part)).backward()
    # × R: DDP/FSDP average the tower gradients over ranks (as in the unsharded phase)
    row_grads = {}
    if "image_features" in window.live_keys:
        row_grads["image_features"] = leaves["image_features"].grad * world
    if "text_features" in window.live_keys:
        row_grads["text_features"] = exchange.reduce_scatter_rows(leaves["text_features"].grad,
                                                                  window.counts("text_features")) * world
    scalar_keys = [key for key in SCALAR_KEYS if key in leaves]
    values = part.detach().double().reshape(-1)  # L(W)'s part, or each of its terms' parts
    parts = torch.cat([values, *(leaves[key].grad.double().reshape(1) for key in scalar_keys)])
    summed = exchange.sum_over_ranks(parts)  # Σ_r: L(W) (or its terms), ∂(s·L)/∂t, ∂(s·L)/∂b — counted once
    scalar_grads = {
        key: summed[len(values) + index].to(leaves[key].grad.dtype).reshape(leaves[key].grad.shape)
        for index, key in enumerate(scalar_keys)
    }
    return summed[: len(values)].reshape(part.shape), row_grads, scalar_grads


def run_cache(window: Window) -> torch.Tensor:
    states, local = window.cache()
    # phase 2: s·L(W) once, on detached leaves
    loss, row_grads, scalar_grads = (sharded_loss if window.sharded else whole_loss)(window, local)

    # phase 3: replay each microbatch with grad and push its cached row gradients into the towers
    start = dict.fromkeys(FEATURE_KEYS, 0)
    last_index = len(window.microbatches) - 1
    for index, (mb, state) in enumerate(zip(window.microbatches, states, strict=True)):
        sizes = {key: window.rows_of(mb, key) for key in FEATURE_KEYS}
        with window.sync(last=index == last_index):
            with state.replayed():
                out = window.grad_forward(mb, index)
            # d(surrogate)/d(features) is exactly the cached row gradient (already carrying s and R)
            surrogate = sum(
                (loss_precision(out[key]) * row_grads[key][start[key] : start[key] + sizes[key]]).sum()
                for key in window.live_keys
            ) + window.term_part(out)
            if index == last_index:
                # logit_scale / logit_bias: their gradient was taken once in phase 2
                surrogate = surrogate + sum((out[key] * grad).sum() for key, grad in scalar_grads.items())
            backward(surrogate)
        start = {key: start[key] + sizes[key] for key in FEATURE_KEYS}
    return loss
