"""OpenCLIP model names as NaFlex models: at the native grid our embeddings and logits equal open_clip's own model
on the same pixels and tokens, from every weight-file form; other grids run as NaFlex; export loads back in
open_clip with equal embeddings; names whose towers cannot be NaFlex are refused in one line (docs/openclip.md)."""

from __future__ import annotations

import math
from pathlib import Path

import open_clip
import pytest
import torch
from openclip_cases import openclip_model, randomize_, tiny_name
from safetensors.torch import save_file

from naflexclip import create_model
from naflexclip.families import data_processing, openclip_sources
from naflexclip.families import openclip as family
from naflexclip.families.openclip_names import OpenClipError
from naflexclip.families.openclip_weights import import_state_dict
from naflexclip.models.naflex_clip import NaFlexClip

FLOAT32_ATOL = 1e-5  # the bar for normalised embeddings and logits in float32
# float64: timm resamples the position table in float32 (an identity at the native grid, but the table's float64
# digits beyond float32 are gone), so the image side agrees to ~1e-9, the text side exactly
FLOAT64_ATOL = 1e-7
# quickgelu + class token + ln_pre; SigLIP / SigLIP 2 (timm MAP trunk, no projection); CLIPA (no ln_pre, average
# pooling, norm after pool); LayerScale; a NaFlex name (timm NaFlexVit trunk with register tokens)
NAMES = ["ViT-B-32-quickgelu", "ViT-B-16-SigLIP", "ViT-B-16-SigLIP2", "ViT-L-14-CLIPA", "ViT-M-16-alt",
         "naflex_ViT-B-16"]


def _pixels(image_size: int, batch: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(5)).to(dtype)


def _tokens(model: NaFlexClip, batch: int = 3) -> torch.Tensor:
    """Token ids with an end-of-text (the largest id, as argmax pooling finds it) at different lengths, padded."""
    generator = torch.Generator().manual_seed(6)
    vocab, length = model.vocab_size, model.context_length
    tokens = torch.randint(1, vocab - 1, (batch, length), generator=generator)
    for row, end in enumerate(range(3, 3 + batch)):
        tokens[row, end] = vocab - 1
        tokens[row, end + 1:] = 0
    return tokens


def _as_naflex(pixels: torch.Tensor, patch: int) -> dict[str, torch.Tensor]:
    """A dense batch as the NaFlex dict of its full grid ((ph, pw, C) patches, row-major), no padding."""
    b, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    patches = pixels.reshape(b, c, gh, patch, gw, patch).permute(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, -1)
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    coord = torch.stack([rows.flatten(), cols.flatten()], dim=-1).expand(b, -1, -1)
    return {"patches": patches, "patch_coord": coord, "patch_valid": torch.ones(b, gh * gw, dtype=torch.bool)}


def _compare(theirs: torch.nn.Module, ours: NaFlexClip, dtype: torch.dtype) -> dict[str, float]:
    theirs, ours = theirs.to(dtype), ours.to(dtype).eval()
    size = theirs.visual.image_size if hasattr(theirs.visual, "image_size") else None
    size = size[0] if isinstance(size, (tuple, list)) else size
    pixels, tokens = _pixels(size or 48, dtype=dtype), _tokens(ours)
    with torch.no_grad():
        expected = {key: value.detach() for key, value in theirs(image=pixels, text=tokens).items()}
        dense = ours(image=pixels, text=tokens)
        naflex = ours(image=_as_naflex(pixels, ours.image_patch_size), text=tokens)

    def logits(out: dict) -> torch.Tensor:
        bias = out.get("logit_bias")
        scores = out["logit_scale"] * out["image_features"] @ out["text_features"].T
        return scores if bias is None else scores + bias

    errors = {}
    for tag, out in (("dense", dense), ("naflex", naflex)):
        for key in ("image_features", "text_features"):
            errors[f"{tag} {key}"] = float((out[key] - expected[key]).abs().max())
        errors[f"{tag} logits"] = float((logits(out) - logits(expected)).abs().max())
    return errors


