"""TrainConfig: the typed, validated configuration of one training run, each field a setting declared once with
its flag, help, OpenCLIP's default and resume rule (`naflexclip.settings`; the CLI's flags are generated from it).

Defaults are the newcomer's first run, for the Python API and the command line alike: the `small` preset on the
built-in synthetic dataset, sized to finish in a few minutes on a 2-core CPU (`DEMO_DEFAULTS`: those that differ
from OpenCLIP's). With `--train-data` the CLI uses OpenCLIP's defaults instead (`OPENCLIP_DEFAULTS`). Every
validation error is one line and names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from naflexclip.data import DataConfig
from naflexclip.families import family_of, named_family
from naflexclip.families.factory import DEFAULT_MODEL, ModelSettings
from naflexclip.models.lock import Locks
from naflexclip.models.naflex_clip import PRESETS
from naflexclip.models.precision import PRECISIONS
from naflexclip.objectives.registry import ObjectiveFlags, objectives_of
from naflexclip.parallel.launchers import check_backend, check_dist_url
from naflexclip.parallel.process_group import DeviceSettings
from naflexclip.rng import Seed
from naflexclip.settings import (
    APPLY,
    DEVICES_SECTION,
    IGNORE,
    NO_FLAG,
    NOT_OPENCLIP,
    OPTIMIZATION_SECTION,
    REFUSE,
    RESCHEDULE,
    nested,
    parse_kwargs,
    same_as,
    setting,
    settings_of,
    switches_with_data,
)
from naflexclip.train.config import config_checks
from naflexclip.window.window_settings import WindowSettings

__all__ = ["DEMO_DEFAULTS", "FLAG_NAMES", "OPENCLIP_DEFAULTS", "SETTINGS", "TrainConfig", "flag_name"]

# --help's sections
_OPTIMIZATION = OPTIMIZATION_SECTION
_OPTIMIZER = "optimizer and lr schedule"
_BACKUP = "checkpoints, backup and logs"
_OVERRIDES = "model overrides"
_RUN = "run, logs and checkpoints"
_ZERO_SHOT = "zero-shot classification of your own ImageFolder"  # eval's too
_DEVICES = DEVICES_SECTION
_LAUNCHER = "launcher (torchrun, srun, mpirun)"
# what a refused change would change
_THE_MODEL = "the model"
_GROUPS = "the optimizer or its parameter groups"  # another optimizer's state or other groups cannot be loaded
_BETAS = "OpenCLIP's for a ViT; with --opt timm/<name> the optimizer's own"


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none") else int(text)


def _own_unless_timm(name: str, default: float, shown: str) -> Any:
    """--beta1/--beta2/--eps not given: OpenCLIP's for a ViT, a timm optimizer's own (None)."""
    def value(args: Any) -> float | None:
        given = getattr(args, name)
        return given if given is not None or str(args.opt).startswith("timm/") else default
    return setting(default, rule=APPLY, section=_OPTIMIZATION, openclip=default, flag_default=None,
                   reads=(name, "opt"), from_args=value, help=f"(default: {shown}, {_BETAS})")


@dataclass
class RunSettings:
    """The settings of a run besides its objectives' (`TrainConfig`'s first fields)."""

    data: DataConfig = nested(DataConfig)
    # declared in their groups, which verify takes too; --pretrained right after --model: a resume names a different
    # model or pretrained source before what follows from it (the loss)
    model: str | None = same_as(ModelSettings, "model")
    pretrained: str | None = same_as(ModelSettings, "pretrained")
    loss: str | None = same_as(ModelSettings, "loss")
    batch_size: int | None = same_as(WindowSettings, "batch_size")
    accum_freq: int = same_as(WindowSettings, "accum_freq")
    accum_method: str = same_as(WindowSettings, "accum_method")
    loss_tile_size: int = same_as(WindowSettings, "loss_tile_size")
    naflex_loss_scale: str = same_as(WindowSettings, "naflex_loss_scale")
    lr: float = setting(1e-3, rule=RESCHEDULE, section=_OPTIMIZATION, openclip=5e-4, help="peak learning rate")
    wd: float = setting(0.1, rule=APPLY, section=_OPTIMIZATION, openclip=0.2,
                        help="AdamW weight decay (matrices only)")
    beta1: float = _own_unless_timm("beta1", 0.9, "0.9")
    beta2: float = _own_unless_timm("beta2", 0.98, "0.98")
    eps: float = _own_unless_timm("eps", 1e-6, "1e-6")
    warmup: int = setting(20, rule=RESCHEDULE, section=_OPTIMIZATION, openclip=10000,
                          help="linear warmup, in optimizer steps")
    epochs: int = setting(3, rule=RESCHEDULE, section=_OPTIMIZATION, openclip=32)
    # no argparse choices: OpenCLIP's other values get one line each (`check_precision`), not a usage block
    precision: str = setting("fp32", rule=APPLY, section=_OPTIMIZATION, openclip="amp_bf16",
                             metavar="{" + ",".join(PRECISIONS) + "}", help=(
        "fp32; amp_bf16 (bfloat16 autocast; OpenCLIP's amp_bfloat16 too); amp (float16 autocast with a gradient "
        "scaler, CUDA)"))
    grad_clip_norm: float | None = setting(1.0, rule=APPLY, section=_OPTIMIZATION, openclip=None,
                                           convert=lambda clip: clip if clip is not None and clip > 0 else None,
                                           also=((("--no-grad-clip-norm",), {
                                               "action": "store_const", "const": None, "default": argparse.SUPPRESS,
                                               "help": "no clipping (OpenCLIP's default)"}),),
                                           help="clip the window's gradient norm (0 or less: no clipping)")
    seed: int = same_as(Seed, "seed")
    # --logs-dir: torchrun (torch >= 2.9) rejects `--logs` after the script as ambiguous with its --logs-specs
    logs: str = setting("./logs", rule=IGNORE, section=_RUN, aliases=("--logs-dir",),
                        help="runs go to {logs}/{name}/ (under torchrun spell it --logs-dir)")
    # None: `default_name()`, decided when the run starts
    name: str | None = setting(None, rule=IGNORE, section=_RUN, help="run name (default: date, model, lr, precision)")
    save_frequency: int = setting(1, rule=APPLY, section=_RUN, openclip=1,
                                  help="save a checkpoint every N epochs (0: never)")
    save_every_n_steps: int | None = setting(None, rule=APPLY, section=_RUN, type=_optional_int,
                                             help="save a checkpoint every N optimizer steps (0 or unset: never)")
    stop_after_steps: int | None = setting(None, rule=IGNORE, section=_RUN, type=_optional_int, help=(
        "save and stop after this many optimizer steps; the lr schedule still spans --epochs"))
    resume: str | None = setting(None, rule=IGNORE, section=_RUN, help=(
        "a checkpoint directory, or 'latest' (of --name: its newest usable checkpoint; a run folder without one "
        "stops the run)"))
    # --resume latest on a run with no usable checkpoint: start over, not stop
    resume_fresh: bool = setting(False, rule=IGNORE, section=_RUN, help=(
        "with --resume latest: start the run over when it has no usable checkpoint"))
    # sinks besides metrics.jsonl, comma-separated ("wandb,tensorboard")
    report_to: str = setting("", rule=IGNORE, section=_RUN, help=(
        "also log to these, comma-separated: tensorboard, wandb (metrics.jsonl is always written)"))
    wandb_project_name: str | None = setting(None, rule=IGNORE, section=_RUN,
                                             help="W&B project (default: $WANDB_PROJECT, else naflexclip)")
    wandb_notes: str = setting("", rule=IGNORE, section=_RUN, help="notes of the W&B run")
    log_every_n_steps: int = setting(1, rule=IGNORE, section=_RUN, openclip=100, help=(
        "the console line (the progress bar's loss, lr, throughput) every N steps"))
    log_metric_every_n_steps: int = setting(1, rule=IGNORE, section=_RUN, openclip=10, help=(
        "the metrics to metrics.jsonl, tensorboard and wandb every N steps (and every skipped step)"))
    val_frequency: int = setting(1, rule=APPLY, section=_RUN, openclip=1, help=(
        "evaluate every N epochs (and at the end); 0: only before training and at the end"))
    zero_shot_samples: int = setting(300, rule=APPLY, section=_RUN, help=(
        "built-in single-object images for the zero-shot shape/colour evaluation"))
    # an ImageFolder classified zero-shot during training (`zeroshot/<name>/...`)
    # these three are eval's too (`--zero-shot-data`: eval's first spelling)
    zeroshot_data: str | None = setting(None, rule=APPLY, section=_ZERO_SHOT, aliases=("--zero-shot-data",), help=(
        "an ImageFolder (one sub-folder of images per class); its top-1 and top-5 (in training logged as "
        "zeroshot/<folder name>/top1 and top5)"))
    zeroshot_classnames: str | None = setting(None, rule=APPLY, section=_ZERO_SHOT,
                                              aliases=("--zero-shot-classnames",), help=(
        "text file, one class name per line in sorted folder order (default: the folder names)"))
    zeroshot_templates: str | None = setting(None, rule=APPLY, section=_ZERO_SHOT,
                                             aliases=("--zero-shot-templates",), help=(
        "text file, one prompt template per line with {} for the class name (default: a short set)"))
    # OpenCLIP's: every N epochs (before training and at the end too); 0: never. Not given: absent from the
    # namespace (config_from_args tells a given one without zero-shot data)
    zeroshot_frequency: int = setting(2, rule=APPLY, section=_ZERO_SHOT, openclip=2, flag_default=argparse.SUPPRESS,
                                      help="classify --zeroshot-data every N epochs (also before training and at the "
                                           "end); 0: never, nor the built-in data's zero-shot tasks (default: 2)")
    imagenet_val: str | None = setting(None, rule=APPLY, section=_ZERO_SHOT, help=(
        "ImageNet's validation ImageFolder (1000 synset folders): zero-shot with OpenCLIP's class names and 80 "
        "templates, logged as zeroshot/imagenet-val/top1 and top5"))
    imagenet_v2: str | None = setting(None, rule=APPLY, section=_ZERO_SHOT, help=(
        "ImageNetV2 (imagenetv2_pytorch's folder: ImageNetV2-matched-frequency/0..999), likewise "
        "zeroshot/imagenet-v2/..."))
    device: str | None = same_as(DeviceSettings, "device")
    max_skipped_steps: int = setting(10, rule=APPLY, section=_OPTIMIZATION, help=(
        "stop after this many consecutive steps with a non-finite loss or gradient"))
    fsdp: bool = setting(False, rule=APPLY, section=_DEVICES, openclip=False, runtime=True, help=(
        "shard the model with FSDP2 instead of DDP (needs several processes: torchrun, srun, mpirun)"))
    # how a checkpoint is written: either form resumes at any world size, under FSDP2, DDP or one process; a resume
    # keeps the run's form unless its command line gives another, which the resume then names
    fsdp_checkpoint: str = setting("full", rule=APPLY, section=_DEVICES, openclip="full",
                                   choices=("full", "sharded"), help=(
        "full: rank 0 gathers the model and optimizer and writes model.safetensors; sharded: every rank writes its "
        "own shards through torch.distributed.checkpoint (no gather; resumes at any world size, under FSDP2, DDP or "
        "one process)"))
    async_save: bool = setting(False, rule=APPLY, section=_DEVICES, help=(
        "with --fsdp-checkpoint sharded: training continues while the shards are written (DCP's async_save); the "
        "next save waits for the previous one"))
    grad_checkpointing: bool = same_as(DeviceSettings, "grad_checkpointing")
    # torch.compile the towers' blocks (dynamic shapes)
    torchcompile: bool = setting(False, rule=APPLY, section=_DEVICES, openclip=False, runtime=True, help=(
        "torch.compile the towers (dynamic shapes: one graph per grad mode, not one per batch shape)"))
    dist_timeout: float = setting(1800.0, rule=IGNORE, section=_DEVICES,
                                  per_rank="how long this process waits for the others", help=(
        "seconds before a collective that another rank never joins fails"))
    plot: bool = setting(True, rule=IGNORE, section=_RUN, flag="--no-plot", dest="no_plot",
                         action="store_true", flag_default=False, convert=lambda no_plot: not no_plot,
                         help="do not write curves.png")
    cache_dir: str | None = same_as(ModelSettings, "cache_dir")
    # the locked towers (OpenCLIP's flags), declared in `naflexclip.models.lock.Locks`, which verify takes too
    lock_image: bool = same_as(Locks, "lock_image")
    lock_image_unlocked_groups: int = same_as(Locks, "lock_image_unlocked_groups")
    lock_text: bool = same_as(Locks, "lock_text")
    lock_text_unlocked_layers: int = same_as(Locks, "lock_text_unlocked_layers")
    lock_text_freeze_layer_norm: bool = same_as(Locks, "lock_text_freeze_layer_norm")
    # OpenCLIP's flags given that naflexclip has built in (`--flag [value]`; `openclip_flags.BUILT_IN`): what they
    # change here is said at the start of the run
    openclip_built_in: tuple[str, ...] = setting(
        (), rule=IGNORE, flag=NO_FLAG, reads=("openclip_built_in",),
        from_args=lambda args: tuple(getattr(args, "openclip_built_in", ())))
    # ---- optimizer and schedule (OpenCLIP's flags; `train.optim`) ----
    opt: str = setting("adamw", rule=REFUSE, why=_GROUPS, section=_OPTIMIZER, openclip="adamw", help=(
        "adamw, nadamw (torch NAdam, decoupled weight decay) or timm/<name>: any optimizer of "
        "timm.optim.create_optimizer_v2"))
    # passed to the optimizer last (applied, as --wd and --beta1 are)
    opt_kwargs: dict[str, Any] = setting(
        default_factory=dict, rule=APPLY, section=_OPTIMIZER, openclip={},
        nargs="*", metavar="KEY=VALUE", flag_default=[],
        convert=lambda items: parse_kwargs(items, "--opt-kwargs"),
        help="more optimizer arguments, each a Python literal (else a string), passed last")
    momentum: float | None = setting(None, rule=APPLY, section=_OPTIMIZER, openclip=None,
                                     help="momentum of a timm optimizer")
    wd_exclude: tuple[str, ...] = setting((), rule=REFUSE, why=_GROUPS, section=_OPTIMIZER, openclip=(),
                                          nargs="*", metavar="PATTERN", help=(
        "parameter-name globs (fnmatch) that get no weight decay, besides norms, biases, embeddings"))
    opt_fallback_list: tuple[str, ...] = setting((), rule=REFUSE, why=_GROUPS, section=_OPTIMIZER, openclip=(),
                                                 nargs="*", metavar="PATTERN", help=(
        "parameter-name globs a Muon-family timm optimizer (timm/muon, ...) updates with its AdamW fallback"))
    image_layer_decay: float | None = setting(None, rule=REFUSE, why=_GROUPS, section=_OPTIMIZER, openclip=None,
                                              aliases=("--visual-layer-decay",), help=(
        "layer-wise lr decay of the image tower: lr * decay ** (layer groups above; the projection at full lr), in "
        "(0, 1]; unset or 1: off"))
    text_layer_decay: float | None = setting(None, rule=REFUSE, why=_GROUPS, section=_OPTIMIZER, openclip=None,
                                             help="the same for the text tower")
    lr_scheduler: str = setting("cosine", rule=RESCHEDULE, section=_OPTIMIZER, openclip="cosine",
                                choices=("cosine", "const", "const-cooldown"),
                                help="after --warmup: cosine decay to 0, constant, or constant then a cooldown")
    epochs_cooldown: int | None = setting(None, rule=RESCHEDULE, section=_OPTIMIZER, openclip=None,
                                          help="const-cooldown: cool down over the windows of the last N epochs")
    lr_cooldown_end: float = setting(0.0, rule=RESCHEDULE, section=_OPTIMIZER, openclip=0.0,
                                     help="const-cooldown: the lr it ends at")
    lr_cooldown_power: float = setting(1.0, rule=RESCHEDULE, section=_OPTIMIZER, openclip=1.0,
                                       help="const-cooldown: (1 - progress) ** power (1: linear)")
    skip_scheduler: bool = setting(False, rule=RESCHEDULE, section=_OPTIMIZER, openclip=False,
                                   help="no schedule: the lr stays --lr (no warmup)")
    # ---- run flags (OpenCLIP's): where and how the run saves and logs ----
    save_most_recent: bool = setting(False, rule=IGNORE, section=_BACKUP, openclip=False, help=(
        "also save checkpoints/epoch_latest after every epoch (replaced each time)"))
    delete_previous_checkpoint: bool = setting(False, rule=IGNORE, section=_BACKUP, openclip=False, help=(
        "remove epoch_{N - --save-frequency} once epoch_N is saved"))
    # the run folder is backed up to {remote_sync}/{name} (`train.remote_sync`)
    remote_sync: str | None = setting(None, rule=IGNORE, section=_BACKUP, openclip=None, help=(
        "back the run folder up to REMOTE/<name> (at the start, every --remote-sync-frequency s, at the end)"))
    remote_sync_frequency: float = setting(300, rule=IGNORE, section=_BACKUP, openclip=300,
                                           help="seconds between syncs")
    remote_sync_protocol: str = setting("s3", rule=IGNORE, section=_BACKUP, openclip="s3", help=(
        "s3 (runs `aws s3 sync`, as OpenCLIP) or fsspec (any fsspec URL or a local folder)"))
    log_local: bool = setting(False, rule=IGNORE, section=_BACKUP, openclip=False,
                              per_rank="a node's own log file", help=(
        "each node's local rank 0 also writes its messages to {logs}/{name}/out-{rank}.log"))
    debug: bool = setting(False, rule=IGNORE, section=_BACKUP, openclip=False,
                          per_rank="this process's log level", help=(
        "log more: the optimizer's parameter groups, naflexclip's loggers at DEBUG"))
    # launcher (OpenCLIP's flags; the job itself comes from torchrun's, srun's or mpirun's variables): how the job
    # forms
    dist_url: str | None = setting(None, rule=IGNORE, section=_LAUNCHER, help=(
        "torch's init method: env:// (MASTER_ADDR/MASTER_PORT, or the first node of SLURM's host list and port "
        "12802), tcp://HOST:PORT or file:///shared/path (default: env://)"))
    dist_backend: str | None = setting(None, rule=IGNORE, section=_LAUNCHER, help=(
        "process group backend (default: nccl on CUDA, gloo on CPU)"))
    no_set_device_rank: bool = setting(False, rule=IGNORE, section=_LAUNCHER,
                                       per_rank="which GPU this process takes", help=(
        "--device cuda is the first visible GPU, not cuda:<local rank> (when CUDA_VISIBLE_DEVICES gives each "
        "process its own GPU)"))
    # ---- model overrides (OpenCLIP's --force-* flags; `model_overrides`) ----
    force_context_length: int | None = setting(None, rule=REFUSE, why=_THE_MODEL, section=_OVERRIDES, openclip=None,
                                               help="the text tower's context length (captions are tokenized to it)")
    force_patch_dropout: float | None = setting(None, rule=APPLY, section=_OVERRIDES, openclip=None, help=(
        "the image tower's patch dropout rate while training (0: none; a resume may change it)"))
    # NaFlex: the position table's grid, size / patch per side
    force_image_size: tuple[int, ...] | None = setting(None, rule=REFUSE, why=_THE_MODEL, section=_OVERRIDES,
                                                       openclip=None, help=(
        "NaFlex: the image tower's position-embedding grid, SIZE / patch size per side (H W for a non-square table); "
        "the patches per image still come from --naflex-seq-lens"))


@dataclass
class TrainConfig(ObjectiveFlags, RunSettings):
    """One run; each field a setting (`naflexclip.settings`): its flag, help, OpenCLIP's default and resume rule
    declared with it, its default the built-in dataset's. `batch_size` is the reference batch size B_ref of the
    window scale (`--batch-size`); the rows of each microbatch come from the token budget
    (`--naflex-max-tokens-per-batch`). Its fields: the run's (`RunSettings`), then the registered objectives'
    (`naflexclip.objectives.registry.ObjectiveFlags`)."""

    def __post_init__(self) -> None:
        # the checks that are not about objectives are in `train.config.config_checks`; the order is the errors' order
        self._from_run = config_checks.check_run_checkpoint(self, DEFAULT_MODEL)
        if self.model is None:
            self.model = DEFAULT_MODEL
        config_checks.check_choices(self)
        config_checks.check_counts(self)
        config_checks.check_scale(self)
        config_checks.check_pretrained(self, self._from_run)
        config_checks.check_loss(self, self._from_run)
        Locks.pick(self)  # one-line errors for lock flags that cannot go together
        objectives_of(self)  # each objective's checks, in the registry's order
        config_checks.check_zeroshot(self)
        config_checks.check_optimizer(self)
        config_checks.check_run_flags(self)
        check_dist_url(self.dist_url)
        check_backend(self.dist_backend)
        config_checks.check_model_overrides(self)

    def default_name(self) -> str:
        """OpenCLIP-style run name, when and what; for a run without `--name`, decided on rank 0 only (the ranks
        of a job start in different seconds)."""
        from_family = self.pretrained and not self.named_family and not self._from_run
        model = family_of(self.pretrained).NAME if from_family else self.model
        return f"{time.strftime('%Y_%m_%d-%H_%M_%S')}-model_{model}-lr_{self.lr:g}-p_{self.precision}"

    @property
    def named_family(self) -> Any:
        """The family of an OpenCLIP-style --model name (`naflexclip.families.openclip`), None for a preset."""
        return None if self.model in PRESETS else named_family(self.model)

    def model_overrides(self, patch_size: int) -> dict[str, Any]:
        """The model fields the flags set (`patch_size`: the image tower's): timm's patch interpolator with
        --naflex-patch-sizes other than the model's own, and for the --force-* flags the text context length,
        the patch dropout rate, and for --force-image-size the position table's grid (size // patch per side;
        NaFlex images still take --naflex-seq-lens patches, the table is resized to each image's grid)."""
        overrides: dict[str, Any] = {}
        if self.data.patch_sizes(patch_size) is not None:  # timm's patch interpolator: no weights of its own
            overrides["patch_interpolator"] = True
        if self.force_context_length is not None:
            overrides["context_length"] = self.force_context_length
        if self.force_patch_dropout is not None:
            overrides["patch_drop_rate"] = self.force_patch_dropout
        if self.force_image_size is not None:
            height, width = (self.force_image_size * 2)[:2]
            overrides["pos_embed_grid_size"] = (max(1, height // patch_size), max(1, width // patch_size))
        return overrides

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (saved with every checkpoint and at the top of the logs)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Inverse of `to_dict`; unknown keys are an error so a stale checkpoint config is noticed."""
        values = dict(values)
        data = DataConfig(**values.pop("data", {}))
        return cls(data=data, **values)


# the declarations as tables: every setting by key (data fields as `data.<name>`), top-level ones first
SETTINGS = dict(sorted(settings_of(TrainConfig).items(), key=lambda item: item[0].startswith("data.")))
# open_clip_train/params.py's defaults (and get_default_params' for a ViT) of every flag naflexclip shares with it;
# the CLI defaults to them with --train-data, the run's first lines name the settings that differ from them
OPENCLIP_DEFAULTS: dict[str, Any] = {key: d.openclip for key, d in SETTINGS.items() if d.openclip is not NOT_OPENCLIP}
# the built-in dataset's own values where they differ from OpenCLIP's (the demo: docs/demo.md)
DEMO_DEFAULTS: dict[str, Any] = {key: d.default for key, d in SETTINGS.items() if switches_with_data(d)}
# config keys whose flag is not `--` + the field's name (an `--aug-cfg` item ends in `=`: its value follows it)
FLAG_NAMES: dict[str, str] = {key: d.flag for key, d in SETTINGS.items()
                              if d.flag != "--" + d.name.replace("_", "-")}


def flag_name(key: str) -> str:
    """The flag of a config key (`data.naflex_seq_lens` -> `--naflex-seq-lens`, `data.aug_scale` ->
    `--aug-cfg scale=`)."""
    return FLAG_NAMES.get(key) or "--" + key.rsplit(".", 1)[-1].replace("_", "-")

