"""DataConfig: the typed data-pipeline config, each field declared once as a setting with its OpenCLIP-named flag
(`naflexclip.settings`), and the data flags generated from it (`add_data_args`, `data_config_from_args`).

Defaults are the built-in dataset's (the demo's, the command line's without --train-data): sequence lengths
(36, 64, 100) at a token budget of 1024 tokens per microbatch. With --train-data the command line takes OpenCLIP's:
(128, 256, 576, 784, 1024) and 16384 tokens.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from naflexclip.data.samples import JsonCaption
from naflexclip.data.schedule import PatchSizes, TokenBudget, samples_for_image_tokens
from naflexclip.data.shards import MemberKeys
from naflexclip.data.synthetic import SHAPES
from naflexclip.settings import (
    APPLY,
    NO_FLAG,
    REFUSE,
    add_arguments,
    parse_kwargs,
    setting,
    settings_of,
    shown_value,
    values_from_args,
)

DATASET_TYPES = ("synthetic", "webdataset", "csv", "folder", "parquet", "auto")
DEFAULT_IMAGE_KEY = "jpg;png;jpeg;webp"  # OpenCLIP's defaults
DEFAULT_MAX_IMAGE_PIXELS = 25_000_000
# --aug-cfg keys of OpenCLIP's AugmentationCfg: those timm's NaFlex train crop takes, those that change nothing here
AUG_CFG_KEYS = ("scale", "ratio")
AUG_CFG_IMPLIED = ("use_timm", "naflex")

_DATA = "data"
_RECIPES = "WebDataset recipes (OpenCLIP's flags)"
_IMAGE = "image processing overrides"
_ORDER = "the training data or its order"  # what the saved data position means: every epoch's samples and plan
_PATCH = "the patch size of every microbatch"


def split_keys(text: str) -> tuple[str, ...]:
    """OpenCLIP's `;`-separated alternatives (`"jpg;png"`), in priority order, blanks dropped."""
    return tuple(part.strip() for part in text.split(";") if part.strip())


def aug_cfg(args: argparse.Namespace) -> dict[str, Any]:
    """--aug-cfg's items (one line for a key the NaFlex train crop does not take); {} for a command without it."""
    aug = parse_kwargs(getattr(args, "aug_cfg", None), "--aug-cfg")
    for key in aug:
        if key not in AUG_CFG_KEYS + AUG_CFG_IMPLIED:
            raise ValueError(f"--aug-cfg {key}: not applied by naflexclip's NaFlex train crop, which takes "
                             f"{', '.join(AUG_CFG_KEYS)}")
    return aug


