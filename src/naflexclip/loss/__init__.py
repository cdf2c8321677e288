"""The pair losses over feature rows: CLIP (softmax), SigLIP (sigmoid), their distillation and multi-positive forms.

Each is tiled (the `N×N` logit matrix never exists: O(N·D) memory plus a few `tile × tile` blocks) and has a
per-rank form (`sharded`): rank r computes the block `z[I_r, :]` of its own images against every text, and its
backward gives the gradient of the whole `L(W)` for that block (complete for its image rows, partial sums for the
texts and `logit_scale`/`logit_bias`, which the caller sums over ranks); in one process (`forward`) the block is
the whole matrix. The dense formulas (`*_dense`) are the tests' reference. The math and the exchange:
docs/accumulation.md#the-loss-at-scale.
"""

from __future__ import annotations

from naflexclip.loss.contrastive import (
    LOSSES,
    ClipLoss,
    LossChoice,
    ShardedLoss,
    SigLipLoss,
    clip_loss_dense,
    create_loss,
    loss_choice,
    pairwise_logits,
    siglip_loss_dense,
)
from naflexclip.loss.distill_loss import (
    DistillLoss,
    distill_clip_loss_dense,
    distill_siglip_loss_dense,
    distill_term_dense,
)
from naflexclip.loss.multi_positive_loss import (
    MULTI_POSITIVE_WEIGHTINGS,
    MultiPositiveDistillLoss,
    MultiPositiveLoss,
    multi_positive_clip_loss_dense,
    multi_positive_siglip_loss_dense,
    multi_positive_targets,
    positive_counts,
)
from naflexclip.loss.tiling import DEFAULT_TILE_SIZE

__all__ = [
    "DEFAULT_TILE_SIZE",
    "LOSSES",
    "MULTI_POSITIVE_WEIGHTINGS",
    "ClipLoss",
    "DistillLoss",
    "LossChoice",
    "MultiPositiveDistillLoss",
    "MultiPositiveLoss",
    "ShardedLoss",
    "SigLipLoss",
    "clip_loss_dense",
    "create_loss",
    "distill_clip_loss_dense",
    "distill_siglip_loss_dense",
    "distill_term_dense",
    "loss_choice",
    "multi_positive_clip_loss_dense",
    "multi_positive_siglip_loss_dense",
    "multi_positive_targets",
    "pairwise_logits",
    "positive_counts",
    "siglip_loss_dense",
]
