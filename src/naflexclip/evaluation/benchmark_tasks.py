"""`naflexclip benchmark`: CLIP_benchmark's own evaluation (zero-shot classification, zero-shot retrieval, linear
probe) of a naflexclip checkpoint or a SigLIP 2 directory, at one or several NaFlex sequence lengths.

A NaFlex image travels through CLIP_benchmark's batching as one float tensor `[seq_len, P*P*3 + 3]` (patch values,
row, column, valid) that `encode_image` unpacks; patches and precision are `naflexclip eval`'s, and where
CLIP_benchmark would download the command stops in one line naming the flag. Needs the `benchmark` extra.
docs/siglip2.md#clip_benchmark.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from naflexclip.models.precision import PRECISIONS

TASKS = ("zeroshot_classification", "zeroshot_retrieval", "linear_probe")
# CLIP_benchmark's default file name with the sequence length added: a sweep writes one file per length
DEFAULT_OUTPUT = "{dataset}_{pretrained}_{model}_{language}_{task}_seq{seq_len}.json"


def pack(image: dict[str, torch.Tensor]) -> torch.Tensor:
    """A NaFlex image dict (`[B, L, ...]`) as one float tensor `[B, L, P*P*3 + 3]`: patches, row, col, valid
    (coordinates are small integers, exact in float32)."""
    return torch.cat([image["patches"], image["patch_coord"].to(image["patches"].dtype),
                      image["patch_valid"].to(image["patches"].dtype).unsqueeze(-1)], dim=-1)


def unpack(packed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The NaFlex image dict of a `pack`ed tensor."""
    return {"patches": packed[..., :-3], "patch_coord": packed[..., -3:-1].long(), "patch_valid": packed[..., -1] > 0}


class NaFlexImageTransform:
    """CLIP_benchmark's per-image transform: a PIL image -> the packed NaFlex tensor `[seq_len, P*P*3 + 3]`
    through the model's own patching (`Processing`) at `seq_len` patches."""

    def __init__(self, processing: Any, seq_len: int, patch_size: int) -> None:
        self.processing = processing
        self.seq_len = seq_len
        self.patch_size = patch_size

    def __call__(self, image: Image.Image) -> torch.Tensor:
        from naflexclip.data.samples import to_rgb

        sample = self.processing.transform(to_rgb(image), self.seq_len)
        return pack(self.processing.collate([sample], self.seq_len, self.patch_size))[0]


