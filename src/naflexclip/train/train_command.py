"""`naflexclip train` and `naflexclip eval`: the handlers and the parsers (the training flags: `train.config.flags`).

Flag errors are reported as one line, `naflexclip train: error: <flag>: <what is wrong>`, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from naflexclip.data import DataConfig, DataError
from naflexclip.evaluation.evaluated_model import evaluated_model
from naflexclip.models.precision import PRECISIONS, check_precision
from naflexclip.objectives.registry import saved_objectives
from naflexclip.parallel.launchers import launched_world_size
from naflexclip.parallel.process_group import DistributedFault, check_device
from naflexclip.settings import add_arguments

from .config.flags import add_train_args, config_from_args
from .config.openclip_flags import HelpFormatter, add_openclip_flags, group_by_origin
from .config.train_config import TrainConfig

__all__ = ["add_parser", "run_eval", "run_train"]

DEFAULT_ZERO_SHOT_OUTPUT = "zeroshot_results.json"
# the settings `eval` shares with `train`: an ImageFolder classified zero-shot
ZERO_SHOT_KEYS = ("zeroshot_data", "zeroshot_classnames", "zeroshot_templates")


def _say(line: str) -> None:
    """One line to stderr in one write: ranks share the launcher's stderr pipe, and a write of a whole line
    (under the pipe's atomic size) is never split by another rank's line."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr without a file (a test's capture)
        print(line, file=sys.stderr)
        return
    os.write(fd, (line + "\n").encode())


def _error(command: str, message: str) -> int:
    _say(f"naflexclip {command}: error: {message}")
    return 2


def run_train(args: argparse.Namespace) -> int:
    """Handler of `naflexclip train`."""
    from .evaluate_only import evaluate_once, evaluation_only
    from .loop import train  # torch-heavy imports only when the command runs
    from .stop import TrainingInterrupted, TrainingStopped

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        cfg = config_from_args(args)
        world_size = launched_world_size(cfg.dist_url)  # a launch that cannot form one job stops here, every task
    except ValueError as error:
        return _error("train", str(error))
    if cfg.fsdp and world_size < 2:
        return _error("train", "--fsdp: shards the model over the job's processes, but this is one process; "
                               "launch with torchrun --nproc-per-node N (N >= 2), srun or mpirun, or drop --fsdp")
    if evaluation_only(cfg):  # OpenCLIP's evaluation-only command: no --train-data, --val-data
        if world_size > 1:
            return _error("train", "no --train-data: evaluating --val-data runs in one process; launch it without "
                                   "torchrun, srun or mpirun")
        _say("naflexclip train: no --train-data: evaluating --val-data once, as OpenCLIP does (nothing is trained "
             "or saved)")
        try:
            metrics = evaluate_once(cfg, notify=lambda line: _say(f"naflexclip train: {line}"))
        except (ValueError, DataError, FileNotFoundError) as error:
            return _error("train", str(error).splitlines()[0] if str(error) else type(error).__name__)
        print(json.dumps(metrics, indent=1))
        return 0
    try:
        train(cfg)
    except TrainingInterrupted as stop:  # the shell's convention: 128 + the signal's number
        if stop.show:
            _say(f"naflexclip train: {stop}")
        return 128 + stop.signal_number
    except (TrainingStopped, DistributedFault) as stop:
        # a rank that failed, died or disagreed: one line (the same on every rank), no traceback
        _say(f"naflexclip train: {str(stop).splitlines()[0]}")
        return 1
    except (ValueError, DataError, FileNotFoundError) as error:
        return _error("train", str(error).splitlines()[0] if str(error) else type(error).__name__)
    return 0


def run_zero_shot(args: argparse.Namespace, model: torch.nn.Module, config: dict, device: torch.device,
                  autocast: object, output: Path) -> int:
    """`eval --zeroshot-data DIR`: classify the ImageFolder DIR, print the results, write them as JSON."""
    from naflexclip.evaluation.zero_shot import (
        format_results,
        read_classnames,
        read_image_folder,
        read_templates,
        save_results,
        zero_shot_classify,
    )

    data = config["data"]
    seq_len = args.zero_shot_seq_len or max(data["naflex_seq_lens"])
    folders = read_image_folder(args.zeroshot_data).folders
    classnames = read_classnames(args.zeroshot_classnames, folders) if args.zeroshot_classnames else None
    templates = read_templates(args.zeroshot_templates) if args.zeroshot_templates else None
    overrides = DataConfig(**data).image_overrides()  # the run's --image-mean/--image-std/--image-interpolation
    results = zero_shot_classify(model, args.zeroshot_data, seq_len=seq_len, hf_processor=data.get("hf_processor"),
                                 classnames=classnames, templates=templates, device=device, autocast=autocast,
                                 image_overrides=overrides)
    results["seq_len"] = seq_len
    lines = save_results(results, output)
    print(format_results(results))
    print("\n".join(lines))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """Handler of `naflexclip eval`: the training run's evaluation on a checkpoint (with the built-in tasks, the dense
    probe; with a LocCa decoder, its metrics), printed as JSON (or, with --zeroshot-data, zero-shot classification
    of an ImageFolder)."""
    from naflexclip.evaluation.zero_shot import check_output
    from naflexclip.models.precision import create_precision

    from .evaluator import evaluate, has_builtin_tasks

    try:
        check_device(args.device)
        if args.precision is not None:
            args.precision = check_precision(args.precision)
        output = args.output or (DEFAULT_ZERO_SHOT_OUTPUT if args.zeroshot_data is not None else None)
        output = check_output(output) if output is not None else None
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            model, config = evaluated_model(args.checkpoint, device)
        except (ValueError, FileNotFoundError) as error:
            return _error("eval", f"--checkpoint {args.checkpoint}: {str(error).splitlines()[0]}")
        if args.zeroshot_data is not None:
            precision = create_precision(args.precision or config["precision"], device)
            return run_zero_shot(args, model, config, device, precision.autocast, output)
        data = DataConfig(**config["data"])
        if args.val_data is not None:
            data = DataConfig(**{**config["data"], "val_data": args.val_data, "dataset_type": args.dataset_type})
        precision = create_precision(args.precision or config["precision"], device)
        on_builtin = has_builtin_tasks(data) or args.zero_shot
        if data.source("val") is None and not on_builtin:
            return _error("eval", f"nothing to evaluate: the run of {args.checkpoint!r} has no validation data; pass "
                                  "--val-data (or --zero-shot for the built-in zero-shot tasks)")
        metrics = evaluate(model, data, device, precision.autocast,
                           zero_shot_samples=config["zero_shot_samples"] if on_builtin else 0, dense_probe=on_builtin,
                           objectives=saved_objectives(config),
                           notify=lambda line: _say(f"naflexclip eval: {line}"))
    except (ValueError, DataError, FileNotFoundError) as error:
        return _error("eval", str(error).splitlines()[0])
    print(json.dumps(metrics, indent=1))
    if output is not None:
        output.write_text(json.dumps(metrics, indent=1) + "\n")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `train` and `eval`."""
    train = subparsers.add_parser(
        "train", help="train a NaFlex CLIP/SigLIP model (built-in data by default)",
        description="OpenCLIP's flags mean what they mean in open_clip_train; with --train-data every one defaults "
                    "to OpenCLIP's value, on the built-in dataset to the demo's (both are shown). The run's first "
                    "lines list the settings that differ from OpenCLIP's defaults.",
        formatter_class=HelpFormatter)
    add_train_args(train)
    add_openclip_flags(train)  # last: OpenCLIP's flags no block above has added are built in or refused
    group_by_origin(train)
    train.set_defaults(func=run_train)
    evaluate = subparsers.add_parser("eval", help="retrieval, zero-shot, dense-probe and decoder evaluation of a "
                                                  "checkpoint")
    evaluate.add_argument("--checkpoint", required=True,
                          help="a checkpoint directory (or a run's checkpoints/), or a transformers SigLIP 2 directory")
    evaluate.add_argument("--val-data", default=None, help="evaluate on this data instead of the run's")
    evaluate.add_argument("--dataset-type", default="auto")
    evaluate.add_argument("--zero-shot", action="store_true",
                          help="also run the built-in zero-shot tasks and the dense probe")
    evaluate.add_argument("--precision", default=None, metavar="{" + ",".join(PRECISIONS) + "}",
                          help="default: the run's (OpenCLIP's amp_bfloat16 is amp_bf16)")
    evaluate.add_argument("--device", default=None)
    # train's declarations of them (`--zeroshot-data`; eval's first spelling `--zero-shot-data` an alias)
    (z,) = add_arguments(evaluate, TrainConfig, keys=ZERO_SHOT_KEYS).values()
    z.add_argument("--zero-shot-seq-len", type=int, default=None,
                   help="patch budget per image (default: the run's largest --naflex-seq-lens)")
    evaluate.add_argument("--output", "--zero-shot-output", dest="output", default=None,
                          help="where the results JSON goes (checked before evaluating; with --zeroshot-data "
                               f"default {DEFAULT_ZERO_SHOT_OUTPUT}, otherwise the metrics are only printed)")
    evaluate.set_defaults(func=run_eval)
