"""OpenCLIP's evaluation-only command: `train --val-data ...` (with `--model`/`--pretrained`) without `--train-data`
evaluates the starting model once, in one process (retrieval on the validation data; zero-shot of --zeroshot-data /
--imagenet-val / --imagenet-v2) and exits, as `open_clip_train.main` does when it has no training data. Nothing is
trained or saved. `naflexclip eval` of a saved checkpoint is `train_command.run_eval`."""

from __future__ import annotations

import torch

from naflexclip.train.components import create_run_model
from naflexclip.train.config.train_config import TrainConfig


def evaluation_only(cfg: TrainConfig) -> bool:
    """A run OpenCLIP would only evaluate: validation data and no training data (the built-in demo is `train`
    with no data flags at all)."""
    return cfg.data.train_data is None and cfg.data.val_data is not None and cfg.data.dataset_type != "synthetic"


def evaluate_once(cfg: TrainConfig, notify: object = print) -> dict[str, float]:
    """The run's evaluations on its starting model, once, in this process."""
    from naflexclip.models.precision import create_precision
    from naflexclip.train.evaluator import evaluation_tasks, folder_zero_shot_tasks, run_tasks

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = create_precision(cfg.precision, device)
    model = create_run_model(cfg).to(device)
    tasks = evaluation_tasks(cfg.data, device, precision.autocast, notify=notify)
    tasks += folder_zero_shot_tasks(cfg, device, precision.autocast, notify)
    return run_tasks(model, tasks)
