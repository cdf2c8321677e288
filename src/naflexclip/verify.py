"""`naflexclip verify`: audit the accumulation window against one full batch, before a long run.

It builds a model (a preset, or a trained checkpoint), takes a window of NaFlex examples (random
sequences of varied lengths, or the first batches of `--train-data`), computes the full-batch reference
`s(W)·∇θ L(W)` in float64, then accumulates the same examples split at random into `--accum-freq`
microbatches with each chosen method, and prints the worst relative error per parameter group against
the tolerances of docs/accumulation.md. For contrast it also runs OpenCLIP's per-microbatch rule on the same splits.
Exit code 0 when every group passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from naflexclip.batch import (
    EXAMPLE_INPUTS,
    GROUP_KEYS,
    TEACHER_INPUTS,
    batch_size,
    concat_microbatches,
    is_grouped,
    split_batch,
    teacher_inputs,
    to_device,
)
from naflexclip.data import DataError, TeacherInputs, add_data_args, build_loader, data_config_from_args
from naflexclip.distill import Distill, add_distill_args
from naflexclip.distributed import DEVICE_CHOICES, check_device
from naflexclip.factory import create_model
from naflexclip.families import data_processing
from naflexclip.legacy import per_microbatch_scale_gradients
from naflexclip.locca import random_decoder_inputs
from naflexclip.lock import Locks, add_lock_args, lock_summary
from naflexclip.loss import DEFAULT_TILE_SIZE, LOSSES, MULTI_POSITIVE_WEIGHTINGS, MultiPositiveLoss, create_loss
from naflexclip.model import PRESETS
from naflexclip.recipe import RECIPE_LOSS, Recipe, add_recipe_args
from naflexclip.train.components import load_checkpoint_model
from naflexclip.window import (
    EXAMPLE_TERMS,
    METHODS,
    SCALE_MODES,
    ExampleTerm,
    accumulate_gradients,
    output_dict,
    window_loss_scale,
)

FLOAT64_TOLERANCE = 1e-10
FLOAT32_TOLERANCE = 1e-4
# timm's NaFlexVit resamples its learned position table in float32 even in a float64 model,
# so that one tensor's gradient agrees only to ~1e-8 (docs/accumulation.md, Tolerances).
POS_EMBED_TOLERANCE = 1e-6


def tolerance_for(param_name: str, dtype: torch.dtype) -> float:
    """The relative tolerance for one parameter's gradient (docs/accumulation.md, Tolerances)."""
    if dtype != torch.float64:
        return FLOAT32_TOLERANCE
    return POS_EMBED_TOLERANCE if "pos_embed" in param_name else FLOAT64_TOLERANCE


def relative_error(grad: torch.Tensor | None, reference: torch.Tensor | None) -> float:
    """‖grad − reference‖ / ‖reference‖ (absolute when the reference is zero; None counts as zero)."""
    if grad is None and reference is None:
        return 0.0
    grad = torch.zeros_like(reference) if grad is None else grad
    reference = torch.zeros_like(grad) if reference is None else reference
    diff = (grad.double() - reference.double()).norm().item()
    ref_norm = reference.double().norm().item()
    return diff / ref_norm if ref_norm > 0 else diff


def parameter_group(name: str) -> str:
    """Report group of a parameter: `visual.blocks`, `visual.embeds.pos_embed`, `text.transformer`, ..."""
    if "pos_embed" in name:
        return "visual.embeds.pos_embed"
    parts = name.split(".")
    return ".".join(parts[:2])