class BenchmarkModel(nn.Module):
    """The model as CLIP_benchmark calls it: `encode_image(packed images)`, `encode_text(token ids)`, each forward
    under `autocast` and handed back in float32, as `naflexclip eval` computes its features."""

    def __init__(self, model: nn.Module, autocast: Callable[[], ContextManager[Any]] = nullcontext) -> None:
        super().__init__()
        self.model = model
        self.autocast = autocast

    def encode_image(self, packed: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model.encode_image(unpack(packed)).float()

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model.encode_text(text).float()


@dataclass(frozen=True)
class Run:
    """One evaluation: a dataset at one sequence length, written to `output`."""

    dataset: str
    root: str
    task: str
    seq_len: int
    output: Path


def _require_clip_benchmark() -> None:
    try:
        import clip_benchmark  # noqa: F401
    except ImportError:
        raise ValueError("needs CLIP_benchmark: pip install 'naflexclip[benchmark]'") from None


def load_model(pretrained: str, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    """(model, run config) of a naflexclip checkpoint or a SigLIP 2 directory, loaded as `naflexclip eval` does."""
    from naflexclip.evaluation.evaluated_model import evaluated_model

    return evaluated_model(pretrained, device)


def model_name(pretrained: str, config: dict[str, Any]) -> str:
    """The JSON's `model`: the preset a naflexclip run trained, or the family of a pretrained directory."""
    from naflexclip.families import find_family

    family = find_family(pretrained)
    return family.NAME if family is not None else str(config.get("model") or "naflexclip")


def _dataset_kind(dataset: str, root: str) -> str:
    """What CLIP_benchmark reads `dataset` as: "retrieval" (images with captions), "classification", "multilabel",
    or the task of a dataset of another kind. A `wds/` dataset's kind is its dataset_type.txt, classification
    without one (CLIP_benchmark's rule); another's follows from its name."""
    from clip_benchmark.datasets.builder import get_dataset_default_task

    if dataset.startswith("wds/"):
        typed = Path(root, "dataset_type.txt")
        return typed.read_text().strip().lower() if typed.is_file() else "classification"
    task = get_dataset_default_task(dataset)
    return {"zeroshot_retrieval": "retrieval", "zeroshot_classification": "classification"}.get(task, task)


def _dataset_task(dataset: str, root: str, task: str) -> str:
    """The task of --task on `dataset` ("auto": the dataset's own), or a one-line error when the dataset cannot
    be read for it (CLIP_benchmark would fail inside its loader)."""
    from clip_benchmark.datasets.builder import get_dataset_default_task

    kind = _dataset_kind(dataset, root)
    where = f"--dataset {dataset} at --dataset_root {root!r}" if dataset.startswith("wds/") else f"--dataset {dataset}"
    if task == "auto":
        task = "zeroshot_retrieval" if kind == "retrieval" else get_dataset_default_task(dataset.removeprefix("wds/"))
        if task not in TASKS:
            raise ValueError(f"--task auto: {dataset!r} is a {task} dataset; naflexclip benchmark runs "
                             f"{', '.join(TASKS)}")
    if task == "zeroshot_retrieval" and kind != "retrieval":
        untyped = dataset.startswith("wds/") and not Path(root, "dataset_type.txt").is_file()
        raise ValueError(f"--task zeroshot_retrieval: {where} is a {kind} dataset" + (
            " (it has no dataset_type.txt, which CLIP_benchmark reads as classification; a captioned one says "
            f"'retrieval' in {os.path.join(root, 'dataset_type.txt')})" if untyped else
            " (class labels, no captions); use --task zeroshot_classification"))
    if task != "zeroshot_retrieval" and kind == "retrieval":
        raise ValueError(f"--task {task}: {where} is a retrieval dataset (captions, no class labels); "
                         "use --task zeroshot_retrieval")
    return task


def _check_file(path: str | None, flag: str) -> None:
    """A custom class-name/template JSON: a path, or a file CLIP_benchmark ships (e.g. cupl_prompts.json)."""
    import clip_benchmark.datasets

    shipped = Path(clip_benchmark.datasets.__file__).parent / str(path)
    if path is not None and not Path(path).is_file() and not shipped.is_file():
        raise ValueError(f"{flag} {path!r} does not exist")


def plan_runs(args: argparse.Namespace, model: str) -> list[Run]:
    """Every (dataset, sequence length) with its dataset root, task and output file, checked before anything is
    evaluated: roots exist, output names are distinct and writable."""
    from naflexclip.evaluation.zero_shot import check_output

    if any(length < 1 for length in args.seq_len):
        raise ValueError(f"--seq-len {' '.join(map(str, args.seq_len))}: sequence lengths are positive")
    if args.batch_size < 1:
        raise ValueError(f"--batch_size {args.batch_size}: images per batch, at least 1")
    if args.num_workers < 0:
        raise ValueError(f"--num_workers {args.num_workers}: loader processes, at least 0 (0: load in this process)")
    slug = os.path.basename(os.path.normpath(args.pretrained))
    runs = []
    for dataset in args.dataset:
        root = args.dataset_root.format(dataset=dataset, dataset_cleaned=dataset.replace("/", "-"))
        if "://" in root:
            raise ValueError(f"--dataset_root {root!r}: a local folder (naflexclip benchmark downloads nothing)")
        if not os.path.exists(root):
            raise ValueError(f"--dataset_root {root!r} does not exist (for --dataset {dataset}; naflexclip benchmark "
                             f"downloads nothing: put the dataset there)")
        task = _dataset_task(dataset, root, args.task)
        for seq_len in args.seq_len:
            try:
                name = args.output.format(model=model, pretrained=slug, task=task, language=args.language,
                                          pretrained_full_path=args.pretrained.replace("/", "_"),
                                          dataset=dataset.removeprefix("wds/").replace("/", "_"), seq_len=seq_len)
            except (KeyError, IndexError, ValueError) as error:
                raise ValueError(f"--output {args.output!r}: unknown placeholder {error} (use {{dataset}}, "
                                 f"{{pretrained}}, {{model}}, {{language}}, {{task}}, {{seq_len}})") from None
            runs.append(Run(dataset, root, task, seq_len, Path(name)))
    outputs = [run.output for run in runs]
    if len(set(outputs)) < len(outputs):
        raise ValueError(f"--output {args.output!r} names one file for several runs ({len(args.dataset)} datasets, "
                         f"{len(args.seq_len)} sequence lengths): put {{dataset}} and {{seq_len}} in it")
    for output in outputs:
        check_output(output)
    return runs


@contextmanager
def _no_downloads(dataset: str, root: str) -> Iterator[None]:
    """CLIP_benchmark's dataset builder fetches some datasets by running shell commands (wget, kaggle, unzip);
    refuse them, and turn its errors into one line naming the flag."""
    from clip_benchmark.datasets import builder

    def refuse(command: str, *args: Any, **kwargs: Any) -> int:
        raise ValueError(f"--dataset_root {root!r}: {dataset} is not complete there (CLIP_benchmark would run "
                         f"{command.split()[0]!r} to fetch it; naflexclip benchmark downloads nothing)")

    original = builder.call
    builder.call = refuse
    try:
        yield
    except ValueError as error:
        if str(error).startswith("Unsupported dataset"):
            raise ValueError(f"--dataset {dataset!r}: not a dataset CLIP_benchmark knows") from None
        raise
    except (AssertionError, FileNotFoundError, RuntimeError, OSError) as error:
        raise ValueError(f"--dataset {dataset} at --dataset_root {root!r}: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    finally:
        builder.call = original


def scalar_safe_accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)) -> list[float]:
    """CLIP_benchmark's `accuracy` (top-k accuracies of logits `[N, C]` against labels `[N]`), the same formula with
    each count read as a Python number: its `float(<1-element array>)` is an error from NumPy 2.4 on
    (LAION-AI/CLIP_benchmark#147, open)."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].reshape(-1).float().sum()) / len(target) for k in topk]


@contextmanager
def _numpy_compatible() -> Iterator[None]:
    """Run CLIP_benchmark's metrics with `scalar_safe_accuracy` where this NumPy rejects its own."""
    import numpy as np
    from clip_benchmark.metrics import linear_probe, zeroshot_classification

    try:
        float(np.ones(1))
    except TypeError:
        rejected = True
    else:
        rejected = False
    if not rejected:
        yield
        return
    originals = zeroshot_classification.accuracy, linear_probe.accuracy
    zeroshot_classification.accuracy = linear_probe.accuracy = scalar_safe_accuracy
    try:
        yield
    finally:
        zeroshot_classification.accuracy, linear_probe.accuracy = originals


def build_dataset(args: argparse.Namespace, run: Run, transform: NaFlexImageTransform, split: str, **extra: Any
                  ) -> Any:
    """CLIP_benchmark's dataset, read from the run's root, never downloaded."""
    from clip_benchmark.datasets.builder import build_dataset as clip_benchmark_dataset

    with _no_downloads(run.dataset, run.root):
        return clip_benchmark_dataset(dataset_name=run.dataset, root=run.root, transform=transform, split=split,
                                      annotation_file=args.annotation_file, download=False, language=args.language,
                                      **extra)


def _num_shards(root: str, split: str) -> int:
    """Shards of a `wds/` split (its nshards.txt, which CLIP_benchmark requires)."""
    return int(Path(root, split, "nshards.txt").read_text())


def _loader(args: argparse.Namespace, dataset: Any, name: str, root: str, *, batched: bool = True
            ) -> torch.utils.data.DataLoader | None:
    """CLIP_benchmark's loader: a `wds/` evaluation split batches itself; others go through its collate."""
    from clip_benchmark.datasets.builder import get_dataset_collate_fn

    if dataset is None:
        return None
    if batched and name.startswith("wds/"):
        # a worker without a shard stops webdataset ("fewer shards than workers"): at most one worker per shard
        return torch.utils.data.DataLoader(dataset.batched(args.batch_size), batch_size=None, shuffle=False,
                                           num_workers=min(args.num_workers, _num_shards(root, args.split)))
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=False,
                                       num_workers=args.num_workers, collate_fn=get_dataset_collate_fn(name),
                                       pin_memory=not batched)


