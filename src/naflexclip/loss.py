"""Contrastive losses over one batch of features: CLIP (softmax) and SigLIP (sigmoid).

Both are computed over exactly the rows they are given: the window hands them the whole
window's features, so these losses never gather across ranks themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pairwise_logits(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[N, N]` logits, row i = image i against every text: `t · ⟨x_i, y_j⟩ (+ b)`."""
    logits = logit_scale * image_features @ text_features.T
    return logits if logit_bias is None else logits + logit_bias


class ClipLoss(nn.Module):
    """Mean of image→text and text→image cross-entropy over `N` pairs (Radford et al. 2021)."""

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """image_features, text_features: `[N, D]`; logit_scale: exponentiated scalar → scalar loss."""
        logits_per_image = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
        labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2


class SigLipLoss(nn.Module):
    """Pairwise sigmoid loss over all `N×N` pairs, normalised by `N` (Zhai et al. 2023)."""

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """image_features, text_features: `[N, D]`; logit_scale exponentiated; logit_bias scalar."""
        logits = pairwise_logits(image_features, text_features, logit_scale, logit_bias)
        num_pairs = logits.shape[0]
        # +1 on the diagonal (matching pairs), -1 everywhere else
        labels = 2 * torch.eye(num_pairs, device=logits.device, dtype=logits.dtype) - 1
        return -F.logsigmoid(labels * logits).sum() / num_pairs


def create_loss(siglip: bool) -> nn.Module:
    """The loss that matches the model family."""
    return SigLipLoss() if siglip else ClipLoss()
