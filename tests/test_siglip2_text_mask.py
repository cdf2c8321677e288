"""SigLIP 2's text tower was trained without an attention mask (big_vision pads every caption to 64 tokens and pools
the last position, a pad for short captions); ours runs it that way. transformers' `Siglip2Model` masks padding
whenever its inputs carry an `attention_mask`, which its tokenizer returns by default. These tests pin both calls as
a transformers user makes them: the exported directory's processor gives the training behaviour by default (no
mask), the mask on request still gives transformers' masked embeddings, and our import of a directory whose
tokenizer returns a mask keeps the training behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from siglip2_cases import CONFIGS, make_checkpoint

from naflexclip import create_model, export_model
from naflexclip.families import data_processing

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # float32 agreement of normalised embeddings (tests/test_siglip2.py's bar)
MASK_EFFECT = 1e-2  # a padded caption's masked embedding is further than this from the unmasked one
# short captions (padded: their last position is a pad) and ones at or over the context length (not padded)
CAPTIONS = ["a red circle", "x", "a cat", "two blue squares on a striped background", "1, 2, 3 - go"]


def _images() -> list[Image.Image]:
    gen = torch.Generator().manual_seed(0)
    sizes = [(20, 36), (32, 32), (48, 12), (16, 28), (24, 24)]
    return [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy())
            for h, w in sizes]


def _padded_rows(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Captions shorter than the context: right padding puts a pad at the last position, the one SigLIP 2 pools."""
    return input_ids[:, -1] == pad_id


def _embedding_errors(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    return (ours - theirs).abs().amax(dim=1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(f"siglip2-{request.param}"), CONFIGS[request.param], seed=7)


def test_exported_processor_gives_the_training_behaviour_and_the_mask_on_request(checkpoint: Path,
                                                                                 tmp_path: Path) -> None:
    model = create_model(str(checkpoint)).eval()
    out = export_model(model, tmp_path / "exported")
    processor = transformers.AutoProcessor.from_pretrained(out, local_files_only=True)
    hf = transformers.Siglip2Model.from_pretrained(out).eval()
    # the processor's own image defaults are the published patch 16 / 256 patches; the tiny model patches by 4
    call = {"text": CAPTIONS, "images": _images(), "padding": "max_length", "truncation": True,
            "max_length": model.context_length, "return_tensors": "pt", "patch_size": model.image_patch_size,
            "max_num_patches": 16}

    inputs = processor(**call)
    assert "attention_mask" not in inputs, "the default call must give the training behaviour (no text mask)"
    pad_id = hf.config.text_config.pad_token_id
    padded = _padded_rows(inputs["input_ids"], pad_id)
    assert padded.any() and not padded.all(), "the captions must include padded and unpadded ones"
    with torch.no_grad():
        ours = model.encode_text(inputs["input_ids"])
        unmasked = hf(**inputs).text_embeds
        masked_inputs = processor(**call, return_attention_mask=True)
        masked = hf(**masked_inputs).text_embeds
    assert _embedding_errors(ours, unmasked).max() <= ATOL

    # the mask on request: transformers' masked embeddings, which differ from training's for every padded caption
    assert torch.equal(masked_inputs["input_ids"], inputs["input_ids"])
    assert torch.equal(masked_inputs["attention_mask"].bool(), inputs["input_ids"] != pad_id)
    errors = _embedding_errors(ours, masked)
    assert (errors[padded] > MASK_EFFECT).all(), errors
    assert (errors[~padded] <= ATOL).all(), errors  # nothing to mask: the same embedding

    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)  # the tokenizer alone
    encoded = tokenizer(CAPTIONS, padding="max_length", truncation=True, max_length=model.context_length,
                        return_tensors="pt")
    assert set(encoded) == {"input_ids"}
    with torch.no_grad():
        alone = F.normalize(hf.get_text_features(**encoded).pooler_output, dim=-1)
    assert _embedding_errors(ours, alone).max() <= ATOL


def test_import_of_a_directory_whose_tokenizer_masks_keeps_the_training_behaviour(checkpoint: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    model = create_model(str(checkpoint)).eval()
    encoded = tokenizer(CAPTIONS, padding="max_length", truncation=True, max_length=model.context_length,
                        return_tensors="pt")
    assert "attention_mask" in encoded, "the source directory's tokenizer returns a mask"
    ids = data_processing(str(checkpoint), model.image_patch_size).tokenize(CAPTIONS, model.context_length)
    assert torch.equal(ids, encoded["input_ids"])  # what training and evaluation feed the text tower
    padded = _padded_rows(ids, tokenizer.pad_token_id)
    assert padded.any() and not padded.all()

    hf = transformers.Siglip2Model.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        ours = model.encode_text(ids)
        unmasked = F.normalize(hf.get_text_features(input_ids=ids).pooler_output, dim=-1)
        masked = F.normalize(hf.get_text_features(**encoded).pooler_output, dim=-1)
    assert _embedding_errors(ours, unmasked).max() <= ATOL
    errors = _embedding_errors(ours, masked)
    assert (errors[padded] > MASK_EFFECT).all(), errors
