"""OpenCLIP names through the rest of naflexclip: `train --model NAME --pretrained FILE` fine-tunes open_clip's
weights (an open_clip_train checkpoint), `export --format openclip` hands the run back to open_clip with equal
embeddings, `verify` passes on the name's model, and the lock groups, FSDP2 units and grad checkpointing cover
its towers."""

from __future__ import annotations

from pathlib import Path

import open_clip
import pytest
import torch
from openclip_cases import openclip_model, tiny_name

from naflexclip import create_model
from naflexclip.cli import main
from naflexclip.models.lock import image_groups
from naflexclip.models.run_weights import load_checkpoint_model

TRAIN_FLAGS = ["--epochs", "1", "--lr", "1e-4", "--warmup", "1", "--synthetic-train-size", "32",
               "--synthetic-val-size", "8", "--naflex-seq-lens", "9", "16", "--naflex-max-tokens-per-batch", "96",
               "--accum-freq", "2", "--workers", "0", "--zero-shot-samples", "8", "--device", "cpu", "--no-plot",
               "--stop-after-steps", "2"]


@pytest.mark.slow
def test_train_from_an_open_clip_train_checkpoint_and_export_back(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    tiny = tiny_name("ViT-B-32-quickgelu")
    theirs = openclip_model(tiny, seed=11)
    start = tmp_path / "epoch_3.pt"
    torch.save({"epoch": 3, "name": "their-run", "state_dict": {f"module.{k}": v for k, v in
                                                                 theirs.state_dict().items()}}, start)
    assert main(["train", "--model", tiny, "--pretrained", str(start), "--logs", str(tmp_path / "logs"),
                 "--name", "run", *TRAIN_FLAGS]) == 0
    model, config = load_checkpoint_model(tmp_path / "logs" / "run" / "checkpoints")
    assert config["model"] == tiny and config["pretrained"] == str(start.resolve())
    assert config["data"]["hf_processor"] == f"open_clip:{tiny}"
    imported = create_model(tiny, pretrained=str(start))
    assert not torch.equal(model.visual.embeds.pos_embed, imported.visual.embeds.pos_embed)  # it trained

    out = tmp_path / "finetuned.pt"
    assert main(["export", "--checkpoint", str(tmp_path / "logs" / "run" / "checkpoints"), "--format", "openclip",
                 "--out", str(out)]) == 0
    back = open_clip.create_model(tiny, pretrained=str(out), output_dict=True).eval()
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    tokens = open_clip.get_tokenizer(tiny)(["a red circle", "two blue squares"])[:, :model.context_length]
    with torch.no_grad():
        expected, ours = back(image=pixels, text=tokens), model(image=pixels, text=tokens)
    for key in ("image_features", "text_features"):
        assert float((expected[key] - ours[key]).abs().max()) <= 1e-5, key

    capsys.readouterr()
    assert main(["verify", "--checkpoint", str(tmp_path / "logs" / "run" / "checkpoints"), "--splits", "1",
                 "--accum-method", "cache"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["ViT-B-32-quickgelu", "ViT-B-16-SigLIP2"])
def test_verify_passes_on_an_openclip_name(name: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--model", tiny_name(name), "--splits", "1", "--accum-freq", "2", "--batch-size",
                 "3", "--accum-method", "cache"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_bad_model_name_and_missing_tag_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--model", "RN50", "--logs", str(tmp_path)]) == 2
    assert "--model RN50: cannot be a NaFlex model" in capsys.readouterr().err
    assert main(["train", "--model", "ViT-B-16", "--pretrained", "laion2b_s34b_b88k", "--cache-dir",
                 str(tmp_path / "empty"), "--logs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not in a local cache" in err and str(tmp_path / "empty") in err and len(err.strip().splitlines()) == 1


def test_lock_groups_fsdp_units_and_checkpointing_cover_the_towers() -> None:
    model = create_model(tiny_name("ViT-B-32-quickgelu")).double()
    groups = image_groups(model)
    stem = {id(p) for p in groups[0]}
    for param in (model.visual.embeds.cls_token, model.visual.embeds.pos_embed, model.visual.norm_pre.weight):
        assert id(param) in stem  # OpenCLIP's first lock group: conv1, class token, positions, ln_pre
    assert id(model.visual.norm.weight) in {id(p) for p in groups[-2]}  # ln_post with the last block
    assert len(model.sharding_units()) == 4
    model.lock_image_tower(unlocked_groups=1)
    assert {n for n, p in model.named_parameters() if p.requires_grad and n.startswith(("visual", "image"))} == {
        "image_projection.weight"}
    model = create_model(tiny_name("ViT-B-32-quickgelu")).double()
    image = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    text = torch.randint(1, 400, (2, model.context_length))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        out = model(image=image, text=text)
        (out["image_features"] @ out["text_features"].T).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.set_grad_checkpointing(True)
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    assert all(torch.allclose(plain[k], checkpointed[k], atol=1e-12) for k in plain)