@dataclass
class DataConfig:
    """Where the data comes from and how microbatches are sized; each field a setting (`naflexclip.settings`), its
    default the built-in dataset's (the demo's: the `small` preset learns visibly within minutes on 2 CPU cores).

    The `naflex_*` fields are the flags of the token budget (`token_budget()`): sequence lengths, their
    weights, patches per microbatch and the batch-size divisor.
    """

    train_data: str | None = setting(None, rule=REFUSE, why=_ORDER, section=_DATA, metavar="DATA[::DATA...]", help=(
        "training data: shards ('dir/{00000..00031}.tar', also s3://, gs://, hf://, https://), .parquet files, a "
        ".csv/.tsv, or a folder; the built-in synthetic dataset when omitted"))
    val_data: str | None = setting(None, rule=APPLY, section=_DATA, metavar="DATA[::DATA...]",
                                   help="validation data, same forms as --train-data")
    dataset_type: str = setting("auto", rule=REFUSE, why=_ORDER, section=_DATA, openclip="auto",
                                choices=DATASET_TYPES)
    csv_img_key: str = setting("filepath", rule=REFUSE, why=_ORDER, section=_DATA, openclip="filepath")
    csv_caption_key: str = setting("title", rule=REFUSE, why=_ORDER, section=_DATA, openclip="title")
    csv_separator: str = setting("\t", rule=REFUSE, why=_ORDER, section=_DATA, openclip="\t")
    # the built-in images are 48-512 px: 36-100 patches of 16 px keep their shapes legible, and a 1024-token budget
    # (windows of ~20-110 examples at --accum-freq 2) gives ~260 optimizer steps (docs/demo.md)
    naflex_seq_lens: tuple[int, ...] = setting((36, 64, 100), rule=REFUSE, why=_ORDER, section=_DATA,
                                               openclip=(128, 256, 576, 784, 1024))
    naflex_seq_len_probs: tuple[float, ...] | None = setting(None, rule=REFUSE, why=_ORDER, section=_DATA,
                                                             openclip=None)
    naflex_max_tokens_per_batch: int = setting(1024, rule=REFUSE, why=_ORDER, section=_DATA, openclip=16384)
    naflex_batch_divisor: int = setting(1, rule=REFUSE, why=_ORDER, section=_DATA, openclip=8)
    # OpenCLIP's variable patch size: each training microbatch's patch size is drawn from these (weights: the probs);
    # None: the model's own. Evaluation runs at the model's own patch size.
    naflex_patch_sizes: tuple[int, ...] | None = setting(
        None, rule=REFUSE, why=_PATCH, section=_DATA, openclip=None, metavar="P",
        help="patch sizes each training microbatch draws one of (timm's patch interpolator resamples the embedding "
             "to it); evaluation uses the model's own (default: the model's own only)")
    naflex_patch_size_probs: tuple[float, ...] | None = setting(
        None, rule=REFUSE, why=_PATCH, section=_DATA, openclip=None, metavar="W",
        help="weights of --naflex-patch-sizes (normalised; default: uniform)")
    workers: int = setting(2, rule=APPLY, section=_DATA, openclip=4, help="DataLoader worker processes per rank",
                           per_rank="a node's CPUs; the samples and their order are the same for any number")
    seed: int = setting(0, rule=REFUSE, why=_ORDER, flag=NO_FLAG, shown_as="--seed", reads=("seed",),
                        from_args=lambda args: args.seed)  # the command's --seed
    synthetic_seed: int = setting(0, rule=REFUSE, why=_ORDER, section=_DATA,
                                  help="seed of the built-in dataset's content (independent of --seed)")
    synthetic_train_size: int = setting(3072, rule=REFUSE, why=_ORDER, section=_DATA)
    # scenes come in pairs that differ only in their shapes: without these hard negatives colour alone matches
    # nearly every pair in a window and zero-shot shape stays at chance (docs/demo.md)
    synthetic_shape_group_size: int = setting(2, rule=REFUSE, why=_ORDER, section=_DATA, help=(
        "built-in train data in groups of N scenes that differ only in their shapes (hard negatives within a "
        "window; 1-8)"))
    synthetic_val_size: int = setting(256, rule=APPLY, section=_DATA)
    synthetic_multi_caption: bool = setting(False, rule=APPLY, section=_DATA, help=(
        "built-in train scenes with 2-5 captions each (one per epoch; all with --multi-positive)"))
    # several captions per image become several text rows with group ids (train --multi-positive); without it a
    # sample with several captions trains on one of them, drawn per (seed, epoch, sample). Set from --multi-positive:
    # a resume given that flag (or its --no- form) takes it from there, not from the checkpoint
    multi_caption: bool = setting(False, rule=APPLY, flag=NO_FLAG, shown_as="--multi-positive",
                                  reads=("multi_positive",))
    caption_per_line: bool = setting(False, rule=APPLY, section=_DATA, help=(
        "a caption file (a folder's .txt, a shard's --text-key member) holds one caption per non-empty line: "
        "several captions of its image (one per epoch; all with --multi-positive)"))
    train_num_samples: int | None = setting(None, rule=REFUSE, why=_ORDER, section=_DATA, openclip=None, help=(
        "samples per epoch: a fresh random subset of the usable samples each epoch (at most their number); "
        "required for streamed shards (pipe:, compressed tars) without a sizes.json; ignored for a CSV (OpenCLIP's: "
        "an epoch is the whole file)"))
    # OpenCLIP's --naflex-num-train-image-tokens: the epoch sized by image tokens (`samples_for_image_tokens`)
    naflex_num_train_image_tokens: int | None = setting(
        None, rule=REFUSE, why=_ORDER, section=_DATA, openclip=None, metavar="TOKENS",
        help="an epoch of training is the samples whose planned microbatches hold this many image tokens, as "
             "OpenCLIP plans them (instead of --train-num-samples)")
    val_num_samples: int | None = setting(None, rule=APPLY, section=_DATA)
    shuffle_buffer: int = setting(1000, rule=REFUSE, why=_ORDER, section=_DATA, help=(
        "shuffle buffer (samples) of streamed shards; local .tar shards are indexed instead"))
    augment: bool = setting(False, rule=APPLY, section=_DATA, reads=("aug_cfg",),
                            from_args=lambda args: bool(args.augment or getattr(args, "aug_cfg", None)), help=(
        "random resized crop to sequence at train time (timm RandomResizedCropToSequence; area 0.9-1, OpenCLIP's; "
        "--aug-cfg scale= sets it)"))  # OpenCLIP's NaFlex training always crops; --aug-cfg shapes that crop
    # a pretrained model's directory (transformers SigLIP 2) whose family's tokenizer and patching feed the data
    # (set by `train --pretrained`; the caller hands that processing to the loaders); None: ours
    hf_processor: str | None = setting(None, rule=APPLY, flag=NO_FLAG, shown_as="--pretrained")
    shard_index_dir: str | None = setting(None, rule=APPLY, section=_DATA,
                                          per_rank="a cache of offsets: a node's own disk", help=(
        "where shard indexes are cached (default: beside each shard, else ~/.cache/naflexclip)"))
    # the plan of an epoch whose sizes.json under-counts a shard: its surplus trains, or is named (docs/data.md)
    trust_sizes_json: bool = setting(False, rule=REFUSE, why=_ORDER, section=_DATA, help=(
        "plan from sizes.json alone, reading no shard at startup (a first run over 100,000s of shards); a shard "
        "that holds more samples than sizes.json lists then has its surplus named (shard_size_mismatch), not "
        "trained"))
    # shards read in chunks: the chunks make the epoch's order (docs/data.md#the-chunked-order)
    fetch_chunk_size: int = setting(8, rule=REFUSE, why=_ORDER, section=_DATA, metavar="MIB", help=(
        "read training shards (.tar, local or in object storage) in chunks of about this many MiB, "
        "each remote one in one request, and make an epoch's order of them (0: every sample shuffled over the "
        "epoch, read one by one)"))
    fetch_streams: int = setting(64, rule=REFUSE, why=_ORDER, section=_DATA, help=(
        "streams the chunked order deals its chunks to (a rank reads its own when the world size divides this; "
        "each rank holds about this / world size chunks at once)"))
    fetch_memory: int = setting(4096, rule=APPLY, section=_DATA, metavar="MIB", help=(
        "at most this much memory a rank holds chunks of remote shards in, fetched ahead of their use and dropped "
        "at their last (the epoch's start says when the order needs more)"))
    # OpenCLIP's WebDataset recipe flags (docs/data.md, "Data recipes")
    dataset_resampled: bool = setting(False, rule=REFUSE, why=_ORDER, section=_RECIPES, help=(
        "draw shards with replacement (weighted by --train-data-upsampling-factors); an epoch is "
        "--train-num-samples samples (default: the shards' total)"))
    train_data_upsampling_factors: str | None = setting(None, rule=REFUSE, why=_ORDER, section=_RECIPES,
                                                        metavar="FACTOR[::FACTOR...]", help=(
        "one weight per `::`-joined --train-data source, e.g. 1::2: with --dataset-resampled the shard weights; "
        "without it, each source's exact share of every epoch"))
    image_key: str = setting(DEFAULT_IMAGE_KEY, rule=REFUSE, why=_ORDER, section=_RECIPES, help=(
        "tar member suffix of the image (Parquet: its column, then 'image'); ';'-separated alternatives in priority "
        "order"))
    text_key: str = setting("txt", rule=REFUSE, why=_ORDER, section=_RECIPES, help=(
        "tar member suffix of the caption (Parquet: its column, a string or a list of strings, then 'text', "
        "'caption'); ';'-separated alternatives (ignored with --json-text-key)"))
    json_text_key: str | None = setting(None, rule=REFUSE, why=_ORDER, section=_RECIPES, help=(
        "read the caption from this field of each sample's .json member; ';'-separated alternatives: the first "
        "non-empty one, or one drawn per sample and epoch by --json-text-key-probs"))
    # which caption of the .json a sample trains on (applied: the order of the samples stays)
    json_text_key_probs: tuple[float, ...] | None = setting(None, rule=APPLY, section=_RECIPES, help=(
        "weights of the --json-text-key fields (missing ones 0: fallback only)"))
    max_image_pixels: int = setting(DEFAULT_MAX_IMAGE_PIXELS, rule=APPLY, section=_RECIPES, help=(
        "skip images with more pixels than this, read from the header before decoding (0: PIL's own limit only)"))
    # ---- OpenCLIP's image processing overrides (`train` only; applied by `families.data_processing`)
    image_mean: tuple[float, ...] | None = setting(
        None, rule=APPLY, section=_IMAGE, openclip=None, metavar="MEAN",
        help="per-channel mean the patches are normalised with (1 or 3 values; default: the model's own, OpenAI "
             "CLIP's for the presets); train, validation and zero-shot alike")
    image_std: tuple[float, ...] | None = setting(None, rule=APPLY, section=_IMAGE, openclip=None,
                                                  metavar="STD", help="the same for the std")
    # no argparse choices: a bad value is the one line of the checks (OpenCLIP's `random` among them), not a usage
    # block
    image_interpolation: str | None = setting(
        None, rule=APPLY, section=_IMAGE, openclip=None, metavar="{bicubic,bilinear}",
        help="the resize to the patch budget (default: the model's own, bicubic for the presets)")
    # --aug-cfg scale= / ratio=: the train crop's area and aspect ranges (with --augment)
    aug_scale: tuple[float, float] | None = setting(
        None, rule=APPLY, section=_IMAGE, openclip=None, flag="--aug-cfg", dest="aug_cfg", shown_as="--aug-cfg scale=",
        nargs="*", metavar="KEY=VALUE", type=str, flag_default=[],
        from_args=lambda args: aug_cfg(args).get("scale"),
        help="the train crop (timm's RandomResizedCropToSequence; turns --augment on): scale=(lo, hi) of the image's "
             "area, ratio=(lo, hi) of its aspect; use_timm and naflex are accepted (always so here)")
    aug_ratio: tuple[float, float] | None = setting(None, rule=APPLY, openclip=None, flag=NO_FLAG,
                                                    shown_as="--aug-cfg ratio=", reads=("aug_cfg",),
                                                    from_args=lambda args: aug_cfg(args).get("ratio"))

    def image_overrides(self) -> dict[str, Any]:
        """The processing overrides set (`mean`, `std`, `interpolation`, the crop's `scale` and `ratio`), for
        `families.data_processing`."""
        values = {"mean": self.image_mean, "std": self.image_std, "interpolation": self.image_interpolation,
                  "scale": self.aug_scale, "ratio": self.aug_ratio}
        return {key: value for key, value in values.items() if value is not None}

    def _check_image_overrides(self) -> None:
        for flag, key in (("--image-mean", "image_mean"), ("--image-std", "image_std")):
            value = getattr(self, key)
            if value is not None:
                value = tuple(float(v) for v in value)
                value = value * 3 if len(value) == 1 else value  # OpenCLIP: one value for every channel
                if len(value) != 3 or (key == "image_std" and min(value) <= 0):
                    raise ValueError(f"{flag} takes 1 or 3 values{' > 0' if key == 'image_std' else ''}, got "
                                     f"{' '.join(f'{v:g}' for v in getattr(self, key))}")
                setattr(self, key, value)
        for key in ("aug_scale", "aug_ratio"):
            value = getattr(self, key)
            if value is not None:
                value = tuple(float(v) for v in value)
                if len(value) != 2 or not 0 < value[0] <= value[1] or (key == "aug_scale" and value[1] > 1):
                    raise ValueError(f"--aug-cfg {key[4:]}={value!r}: takes (low, high) with 0 < low <= high"
                                     f"{' <= 1' if key == 'aug_scale' else ''}")
                setattr(self, key, value)
        if self.image_interpolation not in (None, "bicubic", "bilinear"):
            raise ValueError(f"--image-interpolation: {self.image_interpolation!r} is not one of "
                             "['bicubic', 'bilinear'] (OpenCLIP's 'random', timm's choice per image, would make "
                             "evaluation differ from run to run)")

    def __post_init__(self) -> None:
        self._check_image_overrides()
        self.naflex_seq_lens = tuple(int(s) for s in self.naflex_seq_lens)
        if self.naflex_seq_len_probs is not None:
            self.naflex_seq_len_probs = tuple(float(p) for p in self.naflex_seq_len_probs)
        if self.dataset_type not in DATASET_TYPES:
            raise ValueError(f"--dataset-type must be one of {DATASET_TYPES}, got {self.dataset_type!r}")
        if self.dataset_type not in ("synthetic", "auto") and not self.train_data and not self.val_data:
            raise ValueError(f"--dataset-type {self.dataset_type} needs --train-data or --val-data, got neither")
        self.token_budget()  # the --naflex-* flags, checked where they are used
        self._check_patch_sizes()
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        for name in ("synthetic_train_size", "synthetic_val_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.synthetic_shape_group_size <= len(SHAPES):  # a group has one member per shape at most
            raise ValueError(f"--synthetic-shape-group-size must be in [1, {len(SHAPES)}], "
                             f"got {self.synthetic_shape_group_size}")
        for name in ("train_num_samples", "val_num_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        tokens = self.naflex_num_train_image_tokens
        if tokens is not None:
            if tokens < 1:
                raise ValueError(f"--naflex-num-train-image-tokens must be >= 1, got {tokens}")
            if self.train_num_samples is not None:  # OpenCLIP: "Specify only one of"
                raise ValueError(f"--naflex-num-train-image-tokens {tokens}: sizes the epoch by image tokens; drop "
                                 f"--train-num-samples {self.train_num_samples} (OpenCLIP takes one of them)")
        if not self.csv_separator:
            raise ValueError("--csv-separator must not be empty")
        if self.fetch_chunk_size < 0:
            raise ValueError(f"--fetch-chunk-size must be >= 0 (MiB; 0: no chunks), got {self.fetch_chunk_size}")
        if self.fetch_chunk_size and self.fetch_memory < self.fetch_chunk_size:
            raise ValueError(f"--fetch-memory {self.fetch_memory} MiB holds less than one chunk of --fetch-chunk-size "
                             f"{self.fetch_chunk_size} MiB: raise it or lower --fetch-chunk-size")
        if self.fetch_streams < 1:
            raise ValueError(f"--fetch-streams must be >= 1, got {self.fetch_streams}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"--shuffle-buffer must be >= 0, got {self.shuffle_buffer}")
        self._check_recipe()

    def _check_recipe(self) -> None:
        """The WebDataset recipe flags: member keys, caption probabilities, mixtures and resampling."""
        if self.json_text_key_probs is not None:
            self.json_text_key_probs = tuple(float(p) for p in self.json_text_key_probs)
        for flag, value in (("--image-key", self.image_key), ("--text-key", self.text_key),
                            ("--json-text-key", self.json_text_key)):
            if value is not None and not split_keys(value):
                raise ValueError(f"{flag} needs at least one name (';'-separated alternatives), got {value!r}")
        if self.json_text_key_probs is not None:
            if self.json_text_key is None:
                raise ValueError("--json-text-key-probs goes with --json-text-key (the caption fields it weights)")
            keys = split_keys(self.json_text_key)
            probs = self.json_text_key_probs
            if len(probs) > len(keys):
                raise ValueError(f"--json-text-key-probs has {len(probs)} weights for the {len(keys)} keys of "
                                 f"--json-text-key {self.json_text_key!r}")
            if any(p < 0 or not math.isfinite(p) for p in probs):
                raise ValueError(f"--json-text-key-probs must be finite and >= 0, got {list(probs)}")
        if self.caption_per_line and self.json_text_key is not None:
            raise ValueError("--caption-per-line reads caption files (.txt); with --json-text-key captions come from "
                             "the .json (a list field is several captions already): drop one of them")
        if self.max_image_pixels < 0:
            raise ValueError(f"--max-image-pixels must be >= 0 (0: no limit), got {self.max_image_pixels}")
        recipe = [flag for flag, on in (("--dataset-resampled", self.dataset_resampled),
                                        ("--train-data-upsampling-factors",
                                         self.train_data_upsampling_factors is not None)) if on]
        if recipe and (self.train_data is None or self.source("train")[0] not in ("webdataset", "parquet")):
            raise ValueError(f"{recipe[0]} applies to WebDataset or Parquet --train-data, got "
                             f"{self.train_data or 'the built-in dataset'!r}")
        if self.train_data_upsampling_factors is not None:
            self.upsampling_factors()

    def upsampling_factors(self) -> tuple[float, ...] | None:
        """One weight per `::`-joined source of --train-data (--train-data-upsampling-factors), or None."""
        if self.train_data_upsampling_factors is None:
            return None
        text = str(self.train_data_upsampling_factors)
        sources = (self.train_data or "").split("::")
        try:
            factors = tuple(float(f) for f in text.split("::"))
        except ValueError:
            raise ValueError(f"--train-data-upsampling-factors {text!r}: each `::`-separated factor must be a "
                             "number") from None
        if len(factors) != len(sources):
            raise ValueError(f"--train-data-upsampling-factors {text!r} has {len(factors)} factors for the "
                             f"{len(sources)} `::`-joined sources of --train-data")
        if any(f < 0 or not math.isfinite(f) for f in factors) or not sum(factors) > 0:
            raise ValueError(f"--train-data-upsampling-factors {text!r}: factors must be finite, >= 0, "
                             "and not all 0")
        return factors

    def _check_patch_sizes(self) -> None:
        if self.naflex_patch_sizes is not None:
            self.naflex_patch_sizes = tuple(self.naflex_patch_sizes)
        if self.naflex_patch_size_probs is not None:
            self.naflex_patch_size_probs = tuple(float(p) for p in self.naflex_patch_size_probs)
            if self.naflex_patch_sizes is None:
                raise ValueError("--naflex-patch-size-probs goes with --naflex-patch-sizes (the sizes it weights)")
        if self.naflex_patch_sizes is not None:
            PatchSizes(self.naflex_patch_sizes, self.naflex_patch_size_probs)

    def patch_sizes(self, model_patch_size: int) -> PatchSizes | None:
        """The training microbatches' patch sizes (--naflex-patch-sizes), or None when every one is the model's
        own (`model_patch_size`)."""
        if self.naflex_patch_sizes is None or self.naflex_patch_sizes == (model_patch_size,):
            return None
        return PatchSizes(self.naflex_patch_sizes, self.naflex_patch_size_probs)

    def member_keys(self) -> MemberKeys:
        """Which tar members are a sample's image and caption (--image-key, --text-key, --json-text-key)."""
        return MemberKeys(split_keys(self.image_key), split_keys(self.text_key), self.json_text_key is not None)

    def json_caption(self) -> JsonCaption | None:
        """The caption rule of --json-text-key / --json-text-key-probs, or None (captions are text members)."""
        if self.json_text_key is None:
            return None
        return JsonCaption(split_keys(self.json_text_key), self.json_text_key_probs)

    def train_samples_requested(self) -> tuple[int | None, str]:
        """The samples an epoch of the train split is asked to hold, and the flag that asks (None: the data's own):
        --train-num-samples, or the samples --naflex-num-train-image-tokens' token budget plans."""
        tokens = self.naflex_num_train_image_tokens
        if tokens is None:
            return self.train_num_samples, "--train-num-samples"
        return samples_for_image_tokens(tokens, self.token_budget(), seed=self.seed), "--naflex-num-train-image-tokens"

    def token_budget(self) -> TokenBudget:
        """How microbatches are sized: the `--naflex-*` flags as one `TokenBudget`."""
        return TokenBudget(self.naflex_seq_lens, self.naflex_max_tokens_per_batch, self.naflex_seq_len_probs,
                           self.naflex_batch_divisor)

    def unused_settings(self) -> list[str]:
        """A line for each setting given where it changes nothing: a CSV setting other than its default while no
        split reads a CSV, --val-num-samples without a validation split."""
        declared = settings_of(DataConfig)
        lines = []
        if not any(source is not None and source[0] == "csv" for source in map(self.source, ("train", "val"))):
            lines += [f"{declared[key].flag} {shown_value(value)}: changes nothing, neither --train-data nor "
                      "--val-data is a CSV" for key in ("csv_img_key", "csv_caption_key", "csv_separator")
                      if (value := getattr(self, key)) != declared[key].default]
        if self.val_num_samples is not None and self.source("val") is None:
            lines.append(f"{declared['val_num_samples'].flag} {self.val_num_samples}: changes nothing without "
                         "--val-data")
        return lines

    def source(self, split: str) -> tuple[str, str | None] | None:
        """(dataset type, path) that feeds `split` ("train" or "val"), or None when the split has no data.

        No --train-data and no --val-data (or --dataset-type synthetic) means the built-in dataset for
        both splits; otherwise a split without its own path has no data.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if self.dataset_type == "synthetic" or (self.train_data is None and self.val_data is None):
            return ("synthetic", None)
        path = self.train_data if split == "train" else self.val_data
        if path is None:
            return None
        inferred = infer_dataset_type(path)
        if self.dataset_type == "auto" or (self.dataset_type == "csv" and inferred in ("webdataset", "parquet")):
            # a CSV --train-data beside shards or Parquet named as such: each read as what it is, as
            # --dataset-type parquet reads the shards of a mixture
            return (inferred, path)
        return (self.dataset_type, path)


def infer_dataset_type(path: str | None) -> str:
    """Guess the dataset type from a path: .tar shards, .parquet files, .csv/.tsv tables, else a folder."""
    if not path:
        return "synthetic"
    first = path.split("::")[0]
    if first.endswith((".parquet", ".parq")):
        return "parquet"
    if first.endswith(".tar") or ".tar" in first.rsplit("/", 1)[-1]:
        return "webdataset"
    if first.endswith((".csv", ".tsv")):
        return "csv"
    return "folder"


# verify's window sizes (its own defaults, older than the demo's)
VERIFY_DATA_DEFAULTS: dict[str, Any] = {"naflex_seq_lens": (64, 128, 256), "naflex_max_tokens_per_batch": 4096,
                                        "synthetic_train_size": 4096, "synthetic_val_size": 512,
                                        "synthetic_shape_group_size": 1}


def add_data_args(parser: argparse.ArgumentParser, *, defaults: dict[str, Any] | None = None,
                  image_overrides: bool = False, openclip_with_data: bool = False) -> None:
    """Add the data flags (OpenCLIP names) to `parser` (`add_arguments`; `--seed` belongs to the calling command):
    `defaults` another default per field, `image_overrides` with OpenCLIP's image processing overrides."""
    add_arguments(parser, DataConfig, skip_sections=() if image_overrides else (_IMAGE,), defaults=defaults,
                  openclip_with_data=openclip_with_data)


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    """Build a DataConfig from flags added by `add_data_args` plus the command's `--seed`."""
    return DataConfig(**values_from_args(DataConfig, args))
