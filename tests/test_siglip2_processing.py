"""SigLIP 2 data processing: patches equal to transformers' `Siglip2ImageProcessor` for a patch budget, captions
through the checkpoint's own tokenizer, and the loader using both while our schedule picks the budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from siglip2_cases import SMALL, make_checkpoint

from naflexclip.data import DataConfig, build_loader
from naflexclip.data.synthetic import synthetic_sample
from naflexclip.families import data_processing

transformers = pytest.importorskip("transformers")

# (height, width): square, wide, tall, extreme, odd, and smaller than one patch
SIZES = [(64, 64), (37, 91), (200, 50), (13, 300), (333, 500), (9, 7)]


def _image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _ours(directory: str | None, images: list[Image.Image], patch_size: int, budget: int) -> dict[str, torch.Tensor]:
    processing = data_processing(directory, patch_size)
    return processing.collate([processing.transform(img, budget) for img in images], budget, patch_size)


def _processor(images: list[Image.Image], patch_size: int, budget: int, **kwargs) -> dict[str, torch.Tensor]:
    processor = transformers.Siglip2ImageProcessor(patch_size=patch_size, max_num_patches=budget, **kwargs)
    return processor(images, return_tensors="pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("siglip2-proc"))


@pytest.fixture(scope="module")
def checkpoint16(tmp_path_factory) -> Path:
    """Patch 16 and no preprocessor_config.json: the processor's class defaults apply."""
    config = {"vision_config": {**SMALL["vision_config"], "patch_size": 16}, "text_config": SMALL["text_config"]}
    directory = make_checkpoint(tmp_path_factory.mktemp("siglip2-proc16"), config)
    (directory / "preprocessor_config.json").unlink()
    return directory


@pytest.mark.parametrize(("patch_size", "budget"), [(4, 16), (4, 64), (16, 256), (16, 100)])
def test_patches_equal_the_image_processor(checkpoint: Path, checkpoint16: Path, patch_size: int,
                                           budget: int) -> None:
    images = [_image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    directory = str(checkpoint if patch_size == 4 else checkpoint16)
    ours = _ours(directory, images, patch_size, budget)
    theirs = _processor(images, patch_size, budget)
    assert torch.equal(ours["patches"], theirs["pixel_values"]), "patches must be bit-equal"
    assert torch.equal(ours["patch_valid"].long(), theirs["pixel_attention_mask"].long())
    valid = ours["patch_valid"].unsqueeze(-1)
    grids = torch.where(valid, ours["patch_coord"], 0).amax(dim=1) + 1
    assert torch.equal(grids, theirs["spatial_shapes"])
    assert len({tuple(g) for g in grids.tolist()}) >= 3  # several aspect ratios in one padded batch


def test_processor_settings_come_from_the_checkpoint(tmp_path: Path) -> None:
    """A checkpoint's own preprocessor_config.json (other mean/std, bicubic) is what the patches follow."""
    directory = make_checkpoint(tmp_path / "ck")
    custom = transformers.Siglip2ImageProcessor(patch_size=4, max_num_patches=64, image_mean=[0.1, 0.2, 0.3],
                                                image_std=[0.9, 0.8, 0.7], resample=3)
    custom.save_pretrained(directory)
    images = [_image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    ours = _ours(str(directory), images, 4, 36)
    theirs = custom(images, max_num_patches=36, return_tensors="pt")
    assert torch.equal(ours["patches"], theirs["pixel_values"])


def test_parity_check_has_teeth(checkpoint: Path) -> None:
    """timm's NaFlex transform (our presets' pipeline) does not produce the processor's patches."""
    images = [_image(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
    theirs = _processor(images, 4, 64)
    ours = _ours(None, images, 4, 64)
    same_shape = ours["patches"].shape == theirs["pixel_values"].shape
    assert not (same_shape and torch.allclose(ours["patches"], theirs["pixel_values"], atol=1e-3))


def test_loader_uses_the_checkpoint_tokenizer_and_patching(checkpoint: Path) -> None:
    cfg = DataConfig(hf_processor=str(checkpoint), synthetic_train_size=24, seed=1, naflex_seq_lens=(16, 36),
                     naflex_max_tokens_per_batch=144, workers=0)
    loader = build_loader(cfg, split="train", patch_size=4, context_length=12,
                          processing=data_processing(cfg.hf_processor, 4))
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    seq_lens = set()
    for batch in loader:
        indices = [int(key) for key in batch["keys"]]
        samples = [synthetic_sample(cfg.synthetic_seed, "train", i, cfg.synthetic_shape_group_size) for i in indices]
        theirs = _processor([img for img, _ in samples], 4, batch["seq_len"])
        assert torch.equal(batch["image"]["patches"], theirs["pixel_values"])
        ids = tokenizer([caption for _, caption in samples], padding="max_length", truncation=True, max_length=12,
                        return_tensors="pt")["input_ids"]
        assert torch.equal(batch["text"], ids)
        assert batch["image"]["patches"].shape[1] == batch["seq_len"]  # our schedule picks the budget
        seq_lens.add(batch["seq_len"])
    assert seq_lens == {16, 36}
