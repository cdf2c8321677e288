"""Shared builders for the window tests: tiny float64 models, NaFlex windows, gradient comparison."""

from __future__ import annotations

import functools

import torch

from naflexclip import create_loss, create_model
from naflexclip.audit.gradient_audit import collect_gradients, full_batch_gradients, gradient_errors, tolerance_for
from naflexclip.audit.random_windows import random_naflex_batch


@functools.cache
def tiny_model(siglip: bool, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """One initialisation per (loss, dtype), shared by the tests that only read it."""
    torch.manual_seed(seed)
    model = create_model("tiny", loss="siglip" if siglip else "clip").to(dtype).eval()
    return model


def naflex_window(num_examples: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    return random_naflex_batch(
        num_examples, patch_size=4, context_length=16, generator=torch.Generator().manual_seed(seed), dtype=dtype
    )


def loss_for(siglip: bool) -> torch.nn.Module:
    return create_loss("siglip" if siglip else "clip")


def failures(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Parameters whose current .grad is outside the tolerance (docs/accumulation.md) of `reference`."""
    dtype = next(model.parameters()).dtype
    errors = gradient_errors(model, collect_gradients(model), reference)
    return {name: err for name, err in errors.items() if err > tolerance_for(name, dtype)}


__all__ = ["failures", "full_batch_gradients", "loss_for", "naflex_window", "tiny_model"]