def random_naflex_batch(
    num_examples: int,
    *,
    patch_size: int,
    context_length: int,
    seq_lens: Sequence[int] = (4, 9, 16, 25, 36),
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    vocab_size: int = 49408,
) -> dict[str, Any]:
    """A NaFlex batch of random images with varied grids (each ≤ a length from `seq_lens`) and random
    token ids ending in the end-of-text token, padded to the longest sequence."""
    gen = generator or torch.Generator().manual_seed(0)
    max_len = max(seq_lens)
    dim = patch_size * patch_size * 3
    patches = torch.zeros(num_examples, max_len, dim, dtype=dtype)
    coords = torch.zeros(num_examples, max_len, 2, dtype=torch.long)
    valid = torch.zeros(num_examples, max_len, dtype=torch.bool)
    text = torch.zeros(num_examples, context_length, dtype=torch.long)
    for row in range(num_examples):
        budget = seq_lens[int(torch.randint(len(seq_lens), (1,), generator=gen))]
        # a random aspect ratio whose grid fits the budget, as NaFlex resizing produces
        height = int(torch.randint(1, budget + 1, (1,), generator=gen))
        width = max(1, budget // height)
        length = height * width
        grid = torch.stack(torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij"), -1)
        patches[row, :length] = torch.randn(length, dim, generator=gen, dtype=dtype)
        coords[row, :length] = grid.reshape(length, 2)
        valid[row, :length] = True
        num_tokens = int(torch.randint(2, context_length + 1, (1,), generator=gen))
        text[row, 0] = vocab_size - 2  # start of text
        text[row, 1 : num_tokens - 1] = torch.randint(1, vocab_size - 2, (num_tokens - 2,), generator=gen)
        text[row, num_tokens - 1] = vocab_size - 1  # end of text: open_clip pools at the argmax id
    longest = int(valid.sum(1).max())
    image = {"patches": patches[:, :longest], "patch_coord": coords[:, :longest], "patch_valid": valid[:, :longest]}
    return {"image": image, "text": text}


def random_grouped_batch(num_images: int, *, max_captions: int = 3, generator: torch.Generator | None = None,
                         **kwargs: Any) -> dict[str, Any]:
    """A grouped NaFlex batch: `num_images` random images, each with 1 to `max_captions` random captions (its
    group), the captions in image order; group ids `image_group [N]`, `text_group [M]` (arbitrary integers)."""
    gen = generator or torch.Generator().manual_seed(0)
    captions = torch.randint(1, max_captions + 1, (num_images,), generator=gen)
    images = random_naflex_batch(num_images, generator=gen, **kwargs)
    texts = random_naflex_batch(int(captions.sum()), generator=gen, **kwargs)["text"]
    ids = torch.randperm(10 * num_images, generator=gen)[:num_images]
    return {"image": images["image"], "text": texts, "image_group": ids,
            "text_group": torch.repeat_interleave(ids, captions)}


def random_split_sizes(num_examples: int, num_microbatches: int, rng: random.Random) -> list[int]:
    """Uneven sizes ≥ 1 summing to `num_examples` (a random composition)."""
    if not 1 <= num_microbatches <= num_examples:
        raise ValueError(f"cannot split {num_examples} examples into {num_microbatches} non-empty microbatches")
    cuts = sorted(rng.sample(range(1, num_examples), num_microbatches - 1))
    bounds = [0, *cuts, num_examples]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def full_batch_gradients(
    model: nn.Module, loss_fn: nn.Module, batch: dict[str, Any], scale: float, teacher: nn.Module | None = None,
    example_terms: Sequence[ExampleTerm] = (),
    example_teacher: Any = None,
) -> dict[str, torch.Tensor]:
    """The reference: `scale · ∇θ L` of all rows as one batch, by one explicit backward (with a teacher: L the
    sum of `loss_fn`'s terms, the teacher's features of the whole batch as constants; with per-example terms,
    `+ Σ_k λ_k/Z_k Σ_i ℓ_k(i)`, Z_k the batch's count)."""
    model.zero_grad(set_to_none=True)
    targets = {}
    if example_teacher is not None:  # the EMA teacher's targets of the whole batch, constants
        with torch.no_grad():
            targets = {"teacher_targets": example_teacher(image=batch["image"])}
    out = output_dict(model(image=batch["image"], text=batch["text"],
                            **(batch.get(EXAMPLE_INPUTS, {}) if example_terms else {}), **targets))
    taught: tuple[Any, ...] = ()
    if teacher is not None:
        with torch.no_grad():
            teacher_out = output_dict(teacher.eval()(**teacher_inputs(batch)))
        taught = tuple(teacher_out.get(key) for key in ("image_features", "text_features", "logit_scale",
                                                          "logit_bias"))
    if is_grouped(batch):  # several captions per image: the group ids of the whole batch
        taught += tuple(batch[key] for key in GROUP_KEYS)
    loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"), *taught)
    loss = loss.sum() + sum(term.weight * out[EXAMPLE_TERMS][term.name].sum() / term.count(batch)
                            for term in example_terms)
    (scale * loss).backward()
    return collect_gradients(model)


def collect_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def gradient_errors(
    model: nn.Module, grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Relative error per parameter name."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return {name: relative_error(grads.get(name), reference.get(name)) for name in names}


@dataclass
class GroupResult:
    group: str
    num_params: int
    worst_error: float
    tolerance: float
    legacy_error: float

    @property
    def passed(self) -> bool:
        return self.worst_error <= self.tolerance


@dataclass
class VerifyResult:
    groups: list[GroupResult]
    splits: list[list[int]]
    scale: float
    loss: float

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.groups)


def verify_window(
    model: nn.Module,
    loss_fn: nn.Module,
    batch: dict[str, Any],
    *,
    accum_freq: int,
    reference_batch_size: int | None,
    loss_scale: str,
    methods: Sequence[str],
    num_splits: int,
    seed: int,
    first_split: list[int] | None = None,
    grad_checkpointing: bool = False,
    teacher: nn.Module | None = None,
    example_terms: Sequence[ExampleTerm] = (),
    example_teacher: Any = None,
) -> VerifyResult:
    """Compare accumulated gradients of splits of `batch` (`first_split`, e.g. the loader's own, then
    random ones) with its full-batch reference. `grad_checkpointing`: the windows recompute the towers'
    activations (`model.set_grad_checkpointing`), the reference does not."""
    dtype = next(model.parameters()).dtype
    num_examples = batch_size(batch)
    rng = random.Random(seed)
    splits = [random_split_sizes(num_examples, accum_freq, rng) for _ in range(num_splits)]
    if first_split is not None:
        splits = [list(first_split), *splits[:-1]]
    scale = window_loss_scale(splits[0], reference_batch_size, loss_scale)
    reference = full_batch_gradients(model, loss_fn, concat_microbatches(split_batch(batch, splits[0])), scale,
                                     teacher, example_terms, example_teacher)
    worst: dict[str, float] = {}
    legacy_worst: dict[str, float] = {}
    loss = math.nan
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    for sizes in splits:
        microbatches = split_batch(batch, sizes)
        for method in methods:
            model.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                model, loss_fn, microbatches, loss_scale=loss_scale,
                reference_batch_size=reference_batch_size, method=method, teacher=teacher,
                example_terms=example_terms, example_teacher=example_teacher,
            )
            loss = stats.loss
            for name, err in gradient_errors(model, collect_gradients(model), reference).items():
                worst[name] = max(worst.get(name, 0.0), err)
        model.zero_grad(set_to_none=True)
        per_microbatch_scale_gradients(
            model, loss_fn, microbatches, loss_scale=loss_scale, reference_batch_size=reference_batch_size,
            teacher=teacher, example_terms=example_terms, example_teacher=example_teacher,
        )
        for name, err in gradient_errors(model, collect_gradients(model), reference).items():
            legacy_worst[name] = max(legacy_worst.get(name, 0.0), err)
    if grad_checkpointing:
        model.set_grad_checkpointing(False)
    model.zero_grad(set_to_none=True)
    return VerifyResult(_group_results(worst, legacy_worst, dtype), splits, scale, loss)


def _group_results(worst: dict[str, float], legacy: dict[str, float], dtype: torch.dtype) -> list[GroupResult]:
    groups: dict[str, GroupResult] = {}
    for name, err in worst.items():
        key = parameter_group(name)
        g = groups.setdefault(key, GroupResult(key, 0, 0.0, tolerance_for(name, dtype), 0.0))
        g.num_params += 1
        g.worst_error = max(g.worst_error, err)
        g.legacy_error = max(g.legacy_error, legacy.get(name, 0.0))
    return list(groups.values())


def format_table(result: VerifyResult) -> str:
    header = (
        f"{'parameter group':<28} {'tensors':>7} {'max rel err':>12} {'tolerance':>10} {'':>5}  {'OpenCLIP rule':>13}"
    )
    lines = [header, "-" * len(header)]
    for g in result.groups:
        status = "ok" if g.passed else "FAIL"
        lines.append(
            f"{g.group:<28} {g.num_params:>7} {g.worst_error:>12.2e} {g.tolerance:>10.0e} {status:>5}  "
            f"{g.legacy_error:>13.2e}"
        )
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check that accumulated gradients equal the full-batch gradient",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--model", default="tiny",
                        help=f"model preset, one of {sorted(PRESETS)}, or an OpenCLIP model name (docs/openclip.md)")
    parser.add_argument("--pretrained", default=None,
                        help="with an OpenCLIP --model name: its weights (a checkpoint file, a tag or hf-hub:org/name "
                             "in a local cache)")
    parser.add_argument("--cache-dir", default=None, help="where --pretrained tags are looked up")
    parser.add_argument("--checkpoint", default=None,
                        help="audit a trained model: a checkpoint directory, or a run's checkpoints/ (latest)")
    parser.add_argument("--loss", default=None, choices=sorted(LOSSES),
                        help="clip or siglip (default: the model's own; a checkpoint's is the one it was trained with)")
    parser.add_argument("--siglip", dest="loss", action="store_const", const="siglip", default=argparse.SUPPRESS,
                        help="OpenCLIP's name for --loss siglip")
    parser.add_argument("--accum-freq", type=int, default=None, help="microbatches per window (default 4)")
    parser.add_argument("--batch-size", type=int, default=None, help="reference batch size B_ref (default 4)")
    parser.add_argument("--naflex-loss-scale", default=None, choices=SCALE_MODES, help="default: linear")
    parser.add_argument("--accum-method", default="all", choices=(*METHODS, "all"))
    parser.add_argument("--loss-tile-size", type=int, default=DEFAULT_TILE_SIZE,
                        help="rows/columns of one block of the tiled loss (speed only)")
    parser.add_argument("--splits", type=int, default=3, help="random splits of the window to check")
    parser.add_argument("--num-examples", type=int, default=None,
                        help="random window: examples in it (default: accum-freq × batch-size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--device", default="cpu",
                        help=f"where the model and the window run: {', '.join(DEVICE_CHOICES)}")
    parser.add_argument("--grad-checkpointing", action="store_true",
                        help="accumulate with activation checkpointing in both towers (the reference without)")
    add_lock_args(parser)
    add_distill_args(parser)
    add_recipe_args(parser)
    g = parser.add_argument_group("several captions per image")
    g.add_argument("--multi-positive", action="store_true",
                   help="a random window of images with 1-3 captions each (group ids), under the multi-positive loss "
                        "(clip: multi-positive InfoNCE; siglip: SigLIP+)")
    g.add_argument("--multi-positive-weighting", default="symmetric", choices=sorted(MULTI_POSITIVE_WEIGHTINGS),
                   help="SigLIP+'s positive weights: symmetric (α = β = ½), asymmetric (α = 1, β = 0), soft (labels)")
    # unset lock flags take a --checkpoint's own (see _setup)
    parser.set_defaults(**dict.fromkeys(Locks().as_dict()))
    # a real window: the first --accum-freq batches the loader yields (with --train-data, --checkpoint,
    # or --dataset-type synthetic); its own split is checked first, then random re-splits
    add_data_args(parser)
    parser.set_defaults(func=run)


