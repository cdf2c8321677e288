"""The dense-feature probe: a linear segmentation probe of the image tower's patch tokens on the built-in scenes.

The frozen tower's last-layer patch tokens of `PROBE_SCENES["train"]` scenes fit a linear softmax classifier of
the patches' shape classes, which labels the patches of `PROBE_SCENES["val"]` scenes: `probe/miou`,
`probe/patch_acc` and `probe/miou_chance`. How patches get their class, the fit and the metrics:
docs/training.md#the-dense-feature-probe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.data import DataConfig
from naflexclip.data.synthetic import SEGMENTATION_CLASSES, synthetic_segmentation
from naflexclip.families import data_processing

PROBE_SCENES = {"train": 128, "val": 64}  # built-in scenes the probe is fitted on / scored on
PROBE_WEIGHT_DECAY = 1e-3  # L2 penalty of the probe's weights (per patch of the mean loss)
PROBE_ITERATIONS = 100  # L-BFGS iterations
SCENES_PER_FORWARD = 32


def patch_labels(labels: np.ndarray, patch_coord: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Each patch's class `[N]`: the class of most of the pixels whose centres fall in it when the per-pixel `labels`
    `[H, W]` are spread over the `(row, col)` grid of `patch_coord` `[N, 2]` (a tie goes to the lower class)."""
    rows, cols = int(patch_coord[:, 0].max()) + 1, int(patch_coord[:, 1].max()) + 1
    height, width = labels.shape
    row = (np.arange(height) + 0.5) * rows // height
    col = (np.arange(width) + 0.5) * cols // width
    cell = (row[:, None] * cols + col[None, :]).astype(np.int64)
    counts = np.bincount((cell * num_classes + labels).ravel(), minlength=rows * cols * num_classes)
    grid = torch.from_numpy(counts.reshape(rows, cols, num_classes).argmax(axis=2))
    return grid[patch_coord[:, 0], patch_coord[:, 1]]


@functools.lru_cache(maxsize=4)
def _scene_batches(seed: int, split: str, count: int, seq_len: int, patch_size: int, hf_processor: str | None,
                   overrides: tuple[tuple[str, Any], ...]) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The first `count` built-in scenes of `split` as NaFlex image batches (CPU) with each patch's class: the same at
    every evaluation of a run, so made once."""
    processing = data_processing(hf_processor, patch_size, **dict(overrides))
    batches = []
    for start in range(0, count, SCENES_PER_FORWARD):
        samples, labels = [], []
        for index in range(start, min(count, start + SCENES_PER_FORWARD)):
            img, pixel_labels = synthetic_segmentation(seed, split, index)
            patches, coord = processing.transform(img, seq_len)
            samples.append((patches, coord))
            labels.append(patch_labels(pixel_labels, coord, len(SEGMENTATION_CLASSES)))
        batches.append((processing.collate(samples, seq_len, patch_size), torch.cat(labels)))
    return batches


@torch.no_grad()
def scene_patch_features(model: nn.Module, data: DataConfig, split: str, count: int, device: torch.device,
                         autocast: Callable[[], ContextManager[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen tower's patch tokens `[patches, width]` (float64, CPU) of the first `count` built-in scenes of
    `split`, at the largest --naflex-seq-lens with the model's processing, and each patch's class `[patches]`."""
    overrides = tuple(sorted((key, tuple(value) if isinstance(value, list) else value)
                             for key, value in data.image_overrides().items()))
    features, classes = [], []
    for batch, labels in _scene_batches(data.synthetic_seed, split, count, max(data.naflex_seq_lens),
                                        model.image_patch_size, data.hf_processor, overrides):
        image = {key: value.to(device) for key, value in batch.items()}
        with autocast():
            _, tokens, _ = model.encode_image_tokens(image)
        valid = image["patch_valid"]
        prefix = tokens.shape[1] - valid.shape[1]
        features.append(tokens[:, prefix:][valid].double().cpu())
        classes.append(labels)
    return torch.cat(features), torch.cat(classes)


def fit_linear_probe(features: torch.Tensor, labels: torch.Tensor, num_classes: int,
                     weight_decay: float = PROBE_WEIGHT_DECAY, iterations: int = PROBE_ITERATIONS
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear softmax classifier of `features` `[N, D]` into `labels` `[N]` (standardised features, each class's
    patches weighted by the inverse of its frequency, so background does not swamp the shapes); returns the
    function giving the predicted class of new features."""
    x = features.double()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    x = (x - mean) / std
    counts = torch.bincount(labels, minlength=num_classes).double()
    class_weight = torch.where(counts > 0, counts.sum() / (counts.clamp(min=1) * int((counts > 0).sum())), 0.0)
    weight = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, labels, weight=class_weight) + weight_decay * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    weight, bias = weight.detach(), bias.detach()
    return lambda new: (((new.double() - mean) / std) @ weight + bias).argmax(dim=1)


def mean_iou(predicted: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """Mean over classes of |predicted ∩ true| / |predicted ∪ true|, classes with an empty union left out."""
    ious = []
    for c in range(num_classes):
        union = int(((predicted == c) | (labels == c)).sum())
        if union:
            ious.append(int(((predicted == c) & (labels == c)).sum()) / union)
    return sum(ious) / len(ious)


def chance_miou(labels: torch.Tensor, num_classes: int) -> float:
    """The expected mIoU on `labels` of a class drawn uniformly for every patch: what the class-balanced probe gives
    features that say nothing about the scene."""
    p = torch.bincount(labels, minlength=num_classes).double() / len(labels)
    q = 1.0 / num_classes
    return float((p * q / (p + q - p * q)).mean())


def linear_probe_metrics(train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                         num_classes: int) -> dict[str, float]:
    """`probe/miou`, `probe/patch_acc` and `probe/miou_chance` of a linear probe fitted on `train` (features,
    labels) and scored on `val`."""
    predict = fit_linear_probe(*train, num_classes)
    predicted = predict(val[0])
    return {"probe/miou": mean_iou(predicted, val[1], num_classes),
            "probe/patch_acc": float((predicted == val[1]).double().mean()),
            "probe/miou_chance": chance_miou(val[1], num_classes)}


def dense_probe_metrics(model: nn.Module, data: DataConfig, device: torch.device,
                        autocast: Callable[[], ContextManager[Any]], scenes: dict[str, int] | None = None
                        ) -> dict[str, float]:
    """The dense-feature probe of `model`'s image tower (module docstring) on the built-in scenes of
    --synthetic-seed; `scenes`: how many of each split (default `PROBE_SCENES`)."""
    scenes = scenes or PROBE_SCENES
    train = scene_patch_features(model, data, "train", scenes["train"], device, autocast)
    val = scene_patch_features(model, data, "val", scenes["val"], device, autocast)
    return linear_probe_metrics(train, val, len(SEGMENTATION_CLASSES))
