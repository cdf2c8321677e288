"""Evaluation: image↔text retrieval on the validation split, zero-shot classification of the built-in dataset's
attributes (shape, colour) and of ImageFolders, the dense probe, and each objective's own (`Objective.eval_tasks`:
the LocCa decoder's metrics).

During training an `Evaluator` built from the config runs them (each an `EvalTask` with its own frequency) and
keeps their history. What each metric measures: docs/training.md#outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from naflexclip.batch import to_device
from naflexclip.data import DataConfig, build_loader, build_zero_shot_loader
from naflexclip.data.synthetic import ATTRIBUTES, zero_shot_prompt_ensemble
from naflexclip.evaluation.zero_shot import (
    IMAGENET_SETS,
    empty_classes_line,
    ensemble_embeddings,
    imagenet_set,
    read_classnames,
    read_image_folder,
    read_templates,
    zero_shot_classify,
)
from naflexclip.families import data_processing
from naflexclip.objectives.objective import EvalContext, EvalTask, Objective
from naflexclip.parallel.process_group import DistributedEnv, barrier, run_on_main
from naflexclip.parallel.wrapping import unwrap_model
from naflexclip.train.config.train_config import TrainConfig
from naflexclip.train.report import Reporter, folder_zeroshot_keys

RECALL_AT = (1, 5, 10)
ZERO_SHOT_ATTRIBUTES = ("shape", "colour")
# the metrics of the one-line message after each evaluation (then each task's own, `EvalTask.brief`)
BRIEF_KEYS = ("val/image_to_text_R@1", "val/text_to_image_R@1", "val/image_to_text_R@10", "zeroshot/shape_top1",
              "zeroshot/colour_top1", "probe/miou")


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


def has_builtin_tasks(data: DataConfig) -> bool:
    """The zero-shot shape/colour tasks are the built-in dataset's attributes: only a model trained on it knows
    them."""
    return data.source("train") == ("synthetic", None)


def evaluation_tasks(data: DataConfig, device: torch.device, autocast: Callable[[], ContextManager[Any]], *,
                     zero_shot_samples: int = 0, frequency: int = 1, dense_probe: bool = False,
                     model: nn.Module | None = None, objectives: Sequence[Objective] = (), sharded: bool = False,
                     notify: Callable[[str], None] = print) -> list[EvalTask]:
    """Retrieval on the validation split (`val/...`) when there is one; with `zero_shot_samples` > 0, zero-shot
    accuracy on that many built-in single-object images (`zeroshot/{attribute}_top1`); with `dense_probe`, the
    linear segmentation probe of the patch tokens on the built-in scenes (`probe/miou`,
    `naflexclip.evaluation.dense_probe`); then the `objectives`' own of `model` (`Objective.eval_tasks`: the LocCa
    decoder's metrics). `sharded` (--fsdp): the tasks that run modules outside the model's forward are left out,
    and `notify` says which in one line; it says each kept task's note (pycocoevalcap missing)."""
    tasks = []
    if data.source("val") is not None:
        tasks.append(EvalTask("retrieval", frequency,
                              lambda model, skips: validation_retrieval(model, data, device, autocast, skips)))
    if zero_shot_samples:
        tasks.append(EvalTask("builtin_zero_shot", frequency, lambda model, skips: zero_shot_metrics(
            model, data, device, autocast, zero_shot_samples)))
    if dense_probe:
        from naflexclip.evaluation.dense_probe import dense_probe_metrics

        tasks.append(EvalTask("dense_probe", frequency,
                              lambda model, skips: dense_probe_metrics(model, data, device, autocast),
                              unsharded="the dense probe"))
    context = EvalContext(data, device, autocast, frequency)
    tasks += [task for objective in objectives for task in objective.eval_tasks(model, context)]
    if sharded:
        left_out = [task.unsharded for task in tasks if task.unsharded]
        if left_out:
            # greedy decoding and the probe's token features run modules outside the root forward FSDP gathers
            notify(f"{' and '.join(left_out)} not evaluated under --fsdp (run outside the sharded forward)")
        tasks = [task for task in tasks if not task.unsharded]
    for task in tasks:
        if task.note:
            notify(task.note)
    return tasks