@dataclass
class VerifySetup:
    model: nn.Module
    loss: str
    accum_freq: int
    reference_batch_size: int | None
    loss_scale: str
    hf_processor: str | None = None  # a pretrained family's tokenizer and patching (SigLIP 2, an OpenCLIP name)
    teacher_inputs: TeacherInputs | None = None  # a teacher's own processing, when it reads other inputs


def _setup(args: argparse.Namespace) -> VerifySetup:
    """Model and window settings: flags first, then the checkpoint's training config, then defaults."""
    trained: dict[str, Any] = {}
    if args.loss is None and args.recipe in RECIPE_LOSS and not (args.checkpoint or args.pretrained):
        args.loss = RECIPE_LOSS[args.recipe]  # --recipe siglip2: a model from scratch trains the sigmoid loss
    if args.checkpoint:
        model, trained = load_checkpoint_model(args.checkpoint)
    else:
        model = create_model(args.model, pretrained=args.pretrained, cache_dir=args.cache_dir,
                             **({} if args.loss is None else {"loss": args.loss}))
    loss = model.config.loss
    if args.loss is not None and args.loss != loss:
        raise ValueError(f"--loss {args.loss}: the checkpoint's model was trained with --loss {loss}")

    def pick(flag_value: Any, key: str, default: Any) -> Any:
        if flag_value is not None:
            return flag_value
        return trained.get(key) if trained.get(key) is not None else default

    Locks(**{key: pick(getattr(args, key), key, default) for key, default in Locks().as_dict().items()}).apply(model)
    processor = trained.get("data", {}).get("hf_processor")
    name = model.config.openclip_name
    # an OpenCLIP name's tokenizer and mean/std: for its data, and for a teacher's to be compared with
    if processor is None and name is not None and (_uses_loader(args) or args.distill_model is not None):
        from naflexclip.families import openclip

        processor = openclip.processor_spec(name, openclip.tokenizer_dir(name, args.pretrained, args.cache_dir))
    setup = VerifySetup(model, loss, pick(args.accum_freq, "accum_freq", 4), pick(args.batch_size, "batch_size", 4),
                        pick(args.naflex_loss_scale, "naflex_loss_scale", "linear"), processor)
    if setup.accum_freq < 1:
        raise ValueError(f"--accum-freq must be ≥ 1, got {setup.accum_freq}")
    if setup.reference_batch_size is not None and setup.reference_batch_size < 1:
        raise ValueError(f"--batch-size must be ≥ 1, got {setup.reference_batch_size}")
    if args.splits < 1:
        raise ValueError(f"--splits must be ≥ 1, got {args.splits}")
    if args.num_examples is not None and args.num_examples < setup.accum_freq:
        raise ValueError(f"--num-examples {args.num_examples} is smaller than --accum-freq {setup.accum_freq}")
    return setup


