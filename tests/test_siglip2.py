"""SigLIP 2 interop: import equals transformers' outputs, export loads in transformers with the same outputs,
round trips are bit-equal, and what does not map is refused in one line (docs/siglip2.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from siglip2_cases import CONFIGS, hf_features, make_checkpoint

from naflexclip import create_model, export_model
from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.families import siglip2
from naflexclip.families.siglip2 import Siglip2Error, config_to_transformers
from naflexclip.families.siglip2_processing import siglip2_tokenize
from naflexclip.models.naflex_clip import PRESETS, NaFlexClip

transformers = pytest.importorskip("transformers")

FLOAT32_ATOL = 1e-5  # the bar for normalised embeddings, logit_scale and logit_bias
CAPTIONS = ["a red circle", "Two BLUE squares on a striped background", "x", "a photo of the small star.",
            "1, 2, 3 - go", "a yellow hexagon next to a green ring"]


def _inputs(model: NaFlexClip, directory: Path, dtype: torch.dtype = torch.float32) -> dict:
    """A padded batch of images with several aspect ratios (1x28 up to 6x6 grids) and tokenized captions."""
    batch = random_naflex_batch(len(CAPTIONS), patch_size=model.image_patch_size, context_length=model.context_length,
                                seq_lens=(4, 9, 16, 25, 36), generator=torch.Generator().manual_seed(1), dtype=dtype)
    grids = batch["image"]["patch_coord"].amax(dim=1) + 1
    assert len({tuple(g) for g in grids.tolist()}) >= 4, "the batch must mix aspect ratios"
    assert not batch["image"]["patch_valid"].all(), "the batch must be padded"
    batch["text"] = siglip2_tokenize(str(directory), CAPTIONS, model.context_length)
    return batch


def _max_errors(ours: dict, theirs: dict) -> dict[str, float]:
    return {key: float((ours[key].detach().double() - theirs[key].double()).abs().max()) for key in theirs}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(f"siglip2-{request.param}"), CONFIGS[request.param], seed=3)


def test_import_gives_transformers_outputs_float32(checkpoint: Path) -> None:
    hf = transformers.Siglip2Model.from_pretrained(checkpoint).eval()
    model = create_model(str(checkpoint)).eval()
    batch = _inputs(model, checkpoint)
    with torch.no_grad():
        ours = model(image=batch["image"], text=batch["text"])
    errors = _max_errors(ours, hf_features(hf, batch["image"], batch["text"]))
    assert max(errors.values()) <= FLOAT32_ATOL, errors


def test_import_gives_transformers_outputs_float64(checkpoint: Path) -> None:
    # both sides resample the position table in float32 even in a float64 model (timm's NaFlexVit, transformers'
    # resize_positional_embeddings), so agreement is limited by that one float32 step, not by float64
    hf = transformers.Siglip2Model.from_pretrained(checkpoint).double().eval()
    model = create_model(str(checkpoint)).double().eval()
    batch = _inputs(model, checkpoint, torch.float64)
    with torch.no_grad():
        ours = model(image=batch["image"], text=batch["text"])
    errors = _max_errors(ours, hf_features(hf, batch["image"], batch["text"]))
    assert errors["text_features"] <= 1e-12 and errors["logit_scale"] <= 1e-12, errors
    assert errors["image_features"] <= 1e-7, errors


@pytest.mark.parametrize("wrong", ["pos_embed_interp_mode", "causal_mask"])
def test_equivalence_check_has_teeth(checkpoint: Path, wrong: str) -> None:
    """The same weights in a subtly different architecture (bicubic table resize; causal text mask) fail the bar."""
    hf = transformers.Siglip2Model.from_pretrained(checkpoint).eval()
    right = siglip2.load(checkpoint)
    config = right.config
    if wrong == "pos_embed_interp_mode":
        config = dataclasses.replace(config, image=dataclasses.replace(config.image, pos_embed_interp_mode="bicubic"))
    else:
        config = dataclasses.replace(config, text=dataclasses.replace(config.text, causal_mask=True))
    model = NaFlexClip(config).eval()
    model.load_state_dict(right.state_dict())
    batch = _inputs(model, checkpoint)
    with torch.no_grad():
        ours = model(image=batch["image"], text=batch["text"])
    errors = _max_errors(ours, hf_features(hf, batch["image"], batch["text"]))
    key = "image_features" if wrong == "pos_embed_interp_mode" else "text_features"
    assert errors[key] > 100 * FLOAT32_ATOL, errors


def test_import_export_import_is_bit_equal(checkpoint: Path, tmp_path: Path) -> None:
    model = siglip2.load(checkpoint)
    out = export_model(model, tmp_path / "exported", format="transformers")
    source, exported = load_file(str(checkpoint / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(source) == sorted(exported)
    assert all(torch.equal(source[k], exported[k]) for k in source), "export must give back the source tensors"
    again = siglip2.load(out)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    assert again.config == model.config


def test_export_loads_in_transformers_with_same_outputs(checkpoint: Path, tmp_path: Path) -> None:
    model = siglip2.load(checkpoint)
    with torch.no_grad():  # a "fine-tuned" model: every weight moved, so the export is not the source file
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    out = export_model(model, tmp_path / "exported")
    assert (out / "tokenizer.json").is_file() and (out / "preprocessor_config.json").is_file()
    hf = transformers.Siglip2Model.from_pretrained(out).eval()
    model.eval()
    batch = _inputs(model, out)
    with torch.no_grad():
        ours = model(image=batch["image"], text=batch["text"])
    errors = _max_errors(ours, hf_features(hf, batch["image"], batch["text"]))
    assert max(errors.values()) <= FLOAT32_ATOL, errors
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer("a red circle")["input_ids"] == tokenizer.__class__.from_pretrained(checkpoint)(
        "a red circle")["input_ids"]


def test_small_preset_export_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(Siglip2Error) as error:
        export_model(create_model("small", loss="siglip"), tmp_path / "out")
    message = str(error.value)
    assert "\n" not in message and "'max'" in message and "MAP" in message
    assert not (tmp_path / "out").exists()


def test_clip_model_export_is_refused_naming_logit_bias(checkpoint: Path, tmp_path: Path) -> None:
    model = create_model(str(checkpoint))
    model.logit_bias = None
    with pytest.raises(Siglip2Error, match="no logit_bias"):
        export_model(model, tmp_path / "out")


@pytest.mark.parametrize(("name", "width", "depth", "heads", "mlp"), [
    ("siglip2-base", 768, 12, 12, 3072), ("siglip2-so400m", 1152, 27, 16, 4304)])
def test_presets_are_the_published_architectures(name: str, width: int, depth: int, heads: int, mlp: int) -> None:
    config = config_to_transformers(PRESETS[name])
    for tower in ("vision_config", "text_config"):
        sub = config[tower]
        assert (sub["hidden_size"], sub["num_hidden_layers"], sub["num_attention_heads"], sub["intermediate_size"]) \
            == (width, depth, heads, mlp)
    assert config["vision_config"]["num_patches"] == 256 and config["vision_config"]["patch_size"] == 16
    assert config["text_config"]["vocab_size"] == 256000 and config["text_config"]["max_position_embeddings"] == 64
    # the towers timm/open_clip build have those widths (checked on a 1-layer copy: the full models are slow)
    small = dataclasses.replace(PRESETS[name], image=dataclasses.replace(PRESETS[name].image, depth=1),
                                text=dataclasses.replace(PRESETS[name].text, layers=1, vocab_size=8))
    model = NaFlexClip(small)
    assert model.visual.blocks[0].mlp.fc1.out_features == mlp == model.visual.attn_pool.mlp.fc1.out_features
    assert model.text.transformer.resblocks[0].mlp.c_fc.out_features == mlp


# ---------------------------------------------------------------------------------------------- bad input


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_config_that_is_not_siglip2_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip", "text_config": {}}))
    with pytest.raises(ValueError) as error:
        create_model(str(tmp_path))
    assert "model_type is 'clip'" in _one_line(error)


def test_directory_without_weights_is_refused(tmp_path: Path) -> None:
    directory = make_checkpoint(tmp_path / "ck")
    (directory / "model.safetensors").unlink()
    with pytest.raises(Siglip2Error) as error:
        create_model(str(directory))
    assert "no model.safetensors" in _one_line(error)


@pytest.mark.parametrize("keep", [0.5, 0.0001])  # cut in the tensors, cut in the header
def test_truncated_weights_are_refused_naming_the_file(tmp_path: Path, keep: float) -> None:
    directory = make_checkpoint(tmp_path / "ck")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: int(weights.stat().st_size * keep)])
    with pytest.raises(ValueError) as error:
        create_model(str(directory))
    message = _one_line(error)
    assert str(weights) in message and "truncated or damaged" in message, message


def test_a_file_of_a_checkpoint_directory_names_the_directory(checkpoint: Path) -> None:
    with pytest.raises(ValueError) as error:
        create_model(str(checkpoint / "model.safetensors"))
    assert _one_line(error).endswith(f"pass its directory {str(checkpoint)!r}")


def test_directory_without_tokenizer_is_refused(tmp_path: Path) -> None:
    from naflexclip.families import data_processing

    directory = make_checkpoint(tmp_path / "ck", tokenizer=False)
    with pytest.raises(ValueError) as error:
        data_processing(str(directory), 4)
    assert "has no tokenizer" in _one_line(error)


def _rewrite_weights(directory: Path, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("change", "expected"), [
    (lambda t: t.__setitem__("vision_model.encoder.layers.1.mlp.fc1.weight", torch.zeros(65, 32)),
     "'vision_model.encoder.layers.1.mlp.fc1.weight' has shape (65, 32), the config needs (64, 32)"),
    (lambda t: t.pop("text_model.head.bias"), "tensor 'text_model.head.bias' is missing"),
    (lambda t: t.__setitem__("vision_model.extra.weight", torch.zeros(2)), "unexpected tensor 'vision_model.extra"),
])
def test_weights_that_do_not_fit_are_refused_naming_the_tensor(tmp_path: Path, change, expected: str) -> None:
    directory = make_checkpoint(tmp_path / "ck")
    _rewrite_weights(directory, change)
    with pytest.raises(Siglip2Error) as error:
        create_model(str(directory))
    assert expected in _one_line(error)


@pytest.mark.parametrize("antialias", [True, False])
def test_position_table_resize_equals_transformers(antialias: bool) -> None:
    """timm's bilinear antialiased resize of the learned table (what our tower runs) is transformers' resize of
    the 16x16 SigLIP 2 table, for grids that up- and downsample either axis; without antialias it is not."""
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

    from naflexclip.models.naflex_clip import siglip2_config

    config = siglip2_config(width=8, depth=1, heads=2, mlp_width=16)
    config = dataclasses.replace(config, text=dataclasses.replace(config.text, vocab_size=8, layers=1))
    embeds = NaFlexClip(config).visual.embeds
    embeds.pos_embed_antialias = antialias
    grids = [(16, 16), (8, 12), (4, 30), (1, 200), (40, 3), (24, 24), (5, 7), (2, 1)]
    max_len = max(h * w for h, w in grids)
    coords = torch.zeros(len(grids), max_len, 2, dtype=torch.long)
    for i, (h, w) in enumerate(grids):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        coords[i, : h * w] = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1)
    ours = torch.zeros(len(grids), max_len, 8)
    with torch.no_grad():
        embeds._apply_learned_naflex_pos_embed(ours, coords)
        theirs = Siglip2VisionEmbeddings.resize_positional_embeddings(
            embeds.pos_embed[0].detach(), torch.tensor(grids), max_length=max_len)
    errors = [float((ours[i, : h * w] - theirs[i, : h * w]).abs().max()) for i, (h, w) in enumerate(grids)]
    if antialias:
        assert max(errors) <= 1e-6, errors
    else:
        assert max(errors) > 1e-3, errors  # the downsampled grids differ


def test_sharded_checkpoint_loads_the_same_weights(checkpoint: Path, tmp_path: Path) -> None:
    hf = transformers.Siglip2Model.from_pretrained(checkpoint)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / "sharded" / name).write_bytes((checkpoint / name).read_bytes())
    single, sharded = siglip2.load(checkpoint).state_dict(), siglip2.load(tmp_path / "sharded").state_dict()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
