"""TrainConfig: the typed, validated configuration of one training run (the CLI maps its flags onto it).

Defaults are the newcomer's first run: the `small` preset on the built-in synthetic dataset, sized to
finish in a few minutes on a 2-core CPU (`DEMO_DEFAULTS`). With `--train-data` the CLI uses OpenCLIP's defaults
instead (`OPENCLIP_DEFAULTS`; both in `train.openclip_defaults`). Every validation error is one line and names
the flag.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from naflexclip.data import DataConfig
from naflexclip.evaluation.zero_shot import (
    IMAGENET_SETS,
    imagenet_set,
    read_classnames,
    read_image_folder,
    read_templates,
)
from naflexclip.families import family_of, named_family
from naflexclip.loss import DEFAULT_TILE_SIZE, LOSSES, MULTI_POSITIVE_WEIGHTINGS
from naflexclip.models.lock import Locks
from naflexclip.models.naflex_clip import PRESETS
from naflexclip.models.precision import PRECISIONS
from naflexclip.models.run_weights import is_run_checkpoint, model_name_conflict, read_run_weights
from naflexclip.objectives.distillation import Distill
from naflexclip.objectives.siglip2_recipe import RECIPE_LOSS, Recipe
from naflexclip.parallel.process_group import check_backend, check_dist_url
from naflexclip.train.report import report_to_names
from naflexclip.window import METHODS, SCALE_MODES

from .openclip_defaults import (  # re-exported: their public import path was this module
    DEMO_DEFAULTS,
    FLAG_NAMES,
    OPENCLIP_DEFAULTS,
    flag_name,
    flat_config,
    openclip_differences,
    parse_kwargs,
    shown_setting,
    shown_setting_value,
    shown_value,
)

__all__ = ["DEFAULT_MODEL", "DEMO_DEFAULTS", "FLAG_NAMES", "OPENCLIP_DEFAULTS", "PRECISIONS", "TrainConfig",
           "flag_name", "flat_config", "openclip_differences", "parse_kwargs", "shown_setting", "shown_setting_value",
           "shown_value"]

DEFAULT_MODEL = "small"


def _with_fields_of(*groups: tuple[str, type]) -> Callable[[type], type]:
    """Declares in the decorated class (before `@dataclass` reads it) the fields of each flag group, a dataclass,
    in the group's order right after the class's field named with it: a group's fields are written once, in the
    group, and a config keeps them flat in their place (`to_dict`, the saved run config, is unchanged)."""

    def declare(cls: type) -> type:
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for after, group in groups:
            if after not in annotations:
                raise TypeError(f"{cls.__name__} has no field {after!r} to put {group.__name__}'s fields after")
            items = list(annotations.items())
            position = list(annotations).index(after) + 1
            added = [(f.name, f.type) for f in dataclasses.fields(group)]
            annotations = dict(items[:position] + added + items[position:])
            for f in dataclasses.fields(group):
                default = (field(default_factory=f.default_factory)
                           if f.default_factory is not dataclasses.MISSING else f.default)
                setattr(cls, f.name, default)
        cls.__annotations__ = annotations
        return cls

    return declare


@dataclass
@_with_fields_of(("cache_dir", Locks), ("openclip_built_in", Distill), ("distill_loss_weight", Recipe))
class TrainConfig:
    """One run. `batch_size` is the reference batch size B_ref of the window scale (`--batch-size`);
    the rows of each microbatch come from the token budget (`--naflex-max-tokens-per-batch`)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: str | None = None  # None: `small`, or with --pretrained a naflexclip checkpoint that checkpoint's model
    loss: str | None = None  # a name of LOSSES; None: the model's own (clip for tiny/small/base, siglip for SigLIP 2)
    batch_size: int | None = None
    accum_freq: int = 2
    accum_method: str = "cache"
    loss_tile_size: int = DEFAULT_TILE_SIZE
    naflex_loss_scale: str = "none"
    lr: float = 1e-3
    wd: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    warmup: int = 20
    epochs: int = 3
    precision: str = "fp32"
    grad_clip_norm: float | None = 1.0
    seed: int = 0
    logs: str = "./logs"
    name: str | None = None  # None: `default_name()`, decided when the run starts
    save_frequency: int = 1
    save_every_n_steps: int | None = None
    stop_after_steps: int | None = None
    resume: str | None = None
    resume_fresh: bool = False  # --resume latest on a run with no usable checkpoint: start over, not stop
    report_to: str = ""  # sinks besides metrics.jsonl, comma-separated ("wandb,tensorboard")
    wandb_project_name: str | None = None  # None: $WANDB_PROJECT, else "naflexclip"
    wandb_notes: str = ""
    log_every_n_steps: int = 1  # OpenCLIP's: the console line (the progress bar's figures) every N steps
    log_metric_every_n_steps: int = 1  # OpenCLIP's: the metrics to the sinks (metrics.jsonl, ...) every N steps
    val_frequency: int = 1
    zero_shot_samples: int = 300
    zeroshot_data: str | None = None  # an ImageFolder classified zero-shot during training (`zeroshot/<name>/...`)
    zeroshot_classnames: str | None = None  # its class names file (one line per class folder)
    zeroshot_templates: str | None = None  # its prompt templates file
    zeroshot_frequency: int = 2  # OpenCLIP's: every N epochs (before training and at the end too); 0: never
    imagenet_val: str | None = None  # OpenCLIP's: ImageNet val ImageFolder, zero-shot as `zeroshot/imagenet-val/...`
    imagenet_v2: str | None = None  # OpenCLIP's: ImageNetV2 (imagenetv2_pytorch's layout), `zeroshot/imagenet-v2/...`
    device: str | None = None
    max_skipped_steps: int = 10
    fsdp: bool = False
    grad_checkpointing: bool = False  # recompute block activations in backward (both towers)
    torchcompile: bool = False  # torch.compile the towers' blocks (dynamic shapes)
    dist_timeout: float = 1800.0
    plot: bool = True
    # a transformers SigLIP 2 directory (architecture, weights, tokenizer, patching), or with an OpenCLIP --model
    # name that model's weights: a checkpoint file, a pretrained tag or hf-hub:org/name in a local cache; or a
    # naflexclip checkpoint (a run's checkpoints/ or one step_N/epoch_N in it: its architecture and weights only,
    # `naflexclip.models.run_weights`)
    pretrained: str | None = None
    cache_dir: str | None = None  # OpenCLIP's --cache-dir: where pretrained tags are looked up (besides HF's cache)
    # here: the locked towers' fields (OpenCLIP's flags; `naflexclip.models.lock.Locks`)
    # OpenCLIP's flags given that naflexclip has built in (`--flag [value]`; `openclip_flags.BUILT_IN`)
    openclip_built_in: tuple[str, ...] = ()
    # here: distillation's fields (OpenCLIP's flags; `naflexclip.objectives.distillation.Distill`), then SigLIP 2's
    # recipe's
    # (`naflexclip.objectives.siglip2_recipe.Recipe`)
    # several captions per image as several positives (`naflexclip.loss.MultiPositiveLoss`)
    multi_positive: bool = False
    multi_positive_weighting: str = "symmetric"
    # ---- optimizer and schedule (OpenCLIP's flags, issue 22; `train.optim`) ----
    opt: str = "adamw"  # adamw, nadamw or timm/<name>
    opt_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the optimizer last
    momentum: float | None = None  # timm optimizers only
    wd_exclude: tuple[str, ...] = ()  # parameter-name globs that get no weight decay
    opt_fallback_list: tuple[str, ...] = ()  # globs of parameters a Muon-family timm optimizer's fallback updates
    image_layer_decay: float | None = None  # layer-wise lr decay of the image tower, in (0, 1]
    text_layer_decay: float | None = None
    lr_scheduler: str = "cosine"  # cosine, const, const-cooldown
    epochs_cooldown: int | None = None  # const-cooldown: cool down over the last N epochs
    lr_cooldown_end: float = 0.0
    lr_cooldown_power: float = 1.0
    skip_scheduler: bool = False  # the lr stays --lr (no warmup, no decay)
    # ---- run flags (OpenCLIP's, issue 22) ----
    save_most_recent: bool = False  # epoch_latest after every epoch
    delete_previous_checkpoint: bool = False  # epoch_{N - save_frequency} removed once epoch_N is saved
    remote_sync: str | None = None  # the run folder is backed up to {remote_sync}/{name} (`train.remote_sync`)
    remote_sync_frequency: float = 300.0  # seconds between syncs
    remote_sync_protocol: str = "s3"  # s3 (aws s3 sync) or fsspec
    log_local: bool = False  # each node's local rank 0 writes its messages to out-{rank}.log
    debug: bool = False  # more is logged (the optimizer's groups; naflexclip loggers at DEBUG)
    # launcher (OpenCLIP's flags; the job itself comes from torchrun's, srun's or mpirun's variables)
    dist_url: str | None = None  # torch's init method; None: env://
    dist_backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    no_set_device_rank: bool = False  # --device cuda is the first visible GPU, not cuda:<local rank>
    # ---- model overrides (OpenCLIP's --force-* flags, issue 22; `model_overrides`) ----
    force_context_length: int | None = None  # the text tower's context length (its position table)
    force_patch_dropout: float | None = None  # the image tower's patch dropout rate while training
    force_image_size: tuple[int, ...] | None = None  # NaFlex: the position table's grid, size / patch per side

    def __post_init__(self) -> None:
        self._check_run_checkpoint()
        if self.model is None:
            self.model = DEFAULT_MODEL
        self._check_choices()
        self._check_counts()
        self._check_scale()
        self._check_pretrained()
        self._check_loss()
        Locks.pick(self)  # one-line errors for lock flags that cannot go together
        self._check_multi_positive()
        self._check_patch_sizes()
        self._check_recipe()
        if Distill.pick(self).enabled and self.distill_pretrained is None and self.distill_model in PRESETS:
            raise ValueError(f"--distill-model {self.distill_model} is a preset: give the teacher's weights with "
                             f"--distill-pretrained (a naflexclip checkpoint)")
        if Distill.pick(self).enabled and self.distill_pretrained is None and named_family(self.distill_model):
            raise ValueError(f"--distill-model {self.distill_model} is an OpenCLIP name: give the teacher's weights "
                             f"with --distill-pretrained (a checkpoint file, a tag, hf-hub:org/name)")
        self._check_zeroshot()
        self._check_optimizer()
        self._check_run_flags()
        check_dist_url(self.dist_url)
        check_backend(self.dist_backend)
        self._check_model_overrides()

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

    def _check_choices(self) -> None:
        if self.model not in PRESETS and self.named_family is None:
            raise ValueError(f"--model: unknown model {self.model!r}; choose a preset ({', '.join(sorted(PRESETS))}) "
                             "or an OpenCLIP model name (open_clip.list_models())")
        for flag, value, choices in (
            ("--accum-method", self.accum_method, METHODS),
            ("--naflex-loss-scale", self.naflex_loss_scale, SCALE_MODES),
            ("--precision", self.precision, PRECISIONS),
        ):
            if value not in choices:
                raise ValueError(f"{flag}: {value!r} is not one of {list(choices)}")
        report_to_names(self.report_to)

    def _check_counts(self) -> None:
        for flag, value, minimum in (
            ("--accum-freq", self.accum_freq, 1),
            ("--loss-tile-size", self.loss_tile_size, 1),
            ("--epochs", self.epochs, 1),
            ("--warmup", self.warmup, 0),
            ("--save-frequency", self.save_frequency, 0),
            ("--log-every-n-steps", self.log_every_n_steps, 1),
            ("--log-metric-every-n-steps", self.log_metric_every_n_steps, 1),
            ("--val-frequency", self.val_frequency, 0),
            ("--zero-shot-samples", self.zero_shot_samples, 1),
            ("--zeroshot-frequency", self.zeroshot_frequency, 0),
            ("--max-skipped-steps", self.max_skipped_steps, 1),
        ):
            if value < minimum:
                raise ValueError(f"{flag} must be >= {minimum}, got {value}")
        for flag, optional in (
            ("--save-every-n-steps", self.save_every_n_steps),
            ("--stop-after-steps", self.stop_after_steps),
            ("--batch-size", self.batch_size),
        ):
            if optional is not None and optional < 1:
                raise ValueError(f"{flag} must be >= 1, got {optional}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.wd < 0:
            raise ValueError(f"--wd must be >= 0, got {self.wd}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ValueError(f"--grad-clip-norm must be > 0, got {self.grad_clip_norm}")
        if self.resume_fresh and self.resume != "latest":
            raise ValueError(f"--resume-fresh goes with --resume latest, got --resume {self.resume}")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")

    def _check_scale(self) -> None:
        if self.naflex_loss_scale != "none" and self.batch_size is None:
            raise ValueError(
                f"--naflex-loss-scale {self.naflex_loss_scale} needs --batch-size (the reference batch size B_ref)"
            )

    def _check_run_checkpoint(self) -> None:
        """--pretrained a naflexclip checkpoint: the model, loss and data processing of the run that wrote it
        (resolved to the one checkpoint directory read, so that a resume reads the same); --model and --loss
        that name another architecture are refused in one line."""
        self._from_run = self.pretrained is not None and is_run_checkpoint(self.pretrained)
        if not self._from_run:
            return
        try:
            found = read_run_weights(str(self.pretrained))
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"--pretrained: {str(error).splitlines()[0]}") from None
        conflict = model_name_conflict(self.model, found)
        if conflict is not None:
            raise ValueError(conflict)
        self.model = self.model or found.model_name or DEFAULT_MODEL
        if self.loss is not None and self.loss != found.config.loss:
            raise ValueError(f"--loss {self.loss}: the --pretrained checkpoint {str(found.path)!r} is a model trained "
                             f"with --loss {found.config.loss}; drop --loss")
        self.loss = found.config.loss
        self.pretrained = str(found.path.resolve())
        if self.data.hf_processor is None:  # the tokenizer and patching the checkpoint's model was trained with
            self.data.hf_processor = found.run_config.get("data", {}).get("hf_processor")

    def _check_pretrained(self) -> None:
        if self._from_run:
            return  # the checkpoint's model, weights and processing (`_check_run_checkpoint`)
        family = self.named_family
        if family is not None:  # an OpenCLIP name: its architecture, its weights from --pretrained, its tokenizer
            try:
                family.model_config(self.model)
                if self.pretrained is not None:  # the file, found and read now (absolute: a resume finds it)
                    self.pretrained = str(family.check_pretrained(self.model, self.pretrained, self.cache_dir))
                tokenizer = family.tokenizer_dir(self.model, self.pretrained, self.cache_dir)
            except ValueError as error:
                message = str(error)
                raise ValueError(message if message.startswith("--") else f"--pretrained: {message}") from None
            if self.data.hf_processor is None:
                self.data.hf_processor = family.processor_spec(self.model, tokenizer)
            return
        if self.pretrained is None:
            return
        try:
            family_of(self.pretrained).check(self.pretrained)
        except ValueError as error:
            raise ValueError(f"--pretrained: {error}") from None
        self.pretrained = str(Path(self.pretrained).resolve())
        if self.data.hf_processor is None:  # its own tokenizer and patching feed it
            self.data.hf_processor = self.pretrained

    def _check_loss(self) -> None:
        if self._from_run:
            return  # the checkpoint's (`_check_run_checkpoint`)
        if self.named_family is not None:
            own = self.named_family.model_config(self.model).loss
        else:
            own = family_of(self.pretrained).LOSS if self.pretrained else PRESETS[self.model].loss
        if self.loss is None:
            # --recipe siglip2 from scratch trains the sigmoid loss; pretrained weights keep their own
            self.loss = own if self.pretrained else RECIPE_LOSS.get(self.recipe or "", own)
        elif self.loss not in LOSSES:
            raise ValueError(f"--loss: {self.loss!r} is not one of {sorted(LOSSES)}")
        elif self.pretrained and self.loss != own:
            # SigLIP (2) is a sigmoid-loss model: its logit_bias only trains under that loss; CLIP weights have none
            raise ValueError(f"--loss {self.loss}: the --pretrained model is trained with --loss {own}; drop --loss")

    def _check_multi_positive(self) -> None:
        if self.multi_positive_weighting not in MULTI_POSITIVE_WEIGHTINGS:
            raise ValueError(f"--multi-positive-weighting: {self.multi_positive_weighting!r} is not one of "
                             f"{sorted(MULTI_POSITIVE_WEIGHTINGS)}")
        if self.multi_positive:  # every caption of a sample becomes a text row with its group id
            self.data.multi_caption = True

    def _check_patch_sizes(self) -> None:
        """--naflex-patch-sizes feeds the model `[B, N, P, P, 3]` patches of each microbatch's own size."""
        if self.data.naflex_patch_sizes is None:
            return
        sizes = " ".join(map(str, self.data.naflex_patch_sizes))
        for flag in ("self_distill_loss_weight", "masked_prediction_loss_weight"):
            if (getattr(self, flag) or 0) > 0:
                raise ValueError(f"--naflex-patch-sizes {sizes} with --{flag.replace('_', '-')}: the masked tokens "
                                 f"need flattened patches of the model's own size; drop one of them")

    def _check_recipe(self) -> None:
        """A LocCa term trains the decoder on the image tower's tokens, one example per image (`data.regions`)."""
        recipe, _ = Recipe.pick(self).for_locked_image(Locks.pick(self).image_fully_locked)
        if recipe.self_distill_enabled:
            what = "self-distillation or masked prediction (--recipe siglip2 / their weights > 0)"
            for flag, given in (("--distill-model", self.distill_model is not None),
                                ("--multi-positive", self.multi_positive)):
                if given:
                    raise ValueError(f"{flag} with {what} is not supported yet")
            if recipe.value("masked_prediction_loss_weight") > 0 and (self.force_patch_dropout or 0) > 0:
                raise ValueError(f"--force-patch-dropout {self.force_patch_dropout:g} with masked prediction "
                                 f"(--recipe siglip2 / --masked-prediction-loss-weight > 0): patch dropout drops "
                                 f"tokens of the masked pass, whose targets are per patch; drop one of them")
        if not recipe.example_terms():
            return
        what = "a LocCa term (--recipe siglip2 / --locca-loss-weight > 0)"
        if self.lock_image and self.lock_image_unlocked_groups == 0:
            raise ValueError(f"--lock-image with {what}: the decoder's loss trains the image tower; unlock some "
                             f"groups (--lock-image-unlocked-groups) or drop --lock-image")
        for flag, given in (("--distill-model", self.distill_model is not None),
                            ("--multi-positive", self.multi_positive), ("--augment", self.data.augment)):
            if given:
                raise ValueError(f"{flag} with {what} is not supported yet")

    def _check_zeroshot(self) -> None:
        """The ImageFolder, class names and templates of --zeroshot-data, read before the run starts."""
        for key in IMAGENET_SETS:  # --imagenet-val / --imagenet-v2: 1000 class folders in OpenCLIP's layout
            if getattr(self, key) is not None:
                imagenet_set(getattr(self, key), key)
                setattr(self, key, os.path.abspath(getattr(self, key)))
        if self.zeroshot_data is None:
            for flag, value in (("--zeroshot-classnames", self.zeroshot_classnames),
                                ("--zeroshot-templates", self.zeroshot_templates)):
                if value is not None:
                    raise ValueError(f"{flag} goes with --zeroshot-data (the ImageFolder to classify)")
            return
        folder = read_image_folder(self.zeroshot_data, flag="--zeroshot-data")
        if self.zeroshot_classnames is not None:
            read_classnames(self.zeroshot_classnames, folder.folders, flag="--zeroshot-classnames")
        if self.zeroshot_templates is not None:
            read_templates(self.zeroshot_templates, flag="--zeroshot-templates")
        # absolute, so that a resume from another folder finds them; the metric names keep the folder's name
        for key in ("zeroshot_data", "zeroshot_classnames", "zeroshot_templates"):
            if getattr(self, key) is not None:
                setattr(self, key, os.path.abspath(getattr(self, key)))

    def _check_optimizer(self) -> None:
        """The optimizer and schedule flags (issue 22), one line naming the flag."""
        from naflexclip.train.optim import SCHEDULERS, check_optimizer_name

        check_optimizer_name(self.opt)
        if self.lr_scheduler not in SCHEDULERS:
            raise ValueError(f"--lr-scheduler: {self.lr_scheduler!r} is not one of {list(SCHEDULERS)}")
        if self.lr_scheduler == "const-cooldown":
            if self.epochs_cooldown is None or not 1 <= self.epochs_cooldown <= self.epochs:
                raise ValueError(f"--lr-scheduler const-cooldown needs --epochs-cooldown N with 1 <= N <= --epochs "
                                 f"{self.epochs}, got {self.epochs_cooldown}")
        elif self.epochs_cooldown is not None:
            raise ValueError(f"--epochs-cooldown goes with --lr-scheduler const-cooldown, not {self.lr_scheduler}")
        if self.momentum is not None and not self.opt.startswith("timm/"):
            raise ValueError(f"--momentum goes with a timm optimizer (--opt timm/sgd, ...), not --opt {self.opt}")
        for flag, decay in (("--image-layer-decay", self.image_layer_decay),
                            ("--text-layer-decay", self.text_layer_decay)):
            if decay is not None and not 0.0 < decay <= 1.0:
                raise ValueError(f"{flag} must be in (0, 1], got {decay}")
        if self.lr_cooldown_power <= 0:
            raise ValueError(f"--lr-cooldown-power must be > 0, got {self.lr_cooldown_power}")
        self.opt_kwargs = dict(self.opt_kwargs)
        self.wd_exclude = tuple(self.wd_exclude)
        self.opt_fallback_list = tuple(self.opt_fallback_list)
        if self.opt_fallback_list and not self.opt.startswith("timm/"):
            raise ValueError(f"--opt-fallback-list goes with a Muon-family timm optimizer (timm/muon, timm/adamuon, "
                             f"timm/nadamuon), not --opt {self.opt}")

    def _check_run_flags(self) -> None:
        """The run flags (issue 22), one line naming the flag."""
        from naflexclip.train.remote_sync import PROTOCOLS

        if self.remote_sync_protocol not in PROTOCOLS:
            raise ValueError(f"--remote-sync-protocol: {self.remote_sync_protocol!r} is not one of {list(PROTOCOLS)}")
        if not self.remote_sync_frequency > 0:
            raise ValueError(f"--remote-sync-frequency must be > 0 seconds, got {self.remote_sync_frequency:g}")

    def _check_model_overrides(self) -> None:
        """OpenCLIP's --force-* flags (issue 22), one line naming the flag."""
        if self.force_image_size is not None:
            self.force_image_size = tuple(int(v) for v in self.force_image_size)
            if len(self.force_image_size) not in (1, 2) or min(self.force_image_size) < 1:
                raise ValueError(f"--force-image-size takes one size or height and width >= 1, got "
                                 f"{' '.join(map(str, self.force_image_size))}")
        if self.force_context_length is not None and self.force_context_length < 2:
            raise ValueError(f"--force-context-length must be >= 2, got {self.force_context_length}")
        if self.force_patch_dropout is not None and not 0.0 <= self.force_patch_dropout < 1.0:
            raise ValueError(f"--force-patch-dropout must be in [0, 1), got {self.force_patch_dropout}")
        for flag, value in (("--force-context-length", self.force_context_length),
                            ("--force-image-size", self.force_image_size)):
            if value is not None and self.pretrained:  # the checkpoint's position tables are fixed
                raise ValueError(f"{flag} changes a position table, which --pretrained brings; drop one of them")

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
