"""Zero-shot classification of a user's ImageFolder (one sub-folder per class) from text prompts.

Each class embedding is the mean of its prompts' normalised text embeddings, renormalised (CLIP's prompt
ensemble, Radford et al. 2021); an image's prediction ranks the classes by cosine similarity. Images go
through the model's own data processing (timm's NaFlex transform, or an imported SigLIP 2 checkpoint's
processor) at one patch budget; captions through its tokenizer. Reports top-1, top-5 and per-class accuracy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.data.folders import walk_folder
from naflexclip.data.samples import IMAGE_EXTENSIONS, SkipSample, decode_image, read_image_file
from naflexclip.data.source import skip_record
from naflexclip.families import data_processing

MAX_SKIP_LINES = 20  # skipped files printed; all of them are in the JSON lines file

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


@dataclass(frozen=True)
class ImageFolder:
    """An ImageFolder as zero-shot classification reads it.

    `folders`: every class folder, sorted (what a class-names file follows line by line); `empty`: those
    without an image file, which are reported and are not candidate classes; `samples`: (image path, index
    into `classes`), the folders that have images."""

    root: Path
    folders: list[str]
    empty: list[str]
    samples: list[tuple[Path, int]]

    @property
    def classes(self) -> list[str]:
        return [name for name in self.folders if name not in self.empty]


def read_image_folder(root: str | Path, flag: str = "--zeroshot-data") -> ImageFolder:
    """The class folders (one sub-folder per class; hidden ones left out) and their images, found as training
    finds a folder's (`walk_folder`: links to folders followed, each real folder once)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{flag} {str(root)!r} is not a directory")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(folders) < 2:
        raise ValueError(f"{flag} {str(root)!r} needs one sub-folder per class (at least 2), found {len(folders)}")
    images: dict[str, list[Path]] = {name: [] for name in folders}
    for dirpath, files in walk_folder(str(root)):
        top = Path(dirpath).relative_to(root).parts[:1]
        if top and top[0] in images:
            images[top[0]].extend(Path(dirpath) / f for f in files
                                  if f.rpartition(".")[2].lower() in IMAGE_EXTENSIONS and "." in f)
    empty = [name for name in folders if not images[name]]
    if len(empty) == len(folders):
        raise ValueError(f"{flag} {str(root)!r} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    if len(folders) - len(empty) < 2:
        raise ValueError(f"{flag} {str(root)!r} has images in only one class folder; the others are empty: "
                         f"{', '.join(repr(name) for name in empty)}")
    classes = [name for name in folders if images[name]]
    samples = [(path, label) for label, name in enumerate(classes) for path in sorted(images[name])]
    return ImageFolder(root, folders, empty, samples)


def check_output(path: str | Path, flag: str = "--output") -> Path:
    """`path` as a results file that can be written (its folder made if missing), or a one-line error naming
    `flag`; called before anything is evaluated."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; name a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {str(path)!r}: cannot make its folder ({error.strerror})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {str(path)!r} is not writable")
    return path


def read_lines(path: str | Path, flag: str) -> list[str]:
    """Non-empty lines of a text file."""
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except FileNotFoundError:
        raise ValueError(f"{flag}: file {str(path)!r} does not exist") from None
    return [line for line in lines if line]


def read_classnames(path: str | Path, folders: list[str], flag: str = "--zeroshot-classnames") -> list[str]:
    """One display name per class folder, in sorted-folder order."""
    names = read_lines(path, flag)
    if len(names) != len(folders):
        raise ValueError(f"{flag} {str(path)!r} has {len(names)} names for {len(folders)} "
                         f"class folders (one line per folder, in sorted folder order)")
    return names


def read_templates(path: str | Path, flag: str = "--zeroshot-templates") -> list[str]:
    """Prompt templates, one per line, each with `{}` (or `{c}`) where the class name goes."""
    templates = [t.replace("{c}", "{}") for t in read_lines(path, flag)]
    for template in templates:
        if template.count("{}") != 1:
            raise ValueError(f"{flag}: template {template!r} needs exactly one '{{}}' for the class name")
    if not templates:
        raise ValueError(f"{flag} {str(path)!r} has no templates")
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
                       autocast: Callable[[], ContextManager[Any]] = nullcontext,
                       image_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Top-1/top-5 and per-class accuracy of `model` on the ImageFolder `data_dir` (images at a `seq_len`-patch
    budget). `classnames`: one per class folder in sorted order (None: the folder names); class folders without
    images are no candidates (`empty_classes`). Files that do not decode are left out and listed as skip records
    (`skipped_samples`, training's fields with split "zeroshot"). `hf_processor`: a SigLIP 2 directory whose
    tokenizer and patching to use (None: ours); `image_overrides`: the run's --image-mean/--image-std/
    --image-interpolation (`DataConfig.image_overrides()`)."""
    device = torch.device(device)
    folder = read_image_folder(data_dir)
    named = dict(zip(folder.folders, classnames or folder.folders, strict=True))
    names = [named[name] for name in folder.classes]
    processing = data_processing(hf_processor, model.image_patch_size, **(image_overrides or {}))
    model.eval()
    classes = class_embeddings(model, names, list(templates or DEFAULT_TEMPLATES), processing.tokenize, device,
                               autocast)
    k = min(5, len(names))
    correct1 = torch.zeros(len(names))
    correct5 = torch.zeros(len(names))
    counts = torch.zeros(len(names))
    skipped: list[dict[str, Any]] = []
    for start in range(0, len(folder.samples), batch_size):
        pixels, labels = [], []
        for path, label in folder.samples[start:start + batch_size]:
            try:
                image = decode_image(read_image_file(str(path)))
            except SkipSample as skip:
                skipped.append({**skip_record(str(folder.root), str(path), None, skip.reason, str(skip)),
                                "split": "zeroshot"})
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
            "num_samples": int(counts.sum()), "num_classes": len(names), "num_skipped": len(skipped),
            "chance": 1.0 / len(names), "per_class_top1": per_class, "empty_classes": folder.empty,
            "skipped_samples": skipped}


