"""The cross-setting checks of `TrainConfig` that are not about objectives, in the order its `__post_init__`
calls them: each takes the config being built (`cfg`), raises ValueError in one line naming the flag, and may
fill in or normalize fields (absolute paths, the loss a model trains with, the tokenizer of --pretrained).

`cfg` is typed `Any`: this module is imported by `train_config`, so it cannot import `TrainConfig` back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from naflexclip.evaluation.zero_shot import (
    IMAGENET_SETS,
    imagenet_set,
    read_classnames,
    read_image_folder,
    read_templates,
)
from naflexclip.families import family_of
from naflexclip.families.factory import check_preset_pretrained
from naflexclip.loss import LOSSES
from naflexclip.models.naflex_clip import PRESETS
from naflexclip.models.precision import check_precision
from naflexclip.models.run_weights import is_run_checkpoint, model_name_conflict, read_run_weights
from naflexclip.objectives.registry import objectives_of
from naflexclip.train.report import report_to_names
from naflexclip.window import METHODS, SCALE_MODES


def check_run_checkpoint(cfg: Any, default_model: str) -> bool:
    """--pretrained a naflexclip checkpoint: the model, loss and data processing of the run that wrote it
    (resolved to the one checkpoint directory read, so that a resume reads the same); --model and --loss
    that name another architecture are refused in one line. True when --pretrained is such a checkpoint."""
    if cfg.pretrained is None or not is_run_checkpoint(cfg.pretrained):
        return False
    try:
        found = read_run_weights(str(cfg.pretrained))
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"--pretrained: {str(error).splitlines()[0]}") from None
    conflict = model_name_conflict(cfg.model, found)
    if conflict is not None:
        raise ValueError(conflict)
    cfg.model = cfg.model or found.model_name or default_model
    if cfg.loss is not None and cfg.loss != found.config.loss:
        raise ValueError(f"--loss {cfg.loss}: the --pretrained checkpoint {str(found.path)!r} is a model trained "
                         f"with --loss {found.config.loss}; drop --loss")
    cfg.loss = found.config.loss
    cfg.pretrained = str(found.path.resolve())
    if cfg.data.hf_processor is None:  # the tokenizer and patching the checkpoint's model was trained with
        cfg.data.hf_processor = found.run_config.get("data", {}).get("hf_processor")
    return True


def check_choices(cfg: Any) -> None:
    """--model, the window's methods, --precision and --report-to name things that exist."""
    if cfg.model not in PRESETS and cfg.named_family is None:
        raise ValueError(f"--model: unknown model {cfg.model!r}; choose a preset ({', '.join(sorted(PRESETS))}) "
                         "or an OpenCLIP model name (open_clip.list_models())")
    for flag, value, choices in (
        ("--accum-method", cfg.accum_method, METHODS),
        ("--naflex-loss-scale", cfg.naflex_loss_scale, SCALE_MODES),
    ):
        if value not in choices:
            raise ValueError(f"{flag}: {value!r} is not one of {list(choices)}")
    cfg.precision = check_precision(cfg.precision)
    report_to_names(cfg.report_to)


