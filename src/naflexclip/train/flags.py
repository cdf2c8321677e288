"""The flags of `naflexclip train` (OpenCLIP's names, in OpenCLIP's shared blocks) and `config_from_args`, the one
place they become a TrainConfig; the command handlers are `train.cli`.
"""

from __future__ import annotations

import argparse
import dataclasses

from naflexclip.data import data_config_from_args
from naflexclip.loss import LOSSES, MULTI_POSITIVE_WEIGHTINGS
from naflexclip.models.lock import Locks, add_lock_args
from naflexclip.models.naflex_clip import PRESETS
from naflexclip.objectives.distillation import Distill, add_distill_args
from naflexclip.objectives.siglip2_recipe import Recipe, add_recipe_args
from naflexclip.parallel.process_group import DEVICE_CHOICES, check_device
from naflexclip.window import METHODS, SCALE_MODES

from .openclip_defaults import DEMO_DEFAULTS, OPENCLIP_DEFAULTS, parse_kwargs, shown_value
from .openclip_flags import refused_message
from .train_config import DEFAULT_MODEL, PRECISIONS, TrainConfig

DEFAULTS = TrainConfig.__dataclass_fields__  # one source of truth for the defaults shown in --help

# `naflexclip train` with no flags is the newcomer's first run: the `small` preset on a slice of the built-in
# dataset, sized to learn visibly within 5 minutes on 2 CPU cores. The synthetic images are 48-512 px, so
# 36-100 patches of 16 px keep their shapes legible; a 1024-token budget (windows of ~20-110 examples at
# --accum-freq 2) gives ~260 optimizer steps. Scenes come in pairs that differ only in their shapes: without
# these hard negatives colour alone matches nearly every pair in a window and zero-shot shape stays at
# chance (docs/demo.md). The demo's values of OpenCLIP's flags are openclip_defaults.DEMO_DEFAULTS (--train-data:
# OpenCLIP's).
DEMO_DATA_DEFAULTS = {
    "synthetic_train_size": 3072,
    "synthetic_val_size": 256,
    "synthetic_shape_group_size": 2,
}


