"""The `siglip2` family's data processing: the directory's own tokenizer, and patching exactly as transformers'
`Siglip2ImageProcessor` does it for a patch budget (tests/test_siglip2_processing.py).

The token-budget schedule chooses each microbatch's budget; patches stay uint8 until collation; only the token ids
reach the text tower, and `write_training_tokenizer_config` makes an exported directory's tokenizer return them
alone. The steps per image and why the text runs unmasked: docs/siglip2.md#data and #the-text-attention-mask.
Needs the `siglip2` extra (transformers with its tokenizers).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from naflexclip.processing.naflex_transform import Processing, patch_grid

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:  # pragma: no cover - the extra is installed in tests
        raise ImportError("SigLIP 2 data processing needs transformers: pip install 'naflexclip[siglip2]'") from None


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: str):
    """The checkpoint's own tokenizer (`AutoTokenizer.from_pretrained`, local files only); one per process."""
    path = Path(directory)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    _require_transformers()
    # DataLoader workers fork after the main process tokenized: keep the Rust tokenizer single-threaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def siglip2_tokenize(directory: str, texts: list[str], context_length: int) -> torch.Tensor:
    """Token ids long `[len(texts), context_length]`, padded and truncated as the published models expect."""
    tokenizer = load_tokenizer(directory)
    encoded = tokenizer(list(texts), padding="max_length", truncation=True, max_length=context_length,
                        return_tensors="pt")
    return encoded["input_ids"].to(torch.long)