def _uses_loader(args: argparse.Namespace) -> bool:
    return bool(args.train_data or args.checkpoint or args.dataset_type == "synthetic")


def loader_window(args: argparse.Namespace, setup: VerifySetup) -> tuple[dict[str, Any], list[int]]:
    """The first `accum_freq` microbatches of epoch 0, as one batch, and their sizes."""
    cfg = data_config_from_args(args)
    cfg.hf_processor = setup.hf_processor
    if cfg.patch_sizes(setup.model.image_patch_size) is not None:
        raise ValueError(f"--naflex-patch-sizes {' '.join(map(str, cfg.naflex_patch_sizes or ()))}: verify's "
                         "full-batch reference is one batch of the window's microbatches, so one patch size (mixed "
                         "sizes are exact in the window: tests/test_window_patch_sizes.py)")
    loader = build_loader(cfg, split="train", patch_size=setup.model.image_patch_size,
                          context_length=setup.model.context_length,
                          processing=data_processing(cfg.hf_processor, setup.model.image_patch_size, cfg.augment),
                          teacher=setup.teacher_inputs)
    microbatches = list(itertools.islice(iter(loader), setup.accum_freq))
    if len(microbatches) < setup.accum_freq:
        raise ValueError(f"--accum-freq {setup.accum_freq}: the data yields only {len(microbatches)} batches")
    return concat_microbatches(microbatches), [batch_size(mb) for mb in microbatches]