def empty_classes_line(empty: list[str]) -> str:
    """What is said of an ImageFolder's class folders without images (`ImageFolder.empty`)."""
    return f"empty class folders (no images; not candidate classes): {', '.join(empty)}"


def format_results(results: dict[str, Any]) -> str:
    """Human-readable summary: overall accuracies, then one line per class."""
    k = next(key for key in results if key.startswith("top") and key != "top1")
    lines = [f"zero-shot: top-1 {results['top1']:.4f}, {k[:3]}-{k[3:]} {results[k]:.4f} over "
             f"{results['num_samples']} images, {results['num_classes']} classes (chance {results['chance']:.4f})"]
    if results["empty_classes"]:
        lines.append(empty_classes_line(results["empty_classes"]))
    width = max(len(name) for name in results["per_class_top1"])
    for name, accuracy in results["per_class_top1"].items():
        lines.append(f"  {name:<{width}}  {'n/a' if accuracy is None else f'{accuracy:.4f}'}")
    return "\n".join(lines)


def save_results(results: dict[str, Any], output: Path) -> list[str]:
    """Write `results` as JSON to `output`, its skip records as JSON lines beside it
    (`<name>_skipped_samples.jsonl`, named in the JSON as `skipped_samples_file`); the lines to print."""
    skipped = results.pop("skipped_samples")
    lines = [f"skipped ({record['reason']}): {record['key']}" for record in skipped[:MAX_SKIP_LINES]]
    results["skipped_samples_file"] = None
    if skipped:
        log = output.with_name(f"{output.stem}_skipped_samples.jsonl")
        log.write_text("".join(json.dumps(record) + "\n" for record in skipped))
        results["skipped_samples_file"] = str(log)
        lines.append(f"{len(skipped)} files skipped: listed in {log}")
    output.write_text(json.dumps(results, indent=1) + "\n")
    return [*lines, f"wrote {output}"]


# OpenCLIP's --imagenet-val / --imagenet-v2: the flag, the metric folder name, and how the folders are laid out
IMAGENET_SETS = {"imagenet_val": ("--imagenet-val", "imagenet-val"), "imagenet_v2": ("--imagenet-v2", "imagenet-v2")}
IMAGENET_V2_FOLDER = "ImageNetV2-matched-frequency"  # what imagenetv2_pytorch's ImageNetV2Dataset reads under its root


@dataclass(frozen=True)
class ImageNetSet:
    """An ImageNet zero-shot set as OpenCLIP reads it: the ImageFolder `root`, the class name of each of its class
    folders in sorted folder order (`classnames`, OpenCLIP's `IMAGENET_CLASSNAMES`), and OpenCLIP's 80 ImageNet
    prompt templates (`OPENAI_IMAGENET_TEMPLATES`)."""

    root: Path
    classnames: list[str]
    templates: list[str]
    empty: list[str]  # class folders without images (no candidates)


def imagenet_set(path: str | Path, key: str) -> ImageNetSet:
    """The ImageNet set of `--imagenet-val` (key "imagenet_val": torchvision's ImageFolder of the 1000 synset
    folders, class i = the i-th folder in sorted order) or `--imagenet-v2` (key "imagenet_v2": imagenetv2_pytorch's
    layout, folders named 0..999 by class index, in `ImageNetV2-matched-frequency/` under `path` or at `path`).
    Errors are one line naming the flag."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    flag = IMAGENET_SETS[key][0]
    root = Path(path)
    if key == "imagenet_v2" and (root / IMAGENET_V2_FOLDER).is_dir():
        root = root / IMAGENET_V2_FOLDER
    folder = read_image_folder(root, flag=flag)
    if len(folder.folders) != len(IMAGENET_CLASSNAMES):
        raise ValueError(f"{flag} {str(path)!r} has {len(folder.folders)} class folders; ImageNet has "
                         f"{len(IMAGENET_CLASSNAMES)} (OpenCLIP's class names)")
    if key == "imagenet_v2":
        numbers = sorted(int(name) for name in folder.folders if name.isdigit())
        if numbers != list(range(len(IMAGENET_CLASSNAMES))):
            raise ValueError(f"{flag} {str(path)!r}: ImageNetV2's class folders are named 0..999 (its class index)")
        classnames = [IMAGENET_CLASSNAMES[int(name)] for name in folder.folders]
    else:
        classnames = list(IMAGENET_CLASSNAMES)
    templates = [template("{}") for template in OPENAI_IMAGENET_TEMPLATES]
    return ImageNetSet(root.resolve(), classnames, templates, folder.empty)
