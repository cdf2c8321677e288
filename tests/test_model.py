"""The model: presets, OpenCLIP output dict, initialisation, padding invariance, errors."""

import math

import pytest
import torch
import torch.nn.functional as F
from window_cases import naflex_window, tiny_model

from naflexclip import create_loss, create_model
from naflexclip.audit.gradient_audit import verify_window
from naflexclip.batch import concat_microbatches
from naflexclip.processing.naflex_transform import tokenize


def test_output_dict_and_attributes():
    model = tiny_model(False)
    batch = naflex_window(3)
    out = model(**batch)
    assert set(out) == {"image_features", "text_features", "logit_scale"}
    assert out["image_features"].shape == out["text_features"].shape == (3, 16)
    assert torch.allclose(out["image_features"].norm(dim=-1), torch.ones(3, dtype=torch.float64))
    assert model.image_patch_size == 4 and model.context_length == 16 and model.vocab_size == 49408
    assert out["logit_scale"].item() == pytest.approx(1 / 0.07)


def test_siglip_initialisation():
    model = create_model("tiny", loss="siglip")
    out = model(**naflex_window(2, dtype=torch.float32))
    assert out["logit_scale"].item() == pytest.approx(10.0)
    assert out["logit_bias"].item() == -10.0


def test_logit_scale_clamp():
    model = create_model("tiny")
    with torch.no_grad():
        model.logit_scale.fill_(10.0)
    model.clamp_logit_scale_()
    assert model.logit_scale.item() == pytest.approx(math.log(100))


def test_features_do_not_depend_on_padding():
    # a microbatch's padded length depends on its neighbours; an example's features must not
    model = tiny_model(False)
    short = naflex_window(1, seed=11)
    long = naflex_window(1, seed=12)
    alone = model.encode_image(short["image"])
    padded = model.encode_image(concat_microbatches([short, long])["image"])[:1]
    assert torch.allclose(alone, padded, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
def test_presets_build(name):
    model = create_model(name)
    assert model.image_patch_size in (4, 16)


def test_unknown_preset_and_override_name_the_value():
    with pytest.raises(ValueError, match="'huge'"):
        create_model("huge")
    with pytest.raises(ValueError, match="'widht'"):
        create_model("tiny", widht=3)


def test_a_path_that_is_no_model_directory_is_named(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"weights")
    with pytest.raises(ValueError) as error:
        create_model(str(file))
    assert f"{str(file)!r} is a file" in str(error.value) and "unknown model preset" not in str(error.value)
    missing = tmp_path / "siglip2-base-dir"
    with pytest.raises(ValueError) as error:
        create_model(str(missing))
    assert f"{str(missing)!r} does not exist" in str(error.value) and "unknown model preset" not in str(error.value)


def test_text_mean_pool_averages_the_caption_not_its_padding():
    model = create_model("tiny", pool_type="mean", ls_init_value=1e-4).double()
    text = tokenize(["a red circle.", "a photo of a large blue star and a small ring."], model.context_length)
    per_token = model.text(text)  # pool "none": every position's projection, [B, T, D]
    features = model.encode_text(text)
    for row, ids, got in zip(per_token, text, features, strict=True):
        length = int((ids != 0).sum())  # start, words, end-of-text
        assert length < model.context_length  # padding is there to be left out
        assert torch.allclose(got, F.normalize(row[:length].mean(dim=0), dim=-1), rtol=0, atol=1e-12)
    assert model.text_pool_type == "mean" and create_model("tiny").text_pool_type == "argmax"


def test_window_is_exact_with_the_mean_pooled_layerscale_text_tower():
    torch.manual_seed(0)
    model = create_model("tiny", pool_type="mean", ls_init_value=1e-4).double().eval()
    result = verify_window(model, create_loss("clip"), naflex_window(9), accum_freq=3, reference_batch_size=3,
                           loss_scale="linear", methods=("cache", "replay"), num_splits=2, seed=0)
    assert result.passed and max(g.legacy_error for g in result.groups) > 1e-2


def test_unknown_text_pool_type_names_the_value():
    with pytest.raises(ValueError, match="'avg'"):
        create_model("tiny", pool_type="avg")