def check_counts(cfg: Any) -> None:
    """Counts, rates and timeouts in range."""
    for flag, value, minimum in (
        ("--accum-freq", cfg.accum_freq, 1),
        ("--loss-tile-size", cfg.loss_tile_size, 1),
        ("--epochs", cfg.epochs, 1),
        ("--warmup", cfg.warmup, 0),
        ("--save-frequency", cfg.save_frequency, 0),
        ("--log-every-n-steps", cfg.log_every_n_steps, 1),
        ("--log-metric-every-n-steps", cfg.log_metric_every_n_steps, 1),
        ("--val-frequency", cfg.val_frequency, 0),
        ("--zero-shot-samples", cfg.zero_shot_samples, 1),
        ("--zeroshot-frequency", cfg.zeroshot_frequency, 0),
        ("--max-skipped-steps", cfg.max_skipped_steps, 1),
    ):
        if value < minimum:
            raise ValueError(f"{flag} must be >= {minimum}, got {value}")
    for flag, optional, minimum in (
        ("--save-every-n-steps", cfg.save_every_n_steps, 0),  # 0: never, as --save-frequency 0
        ("--stop-after-steps", cfg.stop_after_steps, 1),
        ("--batch-size", cfg.batch_size, 1),
    ):
        if optional is not None and optional < minimum:
            raise ValueError(f"{flag} must be >= {minimum}, got {optional}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.wd < 0:
        raise ValueError(f"--wd must be >= 0, got {cfg.wd}")
    if cfg.grad_clip_norm is not None and not cfg.grad_clip_norm > 0:
        raise ValueError(f"--grad-clip-norm must be > 0, got {cfg.grad_clip_norm}")
    if cfg.resume_fresh and cfg.resume != "latest":
        raise ValueError(f"--resume-fresh goes with --resume latest, got --resume {cfg.resume}")
    if not cfg.dist_timeout > 0:
        raise ValueError(f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")


def check_scale(cfg: Any) -> None:
    """--naflex-loss-scale scales by the reference batch size."""
    if cfg.naflex_loss_scale != "none" and cfg.batch_size is None:
        raise ValueError(
            f"--naflex-loss-scale {cfg.naflex_loss_scale} needs --batch-size (the reference batch size B_ref)"
        )


def check_pretrained(cfg: Any, from_run: bool) -> None:
    """--pretrained found and read now (absolute, so a resume finds it); its tokenizer and patching the data's."""
    if from_run:
        return  # the checkpoint's model, weights and processing (`check_run_checkpoint`)
    family = cfg.named_family
    if family is not None:  # an OpenCLIP name: its architecture, its weights from --pretrained, its tokenizer
        try:
            family.model_config(cfg.model)
            if cfg.pretrained is not None:  # the file, found and read now (absolute: a resume finds it)
                cfg.pretrained = str(family.check_pretrained(cfg.model, cfg.pretrained, cfg.cache_dir))
            tokenizer = family.tokenizer_dir(cfg.model, cfg.pretrained, cfg.cache_dir)
        except ValueError as error:
            message = str(error)
            raise ValueError(message if message.startswith("--") else f"--pretrained: {message}") from None
        if cfg.data.hf_processor is None:
            cfg.data.hf_processor = family.processor_spec(cfg.model, tokenizer)
        return
    if cfg.pretrained is None:
        return
    try:
        if cfg.model in PRESETS:
            check_preset_pretrained(cfg.model, cfg.pretrained)
        family_of(cfg.pretrained).check(cfg.pretrained)
    except ValueError as error:
        raise ValueError(f"--pretrained: {error}") from None
    cfg.pretrained = str(Path(cfg.pretrained).resolve())
    if cfg.data.hf_processor is None:  # its own tokenizer and patching feed it
        cfg.data.hf_processor = cfg.pretrained


def check_loss(cfg: Any, from_run: bool) -> None:
    """--loss: the model's own unless given; pretrained weights train only under their own."""
    if from_run:
        return  # the checkpoint's (`check_run_checkpoint`)
    if cfg.named_family is not None:
        own = cfg.named_family.model_config(cfg.model).loss
    else:
        own = family_of(cfg.pretrained).LOSS if cfg.pretrained else PRESETS[cfg.model].loss
    if cfg.loss is None:
        # --recipe siglip2 from scratch trains the sigmoid loss; pretrained weights keep their own
        kinds = [kind for objective in objectives_of(cfg, check=False) if (kind := objective.pair_loss_kind())]
        cfg.loss = own if cfg.pretrained else (kinds[0] if kinds else own)
    elif cfg.loss not in LOSSES:
        raise ValueError(f"--loss: {cfg.loss!r} is not one of {sorted(LOSSES)}")
    elif cfg.pretrained and cfg.loss != own:
        # SigLIP (2) is a sigmoid-loss model: its logit_bias only trains under that loss; CLIP weights have none
        raise ValueError(f"--loss {cfg.loss}: the --pretrained model is trained with --loss {own}; drop --loss")


def check_zeroshot(cfg: Any) -> None:
    """The ImageFolder, class names and templates of --zeroshot-data, read before the run starts."""
    for key in IMAGENET_SETS:  # --imagenet-val / --imagenet-v2: 1000 class folders in OpenCLIP's layout
        if getattr(cfg, key) is not None:
            imagenet_set(getattr(cfg, key), key)
            setattr(cfg, key, os.path.abspath(getattr(cfg, key)))
    if cfg.zeroshot_data is None:
        for flag, value in (("--zeroshot-classnames", cfg.zeroshot_classnames),
                            ("--zeroshot-templates", cfg.zeroshot_templates)):
            if value is not None:
                raise ValueError(f"{flag} goes with --zeroshot-data (the ImageFolder to classify)")
        return
    folder = read_image_folder(cfg.zeroshot_data, flag="--zeroshot-data")
    if cfg.zeroshot_classnames is not None:
        read_classnames(cfg.zeroshot_classnames, folder.folders, flag="--zeroshot-classnames")
    if cfg.zeroshot_templates is not None:
        read_templates(cfg.zeroshot_templates, flag="--zeroshot-templates")
    # absolute, so that a resume from another folder finds them; the metric names keep the folder's name
    for key in ("zeroshot_data", "zeroshot_classnames", "zeroshot_templates"):
        if getattr(cfg, key) is not None:
            setattr(cfg, key, os.path.abspath(getattr(cfg, key)))


def check_optimizer(cfg: Any) -> None:
    """The optimizer and schedule flags, one line naming the flag."""
    from naflexclip.train.optim import SCHEDULERS, check_optimizer_name

    check_optimizer_name(cfg.opt)
    if cfg.lr_scheduler not in SCHEDULERS:
        raise ValueError(f"--lr-scheduler: {cfg.lr_scheduler!r} is not one of {list(SCHEDULERS)}")
    if cfg.lr_scheduler == "const-cooldown":
        if cfg.epochs_cooldown is None or not 1 <= cfg.epochs_cooldown <= cfg.epochs:
            raise ValueError(f"--lr-scheduler const-cooldown needs --epochs-cooldown N with 1 <= N <= --epochs "
                             f"{cfg.epochs}, got {cfg.epochs_cooldown}")
    elif cfg.epochs_cooldown is not None:
        raise ValueError(f"--epochs-cooldown goes with --lr-scheduler const-cooldown, not {cfg.lr_scheduler}")
    if cfg.momentum is not None and not cfg.opt.startswith("timm/"):
        raise ValueError(f"--momentum goes with a timm optimizer (--opt timm/sgd, ...), not --opt {cfg.opt}")
    for flag, decay in (("--image-layer-decay", cfg.image_layer_decay),
                        ("--text-layer-decay", cfg.text_layer_decay)):
        if decay is not None and not 0.0 < decay <= 1.0:
            raise ValueError(f"{flag} must be in (0, 1], got {decay}")
    if cfg.lr_cooldown_power <= 0:
        raise ValueError(f"--lr-cooldown-power must be > 0, got {cfg.lr_cooldown_power}")
    cfg.opt_kwargs = dict(cfg.opt_kwargs)
    cfg.wd_exclude = tuple(cfg.wd_exclude)
    cfg.opt_fallback_list = tuple(cfg.opt_fallback_list)
    if cfg.opt_fallback_list and not cfg.opt.startswith("timm/"):
        raise ValueError(f"--opt-fallback-list goes with a Muon-family timm optimizer (timm/muon, timm/adamuon, "
                         f"timm/nadamuon), not --opt {cfg.opt}")


def check_run_flags(cfg: Any) -> None:
    """The run flags, one line naming the flag."""
    from naflexclip.train.remote_sync import PROTOCOLS

    if cfg.remote_sync_protocol not in PROTOCOLS:
        raise ValueError(f"--remote-sync-protocol: {cfg.remote_sync_protocol!r} is not one of {list(PROTOCOLS)}")
    if not cfg.remote_sync_frequency > 0:
        raise ValueError(f"--remote-sync-frequency must be > 0 seconds, got {cfg.remote_sync_frequency:g}")
    if cfg.async_save and cfg.fsdp_checkpoint != "sharded":
        raise ValueError(f"--async-save writes sharded checkpoints in the background; it goes with "
                         f"--fsdp-checkpoint sharded, got --fsdp-checkpoint {cfg.fsdp_checkpoint}")
    if cfg.resume == "latest" and cfg.name is None:
        runs = _runs_with_checkpoints(Path(cfg.logs))
        held = (f"the runs with checkpoints in --logs {cfg.logs}: {', '.join(map(repr, runs[:5]))}"
                f"{', ...' if len(runs) > 5 else ''}" if runs else f"--logs {cfg.logs} holds no run with checkpoints")
        raise ValueError(f"--resume latest continues the run that --name names; without --name a run gets a new "
                         f"dated name, with nothing to continue ({held})")


def _runs_with_checkpoints(logs: Path) -> list[str]:
    """The run folders in `logs` that hold a checkpoints/ folder, the newest first."""
    if not logs.is_dir():
        return []
    runs = [run for run in logs.iterdir() if (run / "checkpoints").is_dir()]
    return [run.name for run in sorted(runs, key=lambda run: run.stat().st_mtime, reverse=True)]


def check_model_overrides(cfg: Any) -> None:
    """OpenCLIP's --force-* flags, one line naming the flag."""
    if cfg.force_image_size is not None:
        cfg.force_image_size = tuple(int(v) for v in cfg.force_image_size)
        if len(cfg.force_image_size) not in (1, 2) or min(cfg.force_image_size) < 1:
            raise ValueError(f"--force-image-size takes one size or height and width >= 1, got "
                             f"{' '.join(map(str, cfg.force_image_size))}")
    if cfg.force_context_length is not None and cfg.force_context_length < 2:
        raise ValueError(f"--force-context-length must be >= 2, got {cfg.force_context_length}")
    if cfg.force_patch_dropout is not None and not 0.0 <= cfg.force_patch_dropout < 1.0:
        raise ValueError(f"--force-patch-dropout must be in [0, 1), got {cfg.force_patch_dropout}")
    for flag, value in (("--force-context-length", cfg.force_context_length),
                        ("--force-image-size", cfg.force_image_size)):
        if value is not None and cfg.pretrained:  # the checkpoint's position tables are fixed
            raise ValueError(f"{flag} changes a position table, which --pretrained brings; drop one of them")


def unused_settings(cfg: Any) -> list[str]:
    """A line for each training setting (beside the objectives' and the data's) other than its default where it
    changes nothing; said at the run's start."""
    lines = []
    if cfg.accum_freq == 1 and cfg.accum_method != "cache":  # "cache": the default
        lines.append(f"--accum-method {cfg.accum_method}: changes nothing with --accum-freq 1 (each window is "
                     f"one microbatch: nothing to cache or replay)")
    return lines
