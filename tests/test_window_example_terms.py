"""Per-example terms in the window (SigLIP 2's LocCa decoder): the accumulated gradient equals
s(W)·∇[L(W) + λ/Z(W)·Σ_i ℓ(i)] of the whole window, Z(W) the window's target tokens, for every split and method;
normalising by a microbatch's own tokens (the per-microbatch rule) fails the same comparison."""

import random

import pytest
import torch

from naflexclip.audit.gradient_audit import collect_gradients
from naflexclip.audit.random_windows import random_naflex_batch, random_split_sizes
from naflexclip.batch import EXAMPLE_INPUTS, concat_microbatches, split_batch
from naflexclip.loss import create_loss
from naflexclip.models.naflex_clip import NaFlexClip, model_config
from naflexclip.objectives.locca_decoder import (
    DECODER_SIZES,
    LoccaTerm,
    attach_decoder,
    random_decoder_inputs,
    target_tokens,
)
from naflexclip.window import accumulate_gradients, window_loss_scale

WEIGHT = 0.7
TERM = LoccaTerm(WEIGHT)


def _model(loss: str) -> NaFlexClip:
    torch.manual_seed(0)
    model = NaFlexClip(model_config("tiny", loss=loss))
    attach_decoder(model, DECODER_SIZES["tiny"])
    return model.double()


def _locca(model, mb):
    """Each example's decoder loss sum, from the grad forward's image tokens."""
    out = model(image=mb["image"], text=mb["text"], output_tokens=True)
    return out, TERM.example_losses(model, mb, out, {})["locca"]


def _batch(model: NaFlexClip, n: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    batch = random_naflex_batch(n, patch_size=4, context_length=16, generator=gen)
    batch[EXAMPLE_INPUTS] = random_decoder_inputs(n, model.decoder.vocab, DECODER_SIZES["tiny"].max_length, gen)
    return batch


def _reference(model, loss_fn, batch, scale, normaliser=None):
    model.zero_grad(set_to_none=True)
    out, locca = _locca(model, batch)
    pair = loss_fn(out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"))
    tokens = normaliser if normaliser is not None else target_tokens(batch)
    (scale * (pair + WEIGHT * locca.sum() / tokens)).backward()
    return collect_gradients(model)


def _worst(grads, reference):
    return max((grads[k] - reference[k]).norm().item() / reference[k].norm().item() for k in reference
               if "pos_embed" not in k)


@pytest.mark.parametrize("loss", ["clip", "siglip"])
@pytest.mark.parametrize("method", ["cache", "replay"])
def test_the_window_with_a_decoder_term_equals_the_full_batch_objective(loss, method):
    model = _model(loss)
    loss_fn = create_loss(loss)
    batch = _batch(model, 7)
    rng = random.Random(0)
    for _ in range(2):
        sizes = random_split_sizes(7, 3, rng)
        microbatches = split_batch(batch, sizes)
        scale = window_loss_scale(sizes, 4, "linear")
        reference = _reference(model, loss_fn, concat_microbatches(microbatches), scale)
        model.zero_grad(set_to_none=True)
        stats = accumulate_gradients(model, loss_fn, microbatches, loss_scale="linear", reference_batch_size=4,
                                     method=method, terms=[TERM])
        assert _worst(collect_gradients(model), reference) < 1e-10
        assert set(stats.example_terms) == {"locca"} and stats.example_terms["locca"] > 0


def test_normalising_by_each_microbatchs_own_tokens_fails_the_same_comparison():
    model = _model("siglip")
    loss_fn = create_loss("siglip")
    batch = _batch(model, 9)
    sizes = [2, 3, 4]
    microbatches = split_batch(batch, sizes)
    scale = window_loss_scale(sizes, 4, "linear")
    reference = _reference(model, loss_fn, concat_microbatches(microbatches), scale)
    # the per-microbatch rule: each microbatch's decoder loss divided by its own target tokens
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, loss_fn, microbatches, loss_scale="linear", reference_batch_size=4)
    for mb in microbatches:
        _, locca = _locca(model, mb)
        (scale * WEIGHT * locca.sum() / target_tokens(mb)).backward()
    assert _worst(collect_gradients(model), reference) > 1e-3


def test_a_locked_image_tower_cannot_feed_a_decoder_term():
    model = _model("clip")
    model.lock_image_tower()
    batch = _batch(model, 4)
    with pytest.raises(ValueError, match="image tower is locked"):
        accumulate_gradients(model, create_loss("clip"), split_batch(batch, [2, 2]), terms=[TERM])


def test_verify_recipe_siglip2_passes_and_its_per_microbatch_column_fails(capsys):
    from naflexclip.cli import main

    argv = ["verify", "--recipe", "siglip2", "--splits", "1", "--accum-freq", "3", "--batch-size", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "locca (per target token of the window)" in out
    decoder_rows = [line.split() for line in out.splitlines() if line.startswith("decoder.")]
    assert decoder_rows and all(row[-2] == "ok" and float(row[-1]) > 1e-3 for row in decoder_rows)


def test_verify_recipe_refuses_a_negative_weight_in_one_line(capsys):
    from naflexclip.cli import main

    assert main(["verify", "--locca-loss-weight", "-1"]) == 2
    out = capsys.readouterr().out.strip()
    assert "--locca-loss-weight must be a finite number >= 0, got -1.0" in out and out.count("\n") == 0