def folder_zero_shot_tasks(cfg: TrainConfig, device: torch.device, autocast: Callable[[], ContextManager[Any]],
                           notify: Callable[[str], None]) -> list[EvalTask]:
    """Zero-shot classification (`folder_zero_shot_metrics`) at the largest --naflex-seq-lens, every
    --zeroshot-frequency epochs (0: never, as OpenCLIP's), of the ImageFolder --zeroshot-data
    (`zeroshot/<folder name>/...`) and of OpenCLIP's --imagenet-val / --imagenet-v2 (`zeroshot/imagenet-val/...`,
    `zeroshot/imagenet-v2/...`: OpenCLIP's ImageNet class names and 80 templates). Class folders without images
    are said through `notify` now, as `eval --zero-shot-data` says them."""
    if not cfg.zeroshot_frequency:
        return []
    seq_len, hf_processor = max(cfg.data.naflex_seq_lens), cfg.data.hf_processor
    sets: list[tuple[str, str, list[str] | None, list[str] | None]] = []  # (name, folder, classnames, templates)
    if cfg.zeroshot_data is not None:
        image_folder = read_image_folder(cfg.zeroshot_data, flag="--zeroshot-data")
        if image_folder.empty:
            notify(f"--zeroshot-data {cfg.zeroshot_data!r}: {empty_classes_line(image_folder.empty)}")
        folders = image_folder.folders
        classnames = (read_classnames(cfg.zeroshot_classnames, folders, flag="--zeroshot-classnames")
                      if cfg.zeroshot_classnames is not None else None)
        templates = (read_templates(cfg.zeroshot_templates, flag="--zeroshot-templates")
                     if cfg.zeroshot_templates is not None else None)
        sets.append((Path(cfg.zeroshot_data).name, cfg.zeroshot_data, classnames, templates))
    for key, (_, name) in IMAGENET_SETS.items():
        if getattr(cfg, key) is not None:
            imagenet = imagenet_set(getattr(cfg, key), key)
            if imagenet.empty:
                notify(f"{IMAGENET_SETS[key][0]} {getattr(cfg, key)!r}: {empty_classes_line(imagenet.empty)}")
            sets.append((name, str(imagenet.root), imagenet.classnames, imagenet.templates))

    def task(name: str, folder: str, classnames: list[str] | None, templates: list[str] | None) -> EvalTask:
        def run(model: nn.Module, skips: list[dict[str, Any]]) -> dict[str, float]:
            return folder_zero_shot_metrics(model, folder, seq_len=seq_len, hf_processor=hf_processor,
                                            classnames=classnames, templates=templates, device=device,
                                            autocast=autocast, skip_records=skips, name=name,
                                            image_overrides=cfg.data.image_overrides())

        return EvalTask(f"zeroshot/{name}", cfg.zeroshot_frequency, run)

    return [task(*s) for s in sets]


@torch.no_grad()
def run_tasks(model: nn.Module, tasks: list[EvalTask], skip_records: list[dict[str, Any]] | None = None
              ) -> dict[str, float]:
    """Every task's metrics. `model`: the plain module, or the FSDP-sharded one (then every rank must call
    this); it is left in train mode."""
    skips: list[dict[str, Any]] = [] if skip_records is None else skip_records
    model.eval()
    try:
        metrics: dict[str, float] = {}
        for task in tasks:
            metrics.update(task.run(model, skips))
    finally:
        model.train()
    return metrics


def evaluate(model: nn.Module, data: DataConfig, device: torch.device,
             autocast: Callable[[], ContextManager[Any]], *, zero_shot_samples: int = 0, dense_probe: bool = False,
             objectives: Sequence[Objective] = (), skip_records: list[dict[str, Any]] | None = None,
             notify: Callable[[str], None] = print) -> dict[str, float]:
    """`evaluation_tasks`' evaluations (retrieval on the validation split; the built-in zero-shot tasks with
    `zero_shot_samples` > 0; the dense probe; the `objectives`' own), once."""
    return run_tasks(model, evaluation_tasks(data, device, autocast, zero_shot_samples=zero_shot_samples,
                                             dense_probe=dense_probe, model=model, objectives=objectives,
                                             notify=notify), skip_records)


def validation_retrieval(model: nn.Module, data: DataConfig, device: torch.device,
                         autocast: Callable[[], ContextManager[Any]], skip_records: list[dict[str, Any]]
                         ) -> dict[str, float]:
    """`val/...` retrieval metrics of the validation split; its skipped samples go to `skip_records`."""
    with build_loader(data, split="val", patch_size=model.image_patch_size, context_length=model.context_length,
                      processing=data_processing(data.hf_processor, model.image_patch_size,
                                                 **data.image_overrides())) as val:
        features = _features(model, val, device, autocast)
    skip_records.extend(val.skip_records)
    metrics = {f"val/{k}": v for k, v in retrieval_metrics(features["image"], features["text"]).items()}
    metrics["val/num_samples"] = float(features["image"].shape[0])
    return metrics


def brief(metrics: dict[str, float], task_keys: Sequence[str] = ()) -> str:
    """The headline metrics of an evaluation, in one line (`task_keys`: its tasks' own, `EvalTask.brief`)."""
    keys = [*BRIEF_KEYS, *task_keys, *(k for k in folder_zeroshot_keys(metrics) if k.endswith("/top1"))]
    return ", ".join(f"{k.split('/', 1)[1]}={metrics[k]:.3f}" for k in keys if k in metrics)