def prepare(args: argparse.Namespace, run: Run, processing: Any, patch_size: int) -> dict[str, Any]:
    """The run's datasets, as CLIP_benchmark's `clip_benchmark eval` builds them: the evaluation split (with its
    class names and templates), and for a linear probe the training and validation splits."""
    transform = NaFlexImageTransform(processing, run.seq_len, patch_size)
    test = build_dataset(args, run, transform, args.split, task=run.task, wds_cache_dir=None,
                         custom_classname_file=args.custom_classname_file,
                         custom_template_file=args.custom_template_file)
    if run.task != "linear_probe":
        return {"test": test}
    train = build_dataset(args, run, transform, args.train_split)
    val = build_dataset(args, run, transform, args.val_split) if args.val_split else None
    if args.val_proportion is not None:
        train, val = torch.utils.data.random_split(train, [1 - args.val_proportion, args.val_proportion])
    return {"test": test, "train": train, "val": val}


def evaluate_run(args: argparse.Namespace, run: Run, datasets: dict[str, Any], model: BenchmarkModel,
                 tokenizer: Any, device: str, name: str) -> dict[str, Any]:
    """One run through CLIP_benchmark's metric code, called as its `clip_benchmark eval` calls it; its JSON."""
    from clip_benchmark.metrics import linear_probe, zeroshot_classification, zeroshot_retrieval

    torch.manual_seed(args.seed)
    test = datasets["test"]
    loader = _loader(args, test, run.dataset, run.root)
    with _numpy_compatible():
        if run.task == "zeroshot_classification":
            metrics = zeroshot_classification.evaluate(model, loader, tokenizer, test.classes, test.templates,
                                                       device=device, amp=False, verbose=False)
        elif run.task == "zeroshot_retrieval":
            metrics = zeroshot_retrieval.evaluate(model, loader, tokenizer, recall_k_list=args.recall_k,
                                                  device=device, amp=False)
        else:
            model_id = f"{name}-{args.pretrained}-{run.dataset}-seq{run.seq_len}".replace("/", "_")
            metrics = linear_probe.evaluate(
                model, _loader(args, datasets["train"], run.dataset, run.root, batched=False), loader, args.fewshot_k,
                args.batch_size, args.num_workers, args.fewshot_lr, args.fewshot_epochs, model_id, args.seed,
                args.feature_root, device=device,
                val_dataloader=_loader(args, datasets["val"], run.dataset, run.root, batched=False), amp=False,
                verbose=False)
    return {"dataset": run.dataset, "model": name, "pretrained": args.pretrained, "task": run.task,
            "metrics": metrics, "language": args.language, "seq_len": run.seq_len}