def run(args: argparse.Namespace) -> int:
    try:
        check_device(args.device)
        device = torch.device(args.device)
        setup = _setup(args)
        loss_fn = create_loss(setup.loss, tile_size=args.loss_tile_size)
        dtype = torch.float64 if args.dtype == "float64" else torch.float32
        distill, teacher = Distill.pick(args), None
        recipe = Recipe.pick(args)
        # the window after --self-distill-start: every term of the recipe on
        example_terms = recipe.example_terms(progress=1.0)
        self_distill = recipe.self_distill_active(1.0)
        if example_terms and (distill.enabled or args.multi_positive or _uses_loader(args)):
            raise ValueError("--recipe / --locca-loss-weight / --self-distill-loss-weight / "
                             "--masked-prediction-loss-weight check a random window with decoder examples and view "
                             "seeds: without --distill-model, --multi-positive, --train-data or --checkpoint's data")
        recipe.prepare(setup.model, self_distill=self_distill)
        if args.multi_positive:
            if _uses_loader(args):
                raise ValueError("--multi-positive checks a random window of several captions per image: without "
                                 "--train-data or --checkpoint's data")
            loss_fn = MultiPositiveLoss(setup.loss, args.multi_positive_weighting, tile_size=args.loss_tile_size)
        if distill.enabled:  # the window objective: contrastive + λ·distill, the teacher's features constants
            loss_fn = distill.loss(setup.loss, args.loss_tile_size,
                                   args.multi_positive_weighting if args.multi_positive else None)
            teacher, setup.teacher_inputs = distill.teacher(setup.model, setup.hf_processor, setup.loss, args.cache_dir,
                                                            augment=args.augment)
            teacher = teacher.to(device, dtype)
        torch.manual_seed(args.seed)
        # eval: dropout would make the full batch and the splits draw different masks
        model = setup.model.to(device, dtype).eval()
        # the EMA teacher as at the switch: a copy of the student (its centres at zero)
        example_teacher = recipe.ema_teacher(model) if self_distill else None
        first_split = None
        if _uses_loader(args):
            batch, first_split = loader_window(args, setup)
            batch = to_device(batch, device, dtype)
        else:
            num_examples = args.num_examples or setup.accum_freq * (setup.reference_batch_size or 4)
            make = random_grouped_batch if args.multi_positive else random_naflex_batch
            batch = make(
                num_examples, patch_size=model.image_patch_size, context_length=model.context_length,
                generator=torch.Generator().manual_seed(args.seed), dtype=dtype, vocab_size=model.vocab_size,
            )
            if setup.teacher_inputs is not None:  # the teacher's own random inputs of the same images and texts
                own = random_naflex_batch(
                    max(num_examples, batch["text"].shape[0]), patch_size=teacher.image_patch_size,
                    context_length=teacher.context_length, generator=torch.Generator().manual_seed(args.seed + 2),
                    dtype=dtype, vocab_size=teacher.vocab_size)
                batch[TEACHER_INPUTS] = {"image": {key: value[:num_examples] for key, value in own["image"].items()},
                                         "text": own["text"][: batch["text"].shape[0]]}
            if recipe.locca_weight > 0:  # every task, causal and parallel, at the decoder's full width
                decoder = model.decoder
                batch[EXAMPLE_INPUTS] = random_decoder_inputs(num_examples, decoder.vocab, decoder.config.max_length,
                                                              torch.Generator().manual_seed(args.seed + 1))
            if self_distill:  # each example's seed of its local crops and patch mask
                seeds = torch.randint(0, 2**31 - 1, (num_examples,), generator=torch.Generator().manual_seed(args.seed))
                batch.setdefault(EXAMPLE_INPUTS, {})["view_seed"] = seeds
            batch = to_device(batch, device)
    except (ValueError, FileNotFoundError, DataError) as err:
        print(f"naflexclip verify: error: {err}")
        return 2
    methods = list(METHODS) if args.accum_method == "all" else [args.accum_method]
    result = verify_window(
        model, loss_fn, batch, accum_freq=setup.accum_freq,
        reference_batch_size=setup.reference_batch_size, loss_scale=setup.loss_scale, methods=methods,
        num_splits=args.splits, seed=args.seed, first_split=first_split, grad_checkpointing=args.grad_checkpointing,
        teacher=teacher, example_terms=example_terms, example_teacher=example_teacher,
    )
    source = "loader" if first_split else "random"
    print(
        f"window ({source}): {batch_size(batch)} examples, accum-freq {setup.accum_freq}, "
        f"B_ref {setup.reference_batch_size}, loss {setup.loss}, scale {setup.loss_scale} → s(W) = {result.scale:.6g}, "
        f"L(W) = {result.loss:.6g}"
    )
    checkpointing = "; grad checkpointing" if args.grad_checkpointing else ""
    print(f"splits: {result.splits}; methods: {', '.join(methods)}; {args.dtype} on {device}{checkpointing}")
    if args.multi_positive:
        print(f"objective: {'SigLIP+' if setup.loss == 'siglip' else 'multi-positive InfoNCE'} "
              f"({args.multi_positive_weighting}) over {batch_size(batch)} images and {batch['text'].shape[0]} "
              f"captions, group ids global over the window")
    if teacher is not None:
        own = ("" if setup.teacher_inputs is None else
               f"; it reads its own inputs of the same rows (patch size {setup.teacher_inputs.patch_size}, context "
               f"length {setup.teacher_inputs.context_length})")
        print(f"objective: contrastive + {distill.distill_loss_weight:g} · distill from --distill-model "
              f"{distill.distill_model} (the teacher's features constants of the window){own}")
    if recipe.locca_weight > 0:
        print(f"objective: {setup.loss} + {recipe.locca_weight:g} · LocCa decoder loss / the window's target tokens "
              f"(captioning, referring expressions, grounded captions; causal and parallel)")
    if self_distill:
        print(f"objective: + {recipe.value('self_distill_loss_weight'):g} · self-distillation "
              f"({recipe.value('local_crops')} local crops vs the EMA teacher's full image) / the window's examples "
              f"+ {recipe.value('masked_prediction_loss_weight'):g} · masked prediction "
              f"({recipe.value('mask_ratio'):g} of the patches masked) / the window's examples; the EMA teacher run "
              f"once per microbatch")
    locked = lock_summary(model)
    if locked:
        print(f"{locked}; the table lists the trainable parameters")
    print(format_table(result))
    verdict = "PASS" if result.passed else "FAIL"
    print(f"{verdict}: accumulated gradient {'equals' if result.passed else 'differs from'} "
          f"s(W)·∇L(W) of the full batch within the tolerances of docs/accumulation.md")
    return 0 if result.passed else 1