def write_training_tokenizer_config(directory: Path) -> None:
    """Make the tokenizer of `directory` (an export) return `input_ids` alone by default.

    SigLIP 2's text tower was trained without an attention mask (captions padded to 64 tokens, the last position
    pooled); `Siglip2Model` masks padding when its inputs carry an `attention_mask`, which tokenizers return by
    default. `"model_input_names": ["input_ids"]` in `tokenizer_config.json` makes `AutoTokenizer` and
    `AutoProcessor` leave it out, so `Siglip2Model(**processor(...))` runs as trained; `return_attention_mask=True`
    still gives it. Nothing is written for a directory without tokenizer files."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return
    path = directory / TOKENIZER_CONFIG_FILE
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["model_input_names"] = ["input_ids"]
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class ProcessorSettings:
    """What `Siglip2ImageProcessor` would use: resample filter and the fused normalisation constants."""

    patch_size: int
    interpolation: object  # torchvision InterpolationMode
    mean: torch.Tensor  # [3] float32, 255 * image_mean (the processor fuses rescale into normalise)
    std: torch.Tensor  # [3] float32, 255 * image_std


@functools.lru_cache(maxsize=4)
def processor_settings(directory: str | None, patch_size: int) -> ProcessorSettings:
    """The image processor of `directory` (its preprocessor_config.json; the class defaults without one)."""
    _require_transformers()
    from transformers import Siglip2ImageProcessor
    from transformers.image_utils import pil_torch_interpolation_mapping

    if directory is not None and (Path(directory) / PREPROCESSOR_FILE).is_file():
        processor = Siglip2ImageProcessor.from_pretrained(directory, local_files_only=True)
    else:
        processor = Siglip2ImageProcessor(patch_size=patch_size)
    if processor.patch_size != patch_size:
        raise ValueError(f"{directory!r}: image processor patch_size {processor.patch_size} != the model's "
                         f"{patch_size}")
    if not (processor.do_resize and processor.do_rescale and processor.do_normalize):
        raise ValueError(f"{directory!r}: an image processor with do_resize, do_rescale or do_normalize off "
                         f"is not supported")
    # the processor's fused rescale + normalise: (x - mean / rescale) / (std / rescale), in float32
    scale = 1.0 / processor.rescale_factor
    mean = torch.tensor(processor.image_mean) * scale
    std = torch.tensor(processor.image_std) * scale
    return ProcessorSettings(patch_size, pil_torch_interpolation_mapping[processor.resample], mean, std)


class Siglip2Transform:
    """PIL RGB image + patch budget -> uint8 patches `[N, P*P*3]` (ph, pw, C) and patch_coord long `[N, 2]`,
    N <= budget, exactly the processor's resize and patch order (row-major)."""

    def __init__(self, directory: str | None, patch_size: int) -> None:
        self.directory = directory
        self.patch_size = patch_size

    def target_hw(self, image_hw: tuple[int, int], seq_len: int) -> tuple[int, int]:
        """The stored size: no reduced-scale JPEG decode, so the resize sees the pixels the processor sees."""
        return image_hw

    def resized_hw(self, image_hw: tuple[int, int], seq_len: int) -> tuple[int, int]:
        from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

        return get_image_size_for_max_num_patches(image_hw[0], image_hw[1], self.patch_size, seq_len)

    def __call__(self, img: Image.Image, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        from torchvision.transforms.v2 import functional as tvF

        settings = processor_settings(self.directory, self.patch_size)
        # the processor's own PIL -> tensor path: HWC array, channels first, contiguous
        chw = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()
        height, width = self.resized_hw((chw.shape[1], chw.shape[2]), seq_len)
        resized = tvF.resize(chw, [height, width], interpolation=settings.interpolation, antialias=True)
        p = self.patch_size
        nh, nw = height // p, width // p
        patches = resized.reshape(3, nh, p, nw, p).permute(1, 3, 2, 4, 0).reshape(nh * nw, p * p * 3)
        return patches.contiguous(), patch_grid(nh, nw)  # (row, col), row-major: the processor's order


def siglip2_collate(directory: str | None, samples: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int,
                    patch_size: int) -> dict[str, torch.Tensor]:
    """Pad uint8 samples to `seq_len` and normalise as the processor does: the NaFlex image dict
    (patches float32 `[B, seq_len, P*P*3]`, patch_coord long `[B, seq_len, 2]`, patch_valid bool `[B, seq_len]`;
    padding rows all zero, as the processor pads)."""
    settings = processor_settings(directory, patch_size)
    batch, dim = len(samples), patch_size * patch_size * 3
    patches = torch.zeros(batch, seq_len, dim, dtype=torch.float32)
    patch_coord = torch.zeros(batch, seq_len, 2, dtype=torch.long)
    patch_valid = torch.zeros(batch, seq_len, dtype=torch.bool)
    for i, (raw, coord) in enumerate(samples):
        n = raw.shape[0]
        rows = raw.view(n, dim // 3, 3).to(torch.float32)
        # torchvision's normalize: sub_ then div_, the same float32 operations in the same order
        patches[i, :n] = rows.sub_(settings.mean).div_(settings.std).view(n, dim)
        patch_coord[i, :n] = coord
        patch_valid[i, :n] = True
    return {"patches": patches, "patch_coord": patch_coord, "patch_valid": patch_valid}


def patch_budget(directory: str | None, patch_size: int) -> int:
    """The processor's own patch budget (`max_num_patches`, 256 for the published models)."""
    _require_transformers()
    from transformers import Siglip2ImageProcessor

    if directory is not None and (Path(directory) / PREPROCESSOR_FILE).is_file():
        return int(Siglip2ImageProcessor.from_pretrained(directory, local_files_only=True).max_num_patches)
    return int(Siglip2ImageProcessor(patch_size=patch_size).max_num_patches)


def processing(directory: str, patch_size: int, augment: bool = False) -> Processing:
    """The checkpoint directory's tokenizer and patching (checked here, not in a loader worker)."""
    if augment:
        raise ValueError("--augment: random crops are not part of SigLIP 2's image processor; drop --augment "
                         "when fine-tuning an imported SigLIP 2 checkpoint")
    load_tokenizer(directory), processor_settings(directory, patch_size)
    return Processing(Siglip2Transform(directory, patch_size), functools.partial(siglip2_collate, directory),
                      functools.partial(siglip2_tokenize, directory))