@pytest.mark.parametrize("name", NAMES)
def test_native_grid_embeddings_equal_open_clip_float32(name: str, tmp_path: Path) -> None:
    tiny = tiny_name(name)
    theirs = openclip_model(tiny, seed=1)
    file = tmp_path / "plain.pt"
    torch.save(theirs.state_dict(), file)
    ours = create_model(tiny, pretrained=str(file))
    errors = _compare(theirs, ours, torch.float32)
    assert max(errors.values()) <= FLOAT32_ATOL, errors


@pytest.mark.parametrize("name", NAMES)
def test_native_grid_embeddings_equal_open_clip_float64(name: str, tmp_path: Path) -> None:
    tiny = tiny_name(name)
    theirs = openclip_model(tiny, seed=2)
    ours = family.build(tiny)
    ours.load_state_dict(import_state_dict(ours, theirs.state_dict(), "test"))
    errors = _compare(theirs, ours, torch.float64)
    assert max(errors.values()) <= FLOAT64_ATOL, errors


def test_every_file_form_loads_the_same_weights(tmp_path: Path) -> None:
    tiny = tiny_name("ViT-B-32-quickgelu")
    theirs = openclip_model(tiny, seed=3)
    state = theirs.state_dict()
    forms = {
        "open_clip_train.pt": {"epoch": 3, "name": "run", "state_dict": {f"module.{k}": v for k, v in state.items()},
                               "optimizer": {}},
        "plain.pt": state,
        "pytorch_model.bin": state,
    }
    for filename, content in forms.items():
        torch.save(content, tmp_path / filename)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "weights.safetensors"))
    reference = family.build(tiny)
    reference.load_state_dict(import_state_dict(reference, state, "test"))
    for filename in [*forms, "weights.safetensors"]:
        loaded = create_model(tiny, pretrained=str(tmp_path / filename))
        for key, value in reference.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), (filename, key)


def test_pretrained_tag_and_hf_hub_resolve_from_a_local_cache_only(tmp_path: Path, monkeypatch) -> None:
    tiny = tiny_name("ViT-B-16-SigLIP2")
    theirs = openclip_model(tiny, seed=4)
    repo = tmp_path / "hub" / "models--timm--ViT-B-16-SigLIP2" / "snapshots" / "0123abc"
    repo.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(repo / "open_clip_model.safetensors"))
    monkeypatch.setattr(openclip_sources, "pretrained_cfg",
                        lambda name, tag: {"hf_hub": "timm/ViT-B-16-SigLIP2/"} if tag == "webli" else {})
    for source in ("webli", "hf-hub:timm/ViT-B-16-SigLIP2"):
        ours = create_model(tiny, pretrained=source, cache_dir=str(tmp_path / "hub"))
        errors = _compare(theirs, ours, torch.float32)
        assert max(errors.values()) <= FLOAT32_ATOL, (source, errors)
    with pytest.raises(OpenClipError, match=r"open_clip_model.safetensors or open_clip_pytorch_model.bin of "
                                            r"'timm/ViT-B-16-SigLIP2'.*looked in .*elsewhere") as error:
        create_model(tiny, pretrained="webli", cache_dir=str(tmp_path / "elsewhere"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name, tag_quick_gelu, warned", [
    ("ViT-B-32", True, "ViT-B-32-quickgelu-tiny"),  # the OpenAI weights into the GELU name
    ("ViT-B-32-quickgelu", False, "ViT-B-32-tiny"),  # GELU-trained weights into the QuickGELU name
    ("ViT-B-32-quickgelu", True, None),  # the activation the weights were trained with: nothing to say
])
def test_a_tag_trained_with_another_activation_is_named_in_one_line(
        name: str, tag_quick_gelu: bool, warned: str | None, tmp_path: Path, monkeypatch, caplog,
        capsys: pytest.CaptureFixture) -> None:
    """As open_clip warns on `create_model("ViT-B-32", pretrained="openai")` (its tag says `quick_gelu`): one line
    naming the name, the tag and the name of the weights' activation."""
    from naflexclip.cli import main

    tiny, _ = tiny_name(name), tiny_name("ViT-B-32" if "quickgelu" in name else "ViT-B-32-quickgelu")
    torch.save(openclip_model(tiny, seed=8).state_dict(), tmp_path / "weights.pt")
    monkeypatch.setattr(openclip_sources, "pretrained_cfg", lambda model, tag: {
        "url": "https://example.invalid/weights.pt", "quick_gelu": tag_quick_gelu} if tag == "openai" else {})
    with caplog.at_level("WARNING"):
        assert main(["verify", "--model", tiny, "--pretrained", "openai", "--cache-dir", str(tmp_path), "--splits",
                     "1", "--accum-freq", "2", "--batch-size", "3", "--accum-method", "cache"]) == 0
    assert "PASS" in capsys.readouterr().out
    lines = [record.getMessage() for record in caplog.records if "GELU" in record.getMessage()]
    if warned is None:
        assert lines == []
        return
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "--pretrained openai" in lines[0] and f"--model {tiny}" in lines[0] and f"--model {warned}" in lines[0]


