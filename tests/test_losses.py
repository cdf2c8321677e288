"""Our CLIP and SigLIP losses equal open_clip's on the same features (an independent reference)."""

import open_clip.loss as oc_loss
import pytest
import torch
import torch.nn.functional as F

from naflexclip import ClipLoss, SigLipLoss, create_loss, create_model


def features(n: int, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)
    return image, text


@pytest.mark.parametrize("n", [1, 3, 17])
def test_clip_loss_matches_open_clip(n):
    image, text = features(n)
    scale = torch.tensor(14.3, dtype=torch.float64)
    ours = ClipLoss()(image, text, scale)
    theirs = oc_loss.ClipLoss()(image, text, scale)
    assert torch.allclose(ours, theirs, rtol=1e-13, atol=0)


@pytest.mark.parametrize("n", [1, 3, 17])
def test_siglip_loss_matches_open_clip(n):
    image, text = features(n, seed=1)
    scale = torch.tensor(10.0, dtype=torch.float64)
    bias = torch.tensor(-10.0, dtype=torch.float64)
    ours = SigLipLoss()(image, text, scale, bias)
    theirs = oc_loss.SigLipLoss()(image, text, scale, bias)
    assert torch.allclose(ours, theirs, rtol=1e-13, atol=0)


def test_losses_differ_when_pairs_are_shuffled():
    # teeth: a loss that ignored the pairing would pass the comparisons above for symmetric inputs
    image, text = features(6, seed=2)
    scale = torch.tensor(20.0, dtype=torch.float64)
    assert not torch.allclose(ClipLoss()(image, text, scale), ClipLoss()(image, text.flip(0), scale))


def test_a_loss_is_chosen_by_name_and_the_model_starts_as_it_needs():
    assert type(create_loss("clip")) is ClipLoss
    assert type(create_loss("siglip", tile_size=3)) is SigLipLoss and create_loss("siglip", tile_size=3).tile_size == 3
    for bad in ("sigmoid", True):  # True: the boolean the choice used to be
        with pytest.raises(ValueError, match=rf"unknown loss {bad!r}; choose one of \['clip', 'siglip'\]"):
            create_loss(bad)
    clip, siglip = create_model("tiny"), create_model("tiny", loss="siglip")
    assert clip.config.loss == "clip" and clip.logit_bias is None
    assert siglip.config.loss == "siglip" and float(siglip.logit_bias) == -10.0
    with pytest.raises(ValueError, match="unknown loss 'sigmoid'"):
        create_model("tiny", loss="sigmoid")


@pytest.mark.parametrize("loss_cls", [ClipLoss, SigLipLoss])
def test_a_loss_moves_and_casts_like_any_module(loss_cls):
    loss = loss_cls(tile_size=2)
    assert loss.to("cpu") is loss and loss.double() is loss and loss.float() is loss
    owner = torch.nn.ModuleDict({"loss": loss_cls(), "head": torch.nn.Linear(2, 2)}).double()  # moving its owner
    assert owner["head"].weight.dtype == torch.float64
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    scale, bias = torch.tensor(3.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
    assert float(owner["loss"](x, y, scale, bias)) == float(loss_cls()(x, y, scale, bias))