def _default(name: str) -> object:
    field = DEFAULTS[name]
    return field.default


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none") else int(text)


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """The training flags (data flags come from `add_data_args`)."""
    g = parser.add_argument_group("model and window")
    g.add_argument("--model", default=None,
                   help=f"model preset ({', '.join(sorted(PRESETS))}) or an OpenCLIP model name (ViT-B-16, "
                        "ViT-B-16-SigLIP2, naflex_ViT-B-16, ...: open_clip.list_models(); docs/openclip.md); default: "
                        f"{DEFAULT_MODEL}, or with --pretrained a naflexclip checkpoint that checkpoint's model")
    g.add_argument("--loss", default=None, choices=sorted(LOSSES),
                   help="contrastive loss: clip (softmax) or siglip (sigmoid, the model gets a logit_bias); default: "
                        "the model's own (clip for tiny, small and base; siglip for siglip2-*, SigLIP names and "
                        "--pretrained SigLIP 2)")
    g.add_argument("--siglip", dest="loss", action="store_const", const="siglip", default=argparse.SUPPRESS,
                   help="OpenCLIP's name for --loss siglip")
    g.add_argument("--batch-size", type=int, default=None,
                   help="reference batch size B_ref of --naflex-loss-scale (rows per microbatch come from the "
                        "token budget --naflex-max-tokens-per-batch)")
    g.add_argument("--accum-freq", type=int, default=_default("accum_freq"),
                   help="microbatches per optimizer step (one window; every example is a negative for every other)")
    g.add_argument("--accum-method", default=_default("accum_method"), choices=METHODS)
    g.add_argument("--loss-tile-size", type=int, default=_default("loss_tile_size"),
                   help="rows/columns of one block of the tiled loss (speed only; memory O(N·D + tile²))")
    g.add_argument("--naflex-loss-scale", default=_default("naflex_loss_scale"), choices=SCALE_MODES)
    o = parser.add_argument_group("optimization")
    o.add_argument("--lr", type=float, default=_default("lr"), help="peak learning rate")
    o.add_argument("--wd", type=float, default=_default("wd"), help="AdamW weight decay (matrices only)")
    betas = "OpenCLIP's for a ViT; with --opt timm/<name> the optimizer's own"
    o.add_argument("--beta1", type=float, default=None, help=f"(default: 0.9, {betas})")
    o.add_argument("--beta2", type=float, default=None, help=f"(default: 0.98, {betas})")
    o.add_argument("--eps", type=float, default=None, help=f"(default: 1e-6, {betas})")
    o.add_argument("--warmup", type=int, default=_default("warmup"), help="linear warmup, in optimizer steps")
    o.add_argument("--epochs", type=int, default=_default("epochs"))
    o.add_argument("--precision", default=_default("precision"), choices=PRECISIONS)
    o.add_argument("--grad-clip-norm", type=float, default=_default("grad_clip_norm"),
                   help="clip the window's gradient norm (0 or less: no clipping)")
    o.add_argument("--seed", type=int, default=_default("seed"))
    o.add_argument("--max-skipped-steps", type=int, default=_default("max_skipped_steps"),
                   help="stop after this many consecutive steps with a non-finite loss or gradient")
    g.add_argument("--pretrained", default=None,
                   help="with an OpenCLIP --model name: its weights, an open_clip checkpoint (.pt, .bin, "
                        ".safetensors, an open_clip_train epoch_N.pt), a pretrained tag (laion2b_s34b_b79k) or "
                        "hf-hub:org/name found in a local cache; otherwise a transformers SigLIP 2 directory, whose "
                        "architecture replaces --model and whose tokenizer and patching the data's; or a naflexclip "
                        "run's checkpoint (logs/RUN/checkpoints, or one step_N/epoch_N in it): its model's "
                        "architecture and weights only, a new run from step 0 with its own schedule")
    g.add_argument("--cache-dir", default=None,
                   help="where --pretrained tags and hf-hub: names are looked up (a Hugging Face hub cache or "
                        "open_clip's download folder), besides the default caches; nothing is downloaded")
    add_lock_args(parser)
    add_distill_args(parser)
    add_recipe_args(parser)
    m = parser.add_argument_group("several captions per image")
    m.add_argument("--multi-positive", action="store_true",
                   help="every caption of an image is a text row and a positive of it (group ids over the window): "
                        "clip: multi-positive InfoNCE; siglip: SigLIP+ (without it: one caption per image per epoch)")
    m.add_argument("--multi-positive-weighting", default="symmetric", choices=tuple(MULTI_POSITIVE_WEIGHTINGS),
                   help="SigLIP+'s positive weights α/k_i + β/k'_j: symmetric ½, ½; asymmetric 1, 0; soft: as labels")
    add_optimizer_args(parser)
    add_run_args(parser)
    add_model_override_args(parser)
    r = parser.add_argument_group("run, logs and checkpoints")
    # --logs-dir: torchrun (torch >= 2.9) rejects `--logs` after the script as ambiguous with its --logs-specs
    r.add_argument("--logs", "--logs-dir", dest="logs", default=_default("logs"),
                   help="runs go to {logs}/{name}/ (under torchrun spell it --logs-dir)")
    r.add_argument("--name", default=None, help="run name (default: date, model, lr, precision)")
    r.add_argument("--save-frequency", type=int, default=_default("save_frequency"),
                   help="save a checkpoint every N epochs (0: never)")
    r.add_argument("--save-every-n-steps", type=_optional_int, default=None)
    r.add_argument("--stop-after-steps", type=_optional_int, default=None,
                   help="save and stop after this many optimizer steps; the lr schedule still spans --epochs")
    r.add_argument("--resume", default=None, help="a checkpoint directory, or 'latest' (of --name: its newest usable "
                   "checkpoint; a run folder without one stops the run)")
    r.add_argument("--resume-fresh", action="store_true",
                   help="with --resume latest: start the run over when it has no usable checkpoint")
    r.add_argument("--report-to", default="",
                   help="also log to these, comma-separated: tensorboard, wandb (metrics.jsonl is always written)")
    r.add_argument("--wandb-project-name", default=None, help="W&B project (default: $WANDB_PROJECT, else naflexclip)")
    r.add_argument("--wandb-notes", default=_default("wandb_notes"), help="notes of the W&B run")
    r.add_argument("--log-every-n-steps", type=int, default=_default("log_every_n_steps"),
                   help="the console line (the progress bar's loss, lr, throughput) every N steps")
    r.add_argument("--log-metric-every-n-steps", type=int, default=_default("log_metric_every_n_steps"),
                   help="the metrics to metrics.jsonl, tensorboard and wandb every N steps (and every skipped step)")
    r.add_argument("--val-frequency", type=int, default=_default("val_frequency"),
                   help="evaluate every N epochs (and at the end); 0: only before training and at the end")
    r.add_argument("--zero-shot-samples", type=int, default=_default("zero_shot_samples"),
                   help="built-in single-object images for the zero-shot shape/colour evaluation")
    z = parser.add_argument_group("zero-shot classification of your own ImageFolder during training")
    z.add_argument("--zeroshot-data", default=None,
                   help="an ImageFolder (one sub-folder of images per class), logged as zeroshot/<folder name>/top1 "
                        "and top5")
    z.add_argument("--zeroshot-classnames", default=None,
                   help="text file, one class name per line in sorted folder order (default: the folder names)")
    z.add_argument("--zeroshot-templates", default=None,
                   help="text file, one prompt template per line with {} for the class name (default: a short set)")
    # not given: absent from the namespace (config_from_args tells a given one without zero-shot data)
    z.add_argument("--zeroshot-frequency", type=int, default=argparse.SUPPRESS,
                   help="classify --zeroshot-data every N epochs (also before training and at the end); 0: never "
                        f"(default: {_default('zeroshot_frequency')})")
    # OpenCLIP's ImageNet zero-shot (issue 22): one more zero-shot set each, every --zeroshot-frequency epochs
    z.add_argument("--imagenet-val", default=None,
                   help="ImageNet's validation ImageFolder (1000 synset folders): zero-shot with OpenCLIP's class "
                        "names and 80 templates, logged as zeroshot/imagenet-val/top1 and top5")
    z.add_argument("--imagenet-v2", default=None,
                   help="ImageNetV2 (imagenetv2_pytorch's folder: ImageNetV2-matched-frequency/0..999), likewise "
                        "zeroshot/imagenet-v2/...")
    r.add_argument("--no-plot", action="store_true", help="do not write curves.png")
    d = parser.add_argument_group("devices")
    d.add_argument("--device", default=None,
                   help=f"{', '.join(DEVICE_CHOICES)} (default: cuda if available; cuda:<local rank> in a job)")
    d.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 instead of DDP (needs several processes: torchrun, srun, mpirun)")
    d.add_argument("--grad-checkpointing", action="store_true",
                   help="recompute each tower block's activations in backward: less memory, ~1.3x time; stays exact")
    d.add_argument("--torchcompile", action="store_true",
                   help="torch.compile the towers (dynamic shapes: one graph per grad mode, not one per batch shape)")
    d.add_argument("--dist-timeout", type=float, default=_default("dist_timeout"),
                   help="seconds before a collective that another rank never joins fails")
    add_launcher_args(parser)


