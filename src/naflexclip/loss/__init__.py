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