class Evaluator:
    """Evaluation during training, built from the config: retrieval on the validation data, the enabled
    objectives' own (`Objective.eval_tasks`: the LocCa decoder's metrics with the recipe's decoder) and, for a
    model trained on the built-in dataset, its zero-shot tasks (none with --zeroshot-frequency 0) and the dense
    probe, every --val-frequency epochs (0: before training and at the end only); zero-shot classification of
    --zeroshot-data every --zeroshot-frequency epochs. Logs each evaluation and keeps the history (`state_dict`:
    the summary's "before" column survives a resume).

    The main rank evaluates while the others wait without a collective timeout, learning of an error at once
    (`run_on_main`); a sharded (FSDP) model is evaluated by every rank, since its forwards need every shard."""

    def __init__(self, cfg: TrainConfig, env: DistributedEnv, autocast: Callable[[], ContextManager[Any]],
                 reporter: Reporter, model: nn.Module | None = None, objectives: Sequence[Objective] = ()) -> None:
        self.env, self.reporter, self.sharded = env, reporter, cfg.fsdp
        builtin = has_builtin_tasks(cfg.data)
        # --zeroshot-frequency 0: no zero-shot at all, as in OpenCLIP (the built-in data's shape/colour tasks too)
        self.tasks = evaluation_tasks(cfg.data, env.device, autocast,
                                      zero_shot_samples=cfg.zero_shot_samples if builtin and cfg.zeroshot_frequency
                                      else 0,
                                      frequency=cfg.val_frequency, dense_probe=builtin, model=model,
                                      objectives=objectives, sharded=cfg.fsdp, notify=reporter.message)
        self.tasks += folder_zero_shot_tasks(cfg, env.device, autocast, reporter.message)
        self.history: list[dict[str, float]] = []  # [0]: the evaluation before the run's first step

    def due(self, epochs_done: int, last: bool) -> list[EvalTask]:
        """The tasks to run after `epochs_done` epochs (0: before training); `last`: the run's end."""
        return [task for task in self.tasks if epochs_done == 0 or last
                or (task.frequency and epochs_done % task.frequency == 0)]

    def __call__(self, model: nn.Module, step: int, epoch: float, epochs_done: int, last: bool = False
                 ) -> dict[str, float]:
        """Run the due tasks on `model` (as wrapped for training) at `step`; every rank calls this."""
        tasks = self.due(epochs_done, last)
        if not tasks:
            return {}

        def work() -> dict[str, float]:
            skips: list[dict[str, Any]] = []
            metrics = run_tasks(model if self.sharded else unwrap_model(model), tasks, skips)
            if self.env.is_main:  # (sharded: every rank evaluated the same validation data)
                self.reporter.write_skips(skips, step=step)
                if metrics:
                    self.history.append(metrics)
                    self.reporter.log("eval", step, epoch, metrics)
                    self.reporter.message(f"eval after step {step}: "
                                          + brief(metrics, [key for task in tasks for key in task.brief]))
            return metrics

        if self.sharded:
            metrics = work()
            barrier(self.env)
            return metrics
        return run_on_main(self.env, "evaluating", work) or {}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state["history"])


def zero_shot_metrics(model: nn.Module, data: DataConfig, device: torch.device,
                      autocast: Callable[[], ContextManager[Any]], num_samples: int) -> dict[str, float]:
    """Top-1 accuracy of nearest-prompt classification for each attribute, on single-object images."""
    processing = data_processing(data.hf_processor, model.image_patch_size,  # the model's own
                                 **data.image_overrides())
    with build_zero_shot_loader(data, patch_size=model.image_patch_size, context_length=model.context_length,
                                num_samples=num_samples, processing=processing) as loader:
        features = _features(model, loader, device, autocast)
    metrics = {}
    for attribute in ZERO_SHOT_ATTRIBUTES:
        classes = ensemble_embeddings(model, zero_shot_prompt_ensemble(attribute), processing.tokenize, device,
                                      autocast).cpu()
        predicted = (features["image"] @ classes.T).argmax(dim=1)
        metrics[f"zeroshot/{attribute}_top1"] = float((predicted == features["labels"][attribute]).float().mean())
        metrics[f"zeroshot/{attribute}_chance"] = 1.0 / len(ATTRIBUTES[attribute])
    return metrics


def folder_zero_shot_metrics(model: nn.Module, folder: str, *, seq_len: int, hf_processor: str | None,
                             classnames: list[str] | None, templates: list[str] | None, device: torch.device,
                             autocast: Callable[[], ContextManager[Any]], skip_records: list[dict[str, Any]],
                             name: str | None = None, image_overrides: dict[str, Any] | None = None
                             ) -> dict[str, float]:
    """`zeroshot/<name>/top1`, `top5` (top-k of fewer classes: all of them) and `chance` (top-1's) of
    `eval --zero-shot-data`'s classification of the ImageFolder `folder` (`name`: default the folder's name); files
    that do not decode go to `skip_records`."""
    results = zero_shot_classify(model, folder, seq_len=seq_len, hf_processor=hf_processor, classnames=classnames,
                                 templates=templates, device=device, autocast=autocast,
                                 image_overrides=image_overrides)
    skip_records.extend(results["skipped_samples"])
    name = name or Path(folder).name
    return {f"zeroshot/{name}/top1": results["top1"],
            f"zeroshot/{name}/top5": results[f"top{min(5, results['num_classes'])}"],
            f"zeroshot/{name}/chance": results["chance"]}