def add_launcher_args(parser: argparse.ArgumentParser) -> None:
    """OpenCLIP's launcher flags. The job itself comes from torchrun's, srun's or mpirun's variables
    (docs/training.md#clusters)."""
    g = parser.add_argument_group("launcher (torchrun, srun, mpirun)")
    g.add_argument("--dist-url", default=None,
                   help="torch's init method: env:// (MASTER_ADDR/MASTER_PORT, or the first node of SLURM's host "
                        "list and port 12802), tcp://HOST:PORT or file:///shared/path (default: env://)")
    g.add_argument("--dist-backend", default=None,
                   help="process group backend (default: nccl on CUDA, gloo on CPU)")
    g.add_argument("--no-set-device-rank", action="store_true",
                   help="--device cuda is the first visible GPU, not cuda:<local rank> (when CUDA_VISIBLE_DEVICES "
                        "gives each process its own GPU)")


def launcher_config(args: argparse.Namespace) -> dict[str, object]:
    """The launcher flags as TrainConfig fields."""
    return {"dist_url": args.dist_url, "dist_backend": args.dist_backend,
            "no_set_device_rank": args.no_set_device_rank}


# ---- OpenCLIP's defaults with --train-data (issue 22) ----
def _dest(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def apply_openclip_defaults(parser: argparse.ArgumentParser) -> None:
    """The flags whose built-in-data default differs from OpenCLIP's get no parser default (`with_defaults` fills
    them from the data source) and say both in --help."""
    by_dest = {action.dest: action for action in parser._actions}
    for key, demo in DEMO_DEFAULTS.items():
        action = by_dest[_dest(key)]
        action.default = argparse.SUPPRESS
        action.help = ((action.help + " ") if action.help else "") + (
            f"(default: {shown_value(OPENCLIP_DEFAULTS[key])}, OpenCLIP's; "
            f"on the built-in dataset: {shown_value(demo)})")


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every flag not given at its default: OpenCLIP's with --train-data, else the demo's."""
    source = OPENCLIP_DEFAULTS if getattr(args, "train_data", None) else DEMO_DEFAULTS
    defaults = {_dest(key): source[key] for key in DEMO_DEFAULTS}
    defaults["naflex_seq_lens"] = list(defaults["naflex_seq_lens"])
    return argparse.Namespace(**{**defaults, **vars(args)})
# ---- end of OpenCLIP's defaults ----


# ---- optimizer and schedule flags (OpenCLIP's, issue 22) ----
def add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    """OpenCLIP's optimizer and lr-schedule flags (`train.optim`)."""
    o = parser.add_argument_group("optimizer and lr schedule")
    o.add_argument("--opt", default="adamw",
                   help="adamw, nadamw (torch NAdam, decoupled weight decay) or timm/<name>: any optimizer of "
                        "timm.optim.create_optimizer_v2")
    o.add_argument("--opt-kwargs", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more optimizer arguments, each a Python literal (else a string), passed last")
    o.add_argument("--momentum", type=float, default=None, help="momentum of a timm optimizer")
    o.add_argument("--wd-exclude", nargs="*", default=[], metavar="PATTERN",
                   help="parameter-name globs (fnmatch) that get no weight decay, besides norms, biases, embeddings")
    o.add_argument("--opt-fallback-list", nargs="*", default=[], metavar="PATTERN",
                   help="parameter-name globs a Muon-family timm optimizer (timm/muon, ...) updates with its AdamW "
                        "fallback")
    o.add_argument("--image-layer-decay", "--visual-layer-decay", type=float, default=None,
                   help="layer-wise lr decay of the image tower: lr * decay ** (layer groups above; the projection "
                        "at full lr), in (0, 1]; unset or 1: off")
    o.add_argument("--text-layer-decay", type=float, default=None, help="the same for the text tower")
    o.add_argument("--lr-scheduler", default="cosine", choices=("cosine", "const", "const-cooldown"),
                   help="after --warmup: cosine decay to 0, constant, or constant then a cooldown")
    o.add_argument("--epochs-cooldown", type=int, default=None,
                   help="const-cooldown: cool down over the windows of the last N epochs")
    o.add_argument("--lr-cooldown-end", type=float, default=0.0, help="const-cooldown: the lr it ends at")
    o.add_argument("--lr-cooldown-power", type=float, default=1.0,
                   help="const-cooldown: (1 - progress) ** power (1: linear)")
    o.add_argument("--skip-scheduler", action="store_true", help="no schedule: the lr stays --lr (no warmup)")


def optimizer_config(args: argparse.Namespace) -> dict[str, object]:
    """The optimizer and schedule fields of TrainConfig from their flags (betas and eps: OpenCLIP's for a ViT,
    except a timm optimizer's own)."""
    timm = args.opt.startswith("timm/")
    own = {"beta1": 0.9, "beta2": 0.98, "eps": 1e-6}
    return {
        **{key: getattr(args, key) if getattr(args, key) is not None or timm else value for key, value in own.items()},
        "opt": args.opt, "opt_kwargs": parse_kwargs(args.opt_kwargs, "--opt-kwargs"), "momentum": args.momentum,
        "wd_exclude": tuple(args.wd_exclude), "opt_fallback_list": tuple(args.opt_fallback_list),
        "image_layer_decay": args.image_layer_decay,
        "text_layer_decay": args.text_layer_decay, "lr_scheduler": args.lr_scheduler,
        "epochs_cooldown": args.epochs_cooldown, "lr_cooldown_end": args.lr_cooldown_end,
        "lr_cooldown_power": args.lr_cooldown_power, "skip_scheduler": args.skip_scheduler,
    }
# ---- end of optimizer and schedule flags ----


# ---- run flags (OpenCLIP's, issue 22) ----
def add_run_args(parser: argparse.ArgumentParser) -> None:
    """OpenCLIP's checkpoint, backup and logging flags."""
    r = parser.add_argument_group("checkpoints, backup and logs")
    r.add_argument("--save-most-recent", action="store_true",
                   help="also save checkpoints/epoch_latest after every epoch (replaced each time)")
    r.add_argument("--delete-previous-checkpoint", action="store_true",
                   help="remove epoch_{N - --save-frequency} once epoch_N is saved")
    r.add_argument("--remote-sync", default=None,
                   help="back the run folder up to REMOTE/<name> (at the start, every --remote-sync-frequency s, "
                        "at the end)")
    r.add_argument("--remote-sync-frequency", type=float, default=300, help="seconds between syncs")
    r.add_argument("--remote-sync-protocol", default="s3",
                   help="s3 (runs `aws s3 sync`, as OpenCLIP) or fsspec (any fsspec URL or a local folder)")
    r.add_argument("--log-local", action="store_true",
                   help="each node's local rank 0 also writes its messages to {logs}/{name}/out-{rank}.log")
    r.add_argument("--debug", action="store_true",
                   help="log more: the optimizer's parameter groups, naflexclip's loggers at DEBUG")


def run_config(args: argparse.Namespace) -> dict[str, object]:
    return {key: getattr(args, key) for key in ("save_most_recent", "delete_previous_checkpoint", "remote_sync",
                                                "remote_sync_frequency", "remote_sync_protocol", "log_local",
                                                "debug")}
# ---- end of run flags ----


# ---- model overrides (OpenCLIP's --force-* flags, issue 22) ----
def add_model_override_args(parser: argparse.ArgumentParser) -> None:
    f = parser.add_argument_group("model overrides")
    f.add_argument("--force-context-length", type=int, default=None,
                   help="the text tower's context length (captions are tokenized to it)")
    f.add_argument("--force-patch-dropout", type=float, default=None,
                   help="the image tower's patch dropout rate while training (0: none; a resume may change it)")
    f.add_argument("--force-image-size", type=int, nargs="+", default=None,
                   help="NaFlex: the image tower's position-embedding grid, SIZE / patch size per side (H W for "
                        "a non-square table); the patches per image still come from --naflex-seq-lens")


    i = parser.add_argument_group("image processing overrides")
    i.add_argument("--image-mean", type=float, nargs="+", default=None, metavar="MEAN",
                   help="per-channel mean the patches are normalised with (1 or 3 values; default: the model's own, "
                        "OpenAI CLIP's for the presets); train, validation and zero-shot alike")
    i.add_argument("--image-std", type=float, nargs="+", default=None, metavar="STD", help="the same for the std")
    # no argparse choices: a bad value is DataConfig's one line (OpenCLIP's `random` among them), not a usage block
    i.add_argument("--image-interpolation", default=None, metavar="{bicubic,bilinear}",
                   help="the resize to the patch budget (default: the model's own, bicubic for the presets)")
    i.add_argument("--aug-cfg", nargs="*", default=[], metavar="KEY=VALUE",
                   help="the train crop (timm's RandomResizedCropToSequence; turns --augment on): scale=(lo, hi) of "
                        "the image's area, ratio=(lo, hi) of its aspect; use_timm and naflex are accepted (always so "
                        "here)")


# --aug-cfg keys of OpenCLIP's AugmentationCfg: those timm's NaFlex train crop takes, those that change nothing here
AUG_CFG_KEYS = ("scale", "ratio")
AUG_CFG_IMPLIED = ("use_timm", "naflex")


def image_override_config(args: argparse.Namespace) -> dict[str, object]:
    """DataConfig's fields of the image processing overrides (--aug-cfg: the crop's keys, one line for another)."""
    aug = parse_kwargs(args.aug_cfg, "--aug-cfg")
    for key in aug:
        if key not in AUG_CFG_KEYS + AUG_CFG_IMPLIED:
            raise ValueError(f"--aug-cfg {key}: not applied by naflexclip's NaFlex train crop, which takes "
                             f"{', '.join(AUG_CFG_KEYS)}")
    values: dict[str, object] = {"image_mean": args.image_mean, "image_std": args.image_std,
                                 "image_interpolation": args.image_interpolation,
                                 "aug_scale": aug.get("scale"), "aug_ratio": aug.get("ratio")}
    if args.aug_cfg:
        values["augment"] = True  # OpenCLIP's NaFlex training always crops; --aug-cfg shapes that crop
    return values


def model_override_config(args: argparse.Namespace) -> dict[str, object]:
    return {key: getattr(args, key) for key in ("force_context_length", "force_patch_dropout", "force_image_size")}
# ---- end of model overrides ----


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The one place flags become a TrainConfig (ValueError with a one-line, flag-naming message)."""
    refused = refused_message(args)
    if refused is not None:
        raise ValueError(refused)
    args = with_defaults(args)
    clip = args.grad_clip_norm
    check_device(args.device)
    # OpenCLIP's --imagenet-val / --imagenet-v2 feed zero-shot too, once this parser has them
    zero_shot_given = any(getattr(args, key, None) for key in ("zeroshot_data", "imagenet_val", "imagenet_v2"))
    # OpenCLIP's README drops --imagenet-val to skip zero-shot and keeps --zeroshot-frequency: there it classifies
    # nothing, so here too, said in one line at the start (a built-in note)
    if "zeroshot_frequency" in args and args.zeroshot_frequency != 0 and not zero_shot_given:
        args.openclip_built_in = [*getattr(args, "openclip_built_in", ()),
                                  f"--zeroshot-frequency {args.zeroshot_frequency}"]
    return TrainConfig(
        data=dataclasses.replace(data_config_from_args(args), **image_override_config(args)),
        model=args.model, loss=args.loss, batch_size=args.batch_size,
        accum_freq=args.accum_freq, accum_method=args.accum_method, naflex_loss_scale=args.naflex_loss_scale,
        lr=args.lr, wd=args.wd, warmup=args.warmup,
        epochs=args.epochs, precision=args.precision, grad_clip_norm=clip if clip is not None and clip > 0 else None,
        seed=args.seed, logs=args.logs, name=args.name, save_frequency=args.save_frequency,
        save_every_n_steps=args.save_every_n_steps, stop_after_steps=args.stop_after_steps, resume=args.resume,
        resume_fresh=args.resume_fresh,
        report_to=args.report_to, wandb_project_name=args.wandb_project_name, wandb_notes=args.wandb_notes,
        log_every_n_steps=args.log_every_n_steps, log_metric_every_n_steps=args.log_metric_every_n_steps,
        val_frequency=args.val_frequency,
        device=args.device, max_skipped_steps=args.max_skipped_steps, fsdp=args.fsdp,
        dist_timeout=args.dist_timeout, plot=not args.no_plot, loss_tile_size=args.loss_tile_size,
        zero_shot_samples=args.zero_shot_samples, zeroshot_data=args.zeroshot_data,
        zeroshot_classnames=args.zeroshot_classnames, zeroshot_templates=args.zeroshot_templates,
        zeroshot_frequency=getattr(args, "zeroshot_frequency", _default("zeroshot_frequency")),
        imagenet_val=getattr(args, "imagenet_val", None), imagenet_v2=getattr(args, "imagenet_v2", None),
        pretrained=args.pretrained, cache_dir=getattr(args, "cache_dir", None),
        grad_checkpointing=args.grad_checkpointing, torchcompile=args.torchcompile, **Locks.pick(args).as_dict(),
        openclip_built_in=tuple(getattr(args, "openclip_built_in", ())), **optimizer_config(args), **run_config(args),
        **model_override_config(args),
        **Distill.pick(args).as_dict(), **Recipe.pick(args).as_dict(), multi_positive=args.multi_positive,
        multi_positive_weighting=args.multi_positive_weighting,
        **launcher_config(args),
    )