def test_a_wrong_position_table_or_ln_pre_mapping_is_caught(tmp_path: Path) -> None:
    """The comparison is sharp: a transposed position table or a dropped ln_pre changes the embeddings."""
    tiny = tiny_name("ViT-B-32-quickgelu")
    theirs = openclip_model(tiny, seed=5)
    ours = family.build(tiny)
    ours.load_state_dict(import_state_dict(ours, theirs.state_dict(), "test"))
    assert max(_compare(theirs, ours, torch.float64).values()) <= FLOAT64_ATOL
    with torch.no_grad():
        ours.visual.embeds.pos_embed.copy_(ours.visual.embeds.pos_embed.transpose(1, 2).clone())
    assert max(_compare(theirs, ours, torch.float64).values()) > 1e-3
    ours.load_state_dict(import_state_dict(ours, theirs.state_dict(), "test"))
    with torch.no_grad():
        ours.visual.norm_pre.weight.fill_(1.0), ours.visual.norm_pre.bias.zero_()
    assert max(_compare(theirs, ours, torch.float64).values()) > 1e-3


@pytest.mark.parametrize("name", ["ViT-B-32-quickgelu", "ViT-B-16-SigLIP2"])
def test_other_grids_run_as_naflex(name: str) -> None:
    """Non-square grids and padded rows: each image's embedding equals that image alone (no leak through padding),
    and differs from the native grid's (the table is resampled per grid)."""
    from naflexclip.audit.random_windows import random_naflex_batch

    model = family.build(tiny_name(name)).eval()
    batch = random_naflex_batch(4, patch_size=model.image_patch_size, context_length=model.context_length,
                                seq_lens=(6, 12, 20), generator=torch.Generator().manual_seed(2),
                                dtype=torch.float32)
    image = batch["image"]
    grids = image["patch_coord"].amax(dim=1) + 1
    assert any(int(g[0]) != int(g[1]) for g in grids), "the batch must have a non-square grid"
    with torch.no_grad():
        together = model.encode_image(image)
        for row in range(4):
            alone = model.encode_image({key: value[row:row + 1] for key, value in image.items()})
            assert torch.allclose(alone, together[row:row + 1], atol=1e-5)


def test_export_loads_in_open_clip_with_equal_embeddings(tmp_path: Path) -> None:
    for name, suffix in (("ViT-B-32-quickgelu", ".pt"), ("ViT-B-16-SigLIP2", ".safetensors"),
                         ("ViT-L-14-CLIPA", ".pt")):
        tiny = tiny_name(name)
        ours = family.build(tiny)
        randomize_(ours, seed=7)
        out = family.export(ours, tmp_path / f"{tiny}{suffix}")
        theirs = open_clip.create_model(tiny, pretrained=str(out), output_dict=True).eval()
        errors = _compare(theirs, ours, torch.float32)
        assert max(errors.values()) <= FLOAT32_ATOL, (name, suffix, errors)
        back = create_model(tiny, pretrained=str(out))
        for key, value in ours.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), (name, key)


