"""Evaluation: image↔text retrieval on the validation split and zero-shot classification of the built-in
dataset's attributes (shape, colour) from text prompts.

Retrieval: every validation image against every validation caption (its own caption is the one match);
Recall@K is the fraction whose match ranks in the top K, median rank is 1-based. Zero-shot: each class
embedding is the mean of its prompts' normalised text embeddings (a prompt ensemble, as in CLIP), an
image is assigned the nearest class; chance is 1 / number of classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.batch import to_device
from naflexclip.data import DataConfig, build_loader, build_zero_shot_loader
from naflexclip.data.processing import make_processing
from naflexclip.data.synthetic import ATTRIBUTES, zero_shot_prompt_ensemble
from naflexclip.zeroshot import ensemble_embeddings

RECALL_AT = (1, 5, 10)
ZERO_SHOT_ATTRIBUTES = ("shape", "colour")


def _features(model: nn.Module, loader: Iterable[dict[str, Any]], device: torch.device,
              autocast: Callable[[], ContextManager[Any]]) -> dict[str, Any]:
    """Normalised image and text features `[N, D]` (float32, CPU) of a whole loader, plus its labels."""
    images, texts, labels = [], [], []
    for batch in loader:
        batch = to_device(batch, device)
        with autocast():
            # the model's forward, not encode_*: FSDP gathers root-level parameters only around forward
            out = model(image=batch["image"], text=batch["text"])
        images.append(out["image_features"].float().cpu())
        texts.append(out["text_features"].float().cpu())
        if "labels" in batch:
            labels.append(batch["labels"])
    out: dict[str, Any] = {"image": F.normalize(torch.cat(images), dim=-1),
                           "text": F.normalize(torch.cat(texts), dim=-1)}
    if labels:
        out["labels"] = {key: torch.cat([lab[key] for lab in labels]) for key in labels[0]}
    return out


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor) -> dict[str, float]:
    """image_features, text_features: `[N, D]` normalised, row i of each a matching pair."""
    similarity = image_features @ text_features.T
    metrics: dict[str, float] = {}
    for direction, scores in (("image_to_text", similarity), ("text_to_image", similarity.T)):
        # rank of the true match = how many candidates score strictly higher (0-based)
        true_scores = scores.diagonal().unsqueeze(1)
        ranks = (scores > true_scores).sum(dim=1)
        for k in RECALL_AT:
            metrics[f"{direction}_R@{k}"] = float((ranks < k).float().mean())
        metrics[f"{direction}_median_rank"] = float(ranks.float().median()) + 1
    return metrics


@torch.no_grad()
def evaluate(model: nn.Module, data: DataConfig, device: torch.device,
             autocast: Callable[[], ContextManager[Any]], *, zero_shot_samples: int = 0,
             skip_records: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Retrieval on the validation split (`val/...`) and, with `zero_shot_samples` > 0, zero-shot accuracy on
    that many built-in single-object images (`zeroshot/{attribute}_top1`). `model`: the plain module,
    or the FSDP-sharded one (then every rank must call this); it is left in train mode. `skip_records`, when
    given, receives the validation samples left out (the loader's skip records, `"split": "val"`)."""
    patch_size, context_length = model.image_patch_size, model.context_length
    model.eval()
    try:
        metrics: dict[str, float] = {}
        if data.source("val") is not None:
            val = build_loader(data, split="val", patch_size=patch_size, context_length=context_length)
            features = _features(model, val, device, autocast)
            if skip_records is not None:
                skip_records.extend(val.skip_records)
            metrics.update({f"val/{k}": v for k, v in retrieval_metrics(features["image"], features["text"]).items()})
            metrics["val/num_samples"] = float(features["image"].shape[0])
        if zero_shot_samples:
            metrics.update(zero_shot_metrics(model, data, device, autocast, zero_shot_samples))
    finally:
        model.train()
    return metrics


def zero_shot_metrics(model: nn.Module, data: DataConfig, device: torch.device,
                      autocast: Callable[[], ContextManager[Any]], num_samples: int) -> dict[str, float]:
    """Top-1 accuracy of nearest-prompt classification for each attribute, on single-object images."""
    loader = build_zero_shot_loader(data, patch_size=model.image_patch_size, context_length=model.context_length,
                                    num_samples=num_samples)
    features = _features(model, loader, device, autocast)
    metrics = {}
    for attribute in ZERO_SHOT_ATTRIBUTES:
        tokenizer = make_processing(data.hf_processor, model.image_patch_size).tokenize  # the model's own
        classes = ensemble_embeddings(model, zero_shot_prompt_ensemble(attribute), tokenizer, device,
                                      autocast).cpu()
        predicted = (features["image"] @ classes.T).argmax(dim=1)
        metrics[f"zeroshot/{attribute}_top1"] = float((predicted == features["labels"][attribute]).float().mean())
        metrics[f"zeroshot/{attribute}_chance"] = 1.0 / len(ATTRIBUTES[attribute])
    return metrics
