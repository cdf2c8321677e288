"""What a model reads by default: timm's NaFlex image transform, open_clip's tokenizer (`tokenize`), their
`Processing`, and the collation of samples into the microbatch format.

Patches (timm's layout, flattened as (ph, pw, C)) stay uint8 until `collate` normalises a whole microbatch at
once and zeroes its padding rows. The steps per image: docs/data.md#batches-a-token-budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from timm.data.naflex_transforms import ResizeToSequence, get_image_size_for_seq, patchify_image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

INTERPOLATION = "bicubic"


@dataclass(frozen=True)
class Processing:
    """A model's data processing: `transform(img, seq_len) -> (uint8 patches, patch_coord)`,
    `collate(samples, seq_len, patch_size)` -> the NaFlex image dict, `tokenize(texts, context_length)` -> long
    `[B, T]`. Ours is `default_processing` (`NaFlexTransform`, `collate` and `tokenize` below); a pretrained
    family brings its own (`naflexclip.families.data_processing` picks one and hands it to the loaders)."""

    transform: Any
    collate: Callable[[list[tuple[torch.Tensor, torch.Tensor]], int, int], dict[str, torch.Tensor]]
    tokenize: Callable[[list[str], int], torch.Tensor]

    def at_patch_size(self, patch_size: int) -> Processing:
        """This processing for `patch_size` patches (--naflex-patch-sizes): its transform resized for that size
        (collation takes the size per call). One line when the transform patches at one size only."""
        if getattr(self.transform, "patch_size", None) == patch_size:
            return self
        at = getattr(self.transform, "at_patch_size", None)
        if at is None:
            raise ValueError(f"--naflex-patch-sizes {patch_size}: the model's image processor "
                             f"({type(self.transform).__name__}) patches at its own patch size only")
        return dataclasses.replace(self, transform=at(patch_size))


def default_processing(patch_size: int, augment: bool = False) -> Processing:
    """Our presets' processing: timm's NaFlex transform (random crops with `augment`), our collation, open_clip's
    tokenizer."""
    return Processing(NaFlexTransform(patch_size, augment=augment), collate, tokenize)


@functools.lru_cache(maxsize=4)
def _tokenizer():  # one per process; the BPE vocab ships in the open_clip wheel
    from open_clip.tokenizer import SimpleTokenizer

    return SimpleTokenizer()


def tokenize(texts: list[str], context_length: int) -> torch.Tensor:
    """open_clip SimpleTokenizer ids, long [len(texts), context_length] (vocab 49408, truncated with EOT)."""
    return _tokenizer()(list(texts), context_length=context_length)


class NaFlexTransform:
    """PIL RGB image + sequence length -> uint8 patches [N, P*P*3], patch_coord long [N, 2] (row, col).

    Without augmentation, timm's deterministic ResizeToSequence. `augment=True` is timm's
    RandomResizedCropToSequence (scale 0.9-1, OpenCLIP's AugmentationCfg default; ratio 3/4-4/3 of the image's own
    aspect, timm's; or `scale`/`ratio`: OpenCLIP's --aug-cfg) with its crop drawn
    from the `rng` each call is given, never from the process's global `random`. N <= seq_len always.
    """

    scale = (0.9, 1.0)
    ratio = (3 / 4, 4 / 3)

    def __init__(self, patch_size: int, augment: bool = False, interpolation: str = INTERPOLATION,
                 scale: tuple[float, float] | None = None, ratio: tuple[float, float] | None = None) -> None:
        self.patch_size = patch_size
        self.augment = augment
        # the crop's area and aspect ranges (OpenCLIP's --aug-cfg scale=, ratio=; None: the class's)
        self.scale = (scale[0], scale[1]) if scale is not None else NaFlexTransform.scale
        self.ratio = (ratio[0], ratio[1]) if ratio is not None else NaFlexTransform.ratio
        self.interpolation = interpolation  # "bicubic" or "bilinear" (a model's own, e.g. an OpenCLIP name's)
        self._resizers: dict[int, torch.nn.Module] = {}

    def at_patch_size(self, patch_size: int) -> NaFlexTransform:
        """The same transform for `patch_size` patches."""
        return NaFlexTransform(patch_size, augment=self.augment, interpolation=self.interpolation, scale=self.scale,
                               ratio=self.ratio)

    def _resize(self, img: Image.Image, seq_len: int) -> Image.Image:
        if seq_len not in self._resizers:
            self._resizers[seq_len] = ResizeToSequence(self.patch_size, seq_len, interpolation=self.interpolation)
        return self._resizers[seq_len](img)

    def _random_resized_crop(self, img: Image.Image, seq_len: int, rng: random.Random) -> Image.Image:
        """timm's RandomResizedCropToSequence (`get_params`, then `resized_crop`), its draws taken from `rng`."""
        width, height = img.size
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            area = height * width * rng.uniform(*self.scale)
            aspect = width / height * math.exp(rng.uniform(*log_ratio))
            crop_h, crop_w = int(round(math.sqrt(area / aspect))), int(round(math.sqrt(area * aspect)))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                top, left = rng.randint(0, height - crop_h), rng.randint(0, width - crop_w)
                break
        else:  # timm's fallback: the ratio range holds the image's own aspect, so the whole image
            top, left, crop_h, crop_w = 0, 0, height, width
        size = get_image_size_for_seq((crop_h, crop_w), (self.patch_size, self.patch_size), seq_len)[1]
        mode = InterpolationMode(self.interpolation)
        return F.resized_crop(img, top, left, crop_h, crop_w, list(size), interpolation=mode, antialias=True)

    def target_hw(self, image_hw: tuple[int, int], seq_len: int) -> tuple[int, int]:
        """(height, width) the eval resize gives an image of `image_hw` at `seq_len`."""
        return get_image_size_for_seq(image_hw, self.patch_size, seq_len)[1]

    def __call__(self, img: Image.Image, seq_len: int, rng: random.Random | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.augment:
            if rng is None:
                raise ValueError("an augmenting NaFlexTransform needs the rng to draw its crop from")
            resized = self._random_resized_crop(img, seq_len, rng)
        else:
            resized = self._resize(img, seq_len)
        pixels = np.asarray(resized, dtype=np.uint8)  # [H, W, 3], H and W multiples of the patch size
        p = self.patch_size
        nh, nw = pixels.shape[0] // p, pixels.shape[1] // p
        # the same (ph, pw, C) flattening as timm's patchify_image(channels_last=True), done on the
        # HWC array directly instead of through a CHW copy (tested equal to timm's Patchify)
        patches = pixels.reshape(nh, p, nw, p, 3).transpose(0, 2, 1, 3, 4).reshape(nh * nw, p * p * 3)
        # a PIL image's array is read-only; with a one-patch-high or -wide grid the reshapes are views of it, which
        # torch.from_numpy would share with a warning: copy only then
        return torch.from_numpy(np.require(patches, requirements=["C", "W"])), patch_grid(nh, nw)


@functools.lru_cache(maxsize=1024)
def patch_grid(nh: int, nw: int) -> torch.Tensor:
    """(row, col) of each patch in row-major order, long [nh * nw, 2], as timm's patchify_image gives."""
    _, coord, _ = patchify_image(torch.zeros(1, nh, nw), (1, 1))
    return coord


@functools.lru_cache(maxsize=8)
def _normalisation(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / 255 - mean) / std as x * scale - shift, per channel."""
    scale = torch.tensor([1.0 / (255.0 * s) for s in std])
    shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)])
    return scale, shift


def collate(
    samples: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int, patch_size: int,
    mean: tuple[float, ...] = tuple(OPENAI_DATASET_MEAN), std: tuple[float, ...] = tuple(OPENAI_DATASET_STD),
) -> dict[str, torch.Tensor]:
    """Pad uint8 (patches, patch_coord) samples to `seq_len` and normalise with `mean`/`std` (OpenAI CLIP's by
    default): the NaFlex image dict.

    Returns patches float32 [B, seq_len, P*P*3], patch_coord long [B, seq_len, 2] (row, col),
    patch_valid bool [B, seq_len] (True for real patches; padding rows are all-zero).
    """
    batch = len(samples)
    dim = patch_size * patch_size * 3
    scale, shift = _normalisation(tuple(mean), tuple(std))
    patches = torch.zeros(batch, seq_len, dim, dtype=torch.float32)
    patch_coord = torch.zeros(batch, seq_len, 2, dtype=torch.long)
    patch_valid = torch.zeros(batch, seq_len, dtype=torch.bool)
    for i, (raw, coord) in enumerate(samples):
        n = raw.shape[0]
        # (x / 255 - mean) / std per channel; channel is the fastest axis of a (ph, pw, C) patch.
        # Only real rows are written: padding rows stay exactly zero.
        rows = patches[i, :n].view(n, dim // 3, 3)
        rows.copy_(raw.view(n, dim // 3, 3)).mul_(scale).sub_(shift)
        patch_coord[i, :n] = coord
        patch_valid[i, :n] = True
    return {"patches": patches, "patch_coord": patch_coord, "patch_valid": patch_valid}
