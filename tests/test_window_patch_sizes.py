"""Microbatches of different patch sizes in one window (OpenCLIP's --naflex-patch-sizes; timm's patch-embedding
interpolator resamples the embedding to each microbatch's [B, N, Ph, Pw, C] patches): the window is exact per
microbatch, each replay runs with its own patch size. Teeth: OpenCLIP's per-microbatch coefficient fails."""

from __future__ import annotations

import pytest
import torch
from window_cases import failures, loss_for

from naflexclip import accumulate_gradients, create_model
from naflexclip.audit.gradient_audit import collect_gradients, gradient_errors, tolerance_for
from naflexclip.audit.openclip_rule import per_microbatch_scale_gradients
from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.window import output_dict, window_loss_scale


def _model(siglip: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("tiny", loss="siglip" if siglip else "clip", patch_interpolator=True).double().eval()


def _microbatch(rows: int, patch_size: int, seed: int) -> dict:
    """A NaFlex microbatch whose patches are [B, N, P, P, 3] of its own patch size P."""
    batch = random_naflex_batch(rows, patch_size=patch_size, context_length=16,
                                generator=torch.Generator().manual_seed(seed))
    patches = batch["image"]["patches"]
    batch["image"]["patches"] = patches.view(*patches.shape[:2], patch_size, patch_size, 3)
    return batch


def _reference(model: torch.nn.Module, loss_fn: torch.nn.Module, microbatches: list[dict], scale: float
               ) -> dict[str, torch.Tensor]:
    """scale · ∇L of the window by one explicit backward over the features of the individually forwarded
    microbatches (each at its patch size), concatenated."""
    model.zero_grad(set_to_none=True)
    outs = [output_dict(model(image=mb["image"], text=mb["text"])) for mb in microbatches]
    loss = loss_fn(torch.cat([o["image_features"] for o in outs]), torch.cat([o["text_features"] for o in outs]),
                   outs[0]["logit_scale"], outs[0].get("logit_bias"))
    (scale * loss.sum()).backward()
    reference = collect_gradients(model)
    model.zero_grad(set_to_none=True)
    return reference


@pytest.mark.parametrize(("method", "siglip"), [("cache", False), ("replay", True)])
def test_a_window_of_microbatches_with_different_patch_sizes_equals_its_full_objective(method, siglip):
    model, loss_fn = _model(siglip), loss_for(siglip)
    microbatches = [_microbatch(3, 4, seed=1), _microbatch(2, 2, seed=2), _microbatch(4, 6, seed=3)]
    sizes = [3, 2, 4]
    scale = window_loss_scale(sizes, 4, "sqrt")
    reference = _reference(model, loss_fn, microbatches, scale)
    assert all(g.abs().max() > 0 for g in reference.values() if g is not None)
    stats = accumulate_gradients(model, loss_fn, microbatches, loss_scale="sqrt", reference_batch_size=4,
                                 method=method)
    assert stats.batch_sizes == tuple(sizes) and stats.scale == scale
    assert failures(model, reference) == {}
    # teeth: OpenCLIP's rule (each replay's own coefficient) misses the same reference
    model.zero_grad(set_to_none=True)
    per_microbatch_scale_gradients(model, loss_fn, microbatches, loss_scale="sqrt", reference_batch_size=4)
    errors = gradient_errors(model, collect_gradients(model), reference)
    assert any(err > tolerance_for(name, torch.float64) for name, err in errors.items())


def test_the_patch_interpolator_adds_no_weights_and_is_the_identity_at_the_models_patch_size():
    plain, interpolating = create_model("tiny"), _model(False)
    assert set(plain.state_dict()) == set(interpolating.state_dict())  # checkpoints load either way
    native = _microbatch(2, 4, seed=4)  # the tiny preset's patch size
    flat = {**native["image"], "patches": native["image"]["patches"].flatten(2)}
    other = _microbatch(2, 6, seed=4)
    with torch.no_grad():
        assert torch.equal(interpolating.encode_image(native["image"]), interpolating.encode_image(flat))
        assert torch.isfinite(interpolating.encode_image(other["image"])).all()