def test_names_that_cannot_be_naflex_are_refused_in_one_line() -> None:
    for name, why in (("RN50", "ModifiedResNet"), ("convnext_base", "not a ViT"), ("EVA02-B-16", "not a ViT"),
                      ("coca_ViT-B-32", "captioning"), ("xlm-roberta-base-ViT-B-32", "Hugging Face model")):
        with pytest.raises(OpenClipError, match=why) as error:
            create_model(name)
        assert str(error.value).startswith(f"--model {name}: cannot be a NaFlex model") and "\n" not in str(error.value)


def test_names_map_to_the_configs_of_open_clip() -> None:
    """Full-size configs (no weights): the native grid, pooling, activation and loss follow the name."""
    b32 = family.model_config("ViT-B-32-quickgelu")
    assert b32.image.pos_embed_grid_size == (7, 7) and b32.image.act == b32.text.act == "quick_gelu"
    assert b32.image.class_token and b32.image.pre_norm and b32.image.global_pool == "token" and b32.loss == "clip"
    siglip2 = family.model_config("ViT-B-16-SigLIP2")
    assert siglip2.loss == "siglip" and siglip2.init_logit_bias == -10 and not siglip2.image_projection
    assert siglip2.image.global_pool == "map" and siglip2.text.act == "gelu_tanh" and not siglip2.text.causal_mask
    naflex = family.model_config("ViT-B-16-SigLIP2-naflex")
    assert naflex.image.pos_embed_interp_mode == "bilinear" and naflex.image.pos_embed_grid_size == (16, 16)
    assert family.model_config("naflex_ViT-B-32").image.pos_embed_grid_size == (7, 7)
    assert family.patch_budget(family.processor_spec("ViT-B-16-SigLIP2-naflex"), 16) == 576
    assert family.patch_budget(family.processor_spec("ViT-B-16"), 16) == 196
    assert math.isclose(b32.init_logit_scale, math.log(1 / 0.07), rel_tol=1e-6)


def test_a_hugging_face_tokenizer_is_read_from_the_local_cache_only(tmp_path: Path) -> None:
    """SigLIP names tokenize with their Hugging Face tokenizer, found in the hub cache's layout (never downloaded),
    as open_clip's HFTokenizer gives the ids; a missing tokenizer is one line naming where it looked."""
    pytest.importorskip("transformers")
    from siglip2_cases import tokenizer_vocab
    from transformers.models.siglip2.tokenization_siglip2 import Siglip2Tokenizer

    tiny = tiny_name("ViT-B-16-SigLIP2")
    with pytest.raises(OpenClipError, match=r"tokenizer 'timm/ViT-B-16-SigLIP2' .*not in a local directory") as error:
        family.tokenizer_dir(tiny, cache_dir=str(tmp_path / "empty"))
    assert "\n" not in str(error.value)
    snapshot = tmp_path / "hub" / "models--timm--ViT-B-16-SigLIP2" / "snapshots" / "abc"
    Siglip2Tokenizer(vocab=tokenizer_vocab(), merges=[], padding_side="right").save_pretrained(snapshot)
    directory = family.tokenizer_dir(tiny, cache_dir=str(tmp_path / "hub"))
    assert directory == str(snapshot)
    processing = data_processing(family.processor_spec(tiny, directory), patch_size=8)
    ids = processing.tokenize(["a red circle", "x"], 16)
    from open_clip.tokenizer import HFTokenizer

    expected = HFTokenizer(directory, context_length=16, clean="canonicalize", local_files_only=True)(
        ["a red circle", "x"])
    assert ids.shape == (2, 16) and torch.equal(ids, expected.to(torch.long))
    assert ids[0, 0] != ids[1, 0]