def run_benchmark(args: argparse.Namespace) -> int:
    """Handler of `naflexclip benchmark`: every input checked and every dataset opened before the first
    evaluation; then one evaluation and one JSON per (dataset, sequence length)."""
    from naflexclip.families import data_processing
    from naflexclip.models.precision import create_precision

    try:
        _require_clip_benchmark()
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here")
        if args.task == "linear_probe" and device != "cuda":
            raise ValueError("--task linear_probe: CLIP_benchmark's linear probe runs on CUDA only")
        _check_file(args.custom_classname_file, "--custom_classname_file")
        _check_file(args.custom_template_file, "--custom_template_file")
        model, config = load_model(args.pretrained, torch.device(device))
        name = model_name(args.pretrained, config)
        runs = plan_runs(args, name)
        processing = data_processing(config["data"].get("hf_processor"), model.image_patch_size)
        datasets = [prepare(args, run, processing, model.image_patch_size) for run in runs]
        tokenizer = functools.partial(processing.tokenize, context_length=model.context_length)
        precision = create_precision(getattr(args, "precision", None) or config["precision"], torch.device(device))
        wrapped = BenchmarkModel(model, precision.autocast).eval()
        for run, data in zip(runs, datasets, strict=True):
            try:
                result = evaluate_run(args, run, data, wrapped, tokenizer, device, name)
            except ValueError as error:  # from a loader worker: torch's "Caught ... in DataLoader worker" first
                raise ValueError(f"--dataset {run.dataset} at --dataset_root {run.root!r}: {_cause(error)}") from None
            with open(run.output, "w") as f:
                json.dump(result, f)
            shown = ", ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items() if isinstance(v, float))
            print(f"{run.dataset} {run.task} at {run.seq_len} patches: {shown}; wrote {run.output}")
    except (ValueError, FileNotFoundError) as error:
        print(f"naflexclip benchmark: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def _cause(error: Exception) -> str:
    """An error's own line: for one re-raised from a DataLoader worker, the original's last line."""
    text = str(error)
    if text.startswith("Caught ") and "Original Traceback" in text:
        return [line for line in text.splitlines() if line.strip()][-1]
    return text.splitlines()[0] if text else type(error).__name__


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `benchmark` (CLIP_benchmark's flag names, as its users type them)."""
    p = subparsers.add_parser("benchmark", help="CLIP_benchmark's evaluation of a checkpoint, per sequence length",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pretrained", required=True,
                   help="a naflexclip checkpoint directory (or a run's checkpoints/), or a SigLIP 2 directory")
    p.add_argument("--seq-len", type=int, nargs="+", required=True,
                   help="NaFlex patch budget per image; several: one evaluation (and output file) per length")
    p.add_argument("--dataset", nargs="+", required=True,
                   help="CLIP_benchmark dataset name(s), e.g. wds/NAME for its webdataset layout, imagenet1k")
    p.add_argument("--dataset_root", default="root",
                   help="the dataset's folder (may contain {dataset}); nothing is downloaded into it")
    p.add_argument("--task", default="auto", choices=("auto", *TASKS))
    p.add_argument("--split", "--test_split", dest="split", default="test")
    p.add_argument("--train_split", default="train", help="linear probe: training split")
    p.add_argument("--val_split", default=None, help="linear probe: validation split (weight-decay search)")
    p.add_argument("--val_proportion", type=float, default=None,
                   help="linear probe: share of the training split held out for validation instead")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--num_workers", type=int, default=4)
    # both SUPPRESS: no "(default: ...)" line; without either, the checkpoint's precision (run_benchmark)
    p.add_argument("--precision", default=argparse.SUPPRESS, choices=PRECISIONS,
                   help="precision of the forwards; default: the checkpoint's --precision, as naflexclip eval (fp32 "
                        "for a SigLIP 2 directory), not CLIP_benchmark's mixed precision")
    p.add_argument("--no_amp", dest="precision", action="store_const", const="fp32", default=argparse.SUPPRESS,
                   help="CLIP_benchmark's flag: no mixed precision (--precision fp32)")
    p.add_argument("--language", default="en")
    p.add_argument("--custom_classname_file", default=None, help="JSON: dataset name -> class names")
    p.add_argument("--custom_template_file", default=None, help="JSON: dataset name -> prompt templates with {c}")
    p.add_argument("--annotation_file", default="", help="retrieval: caption annotations (datasets that take one)")
    p.add_argument("--recall_k", type=int, nargs="+", default=[5])
    p.add_argument("--fewshot_k", type=int, default=-1, help="linear probe: examples per class (-1: all)")
    p.add_argument("--fewshot_epochs", type=int, default=10)
    p.add_argument("--fewshot_lr", type=float, default=0.1)
    p.add_argument("--feature_root", default="features", help="linear probe: where image features are cached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=DEFAULT_OUTPUT,
                   help="results JSON; placeholders {dataset} {pretrained} {model} {language} {task} {seq_len}")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    p.set_defaults(func=run_benchmark)
