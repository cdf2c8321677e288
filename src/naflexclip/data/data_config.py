"""DataConfig: the typed data-pipeline config and the OpenCLIP-named flags that fill it.

Defaults are sized for a CPU demo: sequence lengths (64, 128, 256) at a token budget of
4096 tokens per microbatch give microbatches of 64, 32 and 16 rows. Real runs use OpenCLIP's
(128, 256, 576, 784, 1024) and a budget of 16k-64k tokens.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from naflexclip.data.readers import MemberKeys
from naflexclip.data.samples import JsonCaption
from naflexclip.data.schedule import PatchSizes, TokenBudget, samples_for_image_tokens
from naflexclip.data.synthetic import SHAPES

DATASET_TYPES = ("synthetic", "webdataset", "csv", "folder", "auto")
DEFAULT_SEQ_LENS = (64, 128, 256)
DEFAULT_IMAGE_KEY = "jpg;png;jpeg;webp"  # OpenCLIP's defaults
DEFAULT_MAX_IMAGE_PIXELS = 25_000_000


def split_keys(text: str) -> tuple[str, ...]:
    """OpenCLIP's `;`-separated alternatives (`"jpg;png"`), in priority order, blanks dropped."""
    return tuple(part.strip() for part in text.split(";") if part.strip())


@dataclass
class DataConfig:
    """Where the data comes from and how microbatches are sized.

    The `naflex_*` fields are the flags of the token budget (`token_budget()`): sequence lengths, their
    weights, patches per microbatch and the batch-size divisor.
    """

    train_data: str | None = None
    val_data: str | None = None
    dataset_type: str = "auto"
    csv_img_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = "\t"
    naflex_seq_lens: tuple[int, ...] = DEFAULT_SEQ_LENS
    naflex_seq_len_probs: tuple[float, ...] | None = None
    naflex_max_tokens_per_batch: int = 4096
    naflex_batch_divisor: int = 1
    # OpenCLIP's variable patch size: each training microbatch's patch size is drawn from these (weights: the probs);
    # None: the model's own. Evaluation runs at the model's own patch size.
    naflex_patch_sizes: tuple[int, ...] | None = None
    naflex_patch_size_probs: tuple[float, ...] | None = None
    workers: int = 2
    seed: int = 0
    synthetic_seed: int = 0
    synthetic_train_size: int = 4096
    synthetic_shape_group_size: int = 1
    synthetic_val_size: int = 512
    synthetic_multi_caption: bool = False  # built-in train scenes with 2-5 captions each
    # several captions per image become several text rows with group ids (train --multi-positive); without it a
    # sample with several captions trains on one of them, drawn per (seed, epoch, sample)
    multi_caption: bool = False
    # a caption file (a folder's .txt, a shard's text member) holds one caption per non-empty line
    caption_per_line: bool = False
    train_num_samples: int | None = None
    # OpenCLIP's --naflex-num-train-image-tokens: the epoch sized by image tokens (`samples_for_image_tokens`)
    naflex_num_train_image_tokens: int | None = None
    val_num_samples: int | None = None
    shuffle_buffer: int = 1000
    augment: bool = False
    # a pretrained model's directory (transformers SigLIP 2) whose family's tokenizer and patching feed the data
    # (set by `train --pretrained`; the caller hands that processing to the loaders); None: ours
    hf_processor: str | None = None
    shard_index_dir: str | None = None
    # OpenCLIP's WebDataset recipe flags (docs/data.md, "Data recipes")
    dataset_resampled: bool = False
    train_data_upsampling_factors: str | None = None  # "1::2::0.5", one weight per `::` source of --train-data
    image_key: str = DEFAULT_IMAGE_KEY
    text_key: str = "txt"
    json_text_key: str | None = None
    json_text_key_probs: tuple[float, ...] | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    # ---- OpenCLIP's image processing overrides (issue 22; set by `train`, applied by `families.data_processing`)
    image_mean: tuple[float, ...] | None = None  # per channel (None: the model's own, OpenAI CLIP's for ours)
    image_std: tuple[float, ...] | None = None
    image_interpolation: str | None = None  # bicubic or bilinear (None: the model's own)
    aug_scale: tuple[float, float] | None = None  # --aug-cfg scale=: the train crop's area range (with --augment)
    aug_ratio: tuple[float, float] | None = None  # --aug-cfg ratio=: its aspect range

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
        if self.dataset_type in ("webdataset", "csv", "folder") and not self.train_data and not self.val_data:
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
        if recipe and (self.train_data is None or self.source("train")[0] != "webdataset"):
            raise ValueError(f"{recipe[0]} applies to WebDataset --train-data shards, got "
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
        kind = infer_dataset_type(path) if self.dataset_type == "auto" else self.dataset_type
        return (kind, path)


def infer_dataset_type(path: str | None) -> str:
    """Guess the dataset type from a path: .tar shards, .csv/.tsv tables, else a folder."""
    if not path:
        return "synthetic"
    first = path.split("::")[0]
    if first.endswith(".tar") or ".tar" in first.rsplit("/", 1)[-1]:
        return "webdataset"
    if first.endswith((".csv", ".tsv")):
        return "csv"
    return "folder"


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Add the data flags (OpenCLIP names) to `parser`; `--seed` belongs to the calling command."""
    group = parser.add_argument_group("data")
    group.add_argument("--train-data", default=None,
                       help="training data: shards ('dir/{00000..00031}.tar'), a .csv/.tsv, or a folder; "
                            "the built-in synthetic dataset when omitted")
    group.add_argument("--val-data", default=None, help="validation data, same forms as --train-data")
    group.add_argument("--dataset-type", default="auto", choices=DATASET_TYPES)
    group.add_argument("--csv-img-key", default="filepath")
    group.add_argument("--csv-caption-key", default="title")
    group.add_argument("--csv-separator", default="\t")
    group.add_argument("--naflex-seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS))
    group.add_argument("--naflex-seq-len-probs", type=float, nargs="+", default=None)
    group.add_argument("--naflex-max-tokens-per-batch", type=int, default=4096)
    group.add_argument("--naflex-batch-divisor", type=int, default=1)
    group.add_argument("--naflex-patch-sizes", type=int, nargs="+", default=None, metavar="P",
                       help="patch sizes each training microbatch draws one of (timm's patch interpolator resamples "
                            "the embedding to it); evaluation uses the model's own (default: the model's own only)")
    group.add_argument("--naflex-patch-size-probs", type=float, nargs="+", default=None, metavar="W",
                       help="weights of --naflex-patch-sizes (normalised; default: uniform)")
    group.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    group.add_argument("--train-num-samples", type=int, default=None,
                       help="samples per epoch: a fresh random subset of the usable samples each epoch (at most "
                            "their number); required for streamed shards (pipe:, URLs) without a sizes.json; "
                            "ignored for a CSV (OpenCLIP's: an epoch is the whole file)")
    group.add_argument("--naflex-num-train-image-tokens", type=int, default=None, metavar="TOKENS",
                       help="an epoch of training is the samples whose planned microbatches hold this many image "
                            "tokens, as OpenCLIP plans them (instead of --train-num-samples)")
    group.add_argument("--val-num-samples", type=int, default=None)
    group.add_argument("--shuffle-buffer", type=int, default=1000,
                       help="shuffle buffer (samples) of streamed shards; local .tar shards are indexed instead")
    group.add_argument("--shard-index-dir", default=None,
                       help="where shard indexes are cached (default: beside each shard, else ~/.cache/naflexclip)")
    recipe = parser.add_argument_group("WebDataset recipes (OpenCLIP's flags)")
    recipe.add_argument("--dataset-resampled", action="store_true",
                        help="draw shards with replacement (weighted by --train-data-upsampling-factors); an epoch "
                             "is --train-num-samples samples (default: the shards' total)")
    recipe.add_argument("--train-data-upsampling-factors", default=None,
                        help="one weight per `::`-joined --train-data source, e.g. 1::2: with --dataset-resampled "
                             "the shard weights; without it, each source's exact share of every epoch")
    recipe.add_argument("--image-key", default=DEFAULT_IMAGE_KEY,
                        help="tar member suffix of the image; ';'-separated alternatives in priority order")
    recipe.add_argument("--text-key", default="txt",
                        help="tar member suffix of the caption; ';'-separated alternatives (ignored with "
                             "--json-text-key)")
    recipe.add_argument("--json-text-key", default=None,
                        help="read the caption from this field of each sample's .json member; ';'-separated "
                             "alternatives: the first non-empty one, or one drawn per sample and epoch by "
                             "--json-text-key-probs")
    recipe.add_argument("--json-text-key-probs", type=float, nargs="+", default=None,
                        help="weights of the --json-text-key fields (missing ones 0: fallback only)")
    recipe.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="skip images with more pixels than this, read from the header before decoding "
                             "(0: PIL's own limit only)")
    group.add_argument("--synthetic-train-size", type=int, default=4096)
    group.add_argument("--synthetic-val-size", type=int, default=512)
    group.add_argument("--synthetic-shape-group-size", type=int, default=1,
                       help="built-in train data in groups of N scenes that differ only in their shapes "
                            "(hard negatives within a window; 1-8)")
    group.add_argument("--synthetic-multi-caption", action="store_true",
                       help="built-in train scenes with 2-5 captions each (one per epoch; all with --multi-positive)")
    group.add_argument("--caption-per-line", action="store_true",
                       help="a caption file (a folder's .txt, a shard's --text-key member) holds one caption per "
                            "non-empty line: several captions of its image (one per epoch; all with --multi-positive)")
    group.add_argument("--synthetic-seed", type=int, default=0,
                       help="seed of the built-in dataset's content (independent of --seed)")
    group.add_argument("--augment", action="store_true",
                       help="random resized crop to sequence at train time (timm RandomResizedCropToSequence; area "
                            "0.9-1, OpenCLIP's; --aug-cfg scale= sets it)")


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    """Build a DataConfig from flags added by `add_data_args` plus the command's `--seed`."""
    probs = args.naflex_seq_len_probs
    return DataConfig(
        train_data=args.train_data,
        val_data=args.val_data,
        dataset_type=args.dataset_type,
        csv_img_key=args.csv_img_key,
        csv_caption_key=args.csv_caption_key,
        csv_separator=args.csv_separator,
        naflex_seq_lens=tuple(args.naflex_seq_lens),
        naflex_seq_len_probs=tuple(probs) if probs is not None else None,
        naflex_max_tokens_per_batch=args.naflex_max_tokens_per_batch,
        naflex_batch_divisor=args.naflex_batch_divisor,
        naflex_patch_sizes=tuple(args.naflex_patch_sizes) if args.naflex_patch_sizes is not None else None,
        naflex_patch_size_probs=(tuple(args.naflex_patch_size_probs) if args.naflex_patch_size_probs is not None
                                 else None),
        workers=args.workers,
        seed=args.seed,
        synthetic_seed=args.synthetic_seed,
        synthetic_train_size=args.synthetic_train_size,
        synthetic_shape_group_size=args.synthetic_shape_group_size,
        synthetic_val_size=args.synthetic_val_size,
        synthetic_multi_caption=args.synthetic_multi_caption,
        caption_per_line=args.caption_per_line,
        train_num_samples=args.train_num_samples,
        naflex_num_train_image_tokens=args.naflex_num_train_image_tokens,
        val_num_samples=args.val_num_samples,
        shuffle_buffer=args.shuffle_buffer,
        augment=args.augment,
        shard_index_dir=args.shard_index_dir,
        dataset_resampled=args.dataset_resampled,
        train_data_upsampling_factors=args.train_data_upsampling_factors,
        image_key=args.image_key,
        text_key=args.text_key,
        json_text_key=args.json_text_key,
        json_text_key_probs=tuple(args.json_text_key_probs) if args.json_text_key_probs is not None else None,
        max_image_pixels=args.max_image_pixels,
    )
