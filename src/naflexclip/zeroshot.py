"""Zero-shot classification of a user's ImageFolder (one sub-folder per class) from text prompts.

Each class embedding is the mean of its prompts' normalised text embeddings, renormalised (CLIP's prompt
ensemble, Radford et al. 2021); an image's prediction ranks the classes by cosine similarity. Images go
through the model's own data processing (timm's NaFlex transform, or an imported SigLIP 2 checkpoint's
processor) at one patch budget; captions through its tokenizer. Reports top-1, top-5 and per-class accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.data.processing import make_processing
from naflexclip.data.samples import SkipSample, decode_image, read_image_file

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# a short ensemble from CLIP's ImageNet prompts (OpenCLIP's `SIMPLE_IMAGENET_TEMPLATES`)
DEFAULT_TEMPLATES = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)


def read_image_folder(root: str | Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class folder names sorted, [(image path, class index)]) of an ImageFolder."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--zero-shot-data {str(root)!r} is not a directory")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        raise ValueError(f"--zero-shot-data {str(root)!r} needs one sub-folder per class (at least 2), "
                         f"found {len(classes)}")
    samples = [(path, label) for label, name in enumerate(classes) for path in sorted((root / name).rglob("*"))
               if path.suffix.lower() in IMAGE_EXTENSIONS]
    if not samples:
        raise ValueError(f"--zero-shot-data {str(root)!r} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    return classes, samples


def read_lines(path: str | Path, flag: str) -> list[str]:
    """Non-empty lines of a text file."""
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except FileNotFoundError:
        raise ValueError(f"{flag}: file {str(path)!r} does not exist") from None
    return [line for line in lines if line]


def read_classnames(path: str | Path, folders: list[str]) -> list[str]:
    """One display name per class folder, in sorted-folder order."""
    names = read_lines(path, "--zero-shot-classnames")
    if len(names) != len(folders):
        raise ValueError(f"--zero-shot-classnames {str(path)!r} has {len(names)} names for {len(folders)} "
                         f"class folders (one line per folder, in sorted folder order)")
    return names


def read_templates(path: str | Path) -> list[str]:
    """Prompt templates, one per line, each with `{}` (or `{c}`) where the class name goes."""
    templates = [t.replace("{c}", "{}") for t in read_lines(path, "--zero-shot-templates")]
    for template in templates:
        if template.count("{}") != 1:
            raise ValueError(f"--zero-shot-templates: template {template!r} needs exactly one '{{}}' "
                             f"for the class name")
    if not templates:
        raise ValueError(f"--zero-shot-templates {str(path)!r} has no templates")
    return templates


def ensemble_embeddings(model: nn.Module, prompt_lists: list[list[str]],
                        tokenize: Callable[[list[str], int], torch.Tensor], device: torch.device,
                        autocast: Callable[[], ContextManager[Any]]) -> torch.Tensor:
    """`[num_classes, D]`: one row per list of prompts, the mean of their normalised text embeddings, renormalised
    (CLIP's prompt ensembling)."""
    rows = []
    for prompts in prompt_lists:
        ids = tokenize(prompts, model.context_length).to(device)
        with autocast():
            features = model(text=ids)["text_features"].float()
        rows.append(F.normalize(F.normalize(features, dim=-1).mean(dim=0), dim=-1))
    return torch.stack(rows)


def class_embeddings(model: nn.Module, classnames: list[str], templates: list[str],
                     tokenize: Callable[[list[str], int], torch.Tensor], device: torch.device,
                     autocast: Callable[[], ContextManager[Any]]) -> torch.Tensor:
    """`[num_classes, D]`: each class's prompt-ensemble embedding over `templates`."""
    return ensemble_embeddings(model, [[t.format(name) for t in templates] for name in classnames], tokenize,
                               device, autocast)


@torch.no_grad()
def zero_shot_classify(model: nn.Module, data_dir: str | Path, *, seq_len: int, hf_processor: str | None = None,
                       classnames: list[str] | None = None, templates: list[str] | None = None,
                       device: str | torch.device = "cpu", batch_size: int = 32,
                       autocast: Callable[[], ContextManager[Any]] = nullcontext) -> dict[str, Any]:
    """Top-1/top-5 and per-class accuracy of `model` on the ImageFolder `data_dir` (images at a `seq_len`-patch
    budget). `hf_processor`: a SigLIP 2 directory whose tokenizer and patching to use (None: ours)."""
    device = torch.device(device)
    folders, samples = read_image_folder(data_dir)
    names = classnames or folders
    processing = make_processing(hf_processor, model.image_patch_size)
    model.eval()
    classes = class_embeddings(model, names, list(templates or DEFAULT_TEMPLATES), processing.tokenize, device,
                               autocast)
    k = min(5, len(names))
    correct1 = torch.zeros(len(names))
    correct5 = torch.zeros(len(names))
    counts = torch.zeros(len(names))
    skipped = 0
    for start in range(0, len(samples), batch_size):
        pixels, labels = [], []
        for path, label in samples[start:start + batch_size]:
            try:
                image = decode_image(read_image_file(str(path)))
            except SkipSample:
                skipped += 1
                continue
            pixels.append(processing.transform(image, seq_len))
            labels.append(label)
        if not pixels:
            continue
        image = {k: v.to(device) for k, v in processing.collate(pixels, seq_len, model.image_patch_size).items()}
        with autocast():
            features = F.normalize(model(image=image)["image_features"].float(), dim=-1)
        topk = (features @ classes.T).topk(k, dim=1).indices.cpu()
        target = torch.tensor(labels)
        hit1 = (topk[:, 0] == target).float()
        hit5 = (topk == target[:, None]).any(dim=1).float()
        counts.index_add_(0, target, torch.ones_like(hit1))
        correct1.index_add_(0, target, hit1)
        correct5.index_add_(0, target, hit5)
    total = counts.sum().clamp(min=1)
    per_class = {name: float(correct1[i] / counts[i]) if counts[i] else None for i, name in enumerate(names)}
    return {"top1": float(correct1.sum() / total), f"top{k}": float(correct5.sum() / total),
            "num_samples": int(counts.sum()), "num_classes": len(names), "num_skipped": skipped,
            "chance": 1.0 / len(names), "per_class_top1": per_class}


def format_results(results: dict[str, Any]) -> str:
    """Human-readable summary: overall accuracies, then one line per class."""
    k = next(key for key in results if key.startswith("top") and key != "top1")
    lines = [f"zero-shot: top-1 {results['top1']:.4f}, {k[:3]}-{k[3:]} {results[k]:.4f} over "
             f"{results['num_samples']} images, {results['num_classes']} classes (chance {results['chance']:.4f})"]
    width = max(len(name) for name in results["per_class_top1"])
    for name, accuracy in results["per_class_top1"].items():
        lines.append(f"  {name:<{width}}  {'n/a' if accuracy is None else f'{accuracy:.4f}'}")
    return "\n".join(lines)
