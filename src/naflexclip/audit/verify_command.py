"""`naflexclip verify`: audit the accumulation window against one full batch, before a long run.

It builds a model (a preset, or a trained checkpoint), takes a window of NaFlex examples (random
sequences of varied lengths, or the first batches of `--train-data`), computes the full-batch reference
`s(W)·∇θ L(W)` in float64, then accumulates the same examples split at random into `--accum-freq`
microbatches with each chosen method, and prints the worst relative error per parameter group against
the tolerances of docs/accumulation.md. For contrast it also runs OpenCLIP's per-microbatch rule on the same splits.
Exit code 0 when every group passes, 1 otherwise. The audit itself is `naflexclip.audit.gradient_audit`, the random
windows `naflexclip.audit.random_windows`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from naflexclip.audit.gradient_audit import (
    VerifyResult,
    verify_window,
)
from naflexclip.audit.random_windows import random_naflex_batch
from naflexclip.batch import EXAMPLE_INPUTS, batch_size, concat_microbatches, to_device
from naflexclip.data import DataError, add_data_args, build_loader, data_config_from_args
from naflexclip.data.data_config import VERIFY_DATA_DEFAULTS
from naflexclip.families import data_processing
from naflexclip.families.factory import ModelSettings, create_model
from naflexclip.loss import create_loss
from naflexclip.models.lock import Locks, lock_summary
from naflexclip.models.run_weights import load_checkpoint_model
from naflexclip.objectives import registry
from naflexclip.objectives.objective import BuildContext, Objective
from naflexclip.parallel.process_group import DeviceSettings, check_device
from naflexclip.rng import Seed
from naflexclip.settings import CommandDefault, add_arguments
from naflexclip.window import METHODS
from naflexclip.window.window_settings import WindowSettings


def format_table(result: VerifyResult) -> str:
    """The report: per parameter group, the worst error, its tolerance and OpenCLIP's rule's."""
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


# verify's window where neither a flag nor a --checkpoint's run sets it: several microbatches, and the scale policy
# on (computed from the window's sizes and B_ref, not 1 by definition) so that it is audited too
WINDOW_FALLBACKS: dict[str, Any] = {"accum_freq": 4, "batch_size": 4, "naflex_loss_scale": "linear"}
# verify's own defaults of the settings it shares with train (declared once, in their groups), and why
VERIFY_DEFAULTS: dict[str, CommandDefault] = {
    "model": CommandDefault("tiny", "the float64 audit of the smallest preset takes seconds on a CPU"),
    "accum_method": CommandDefault("all", "each method against the same full-batch reference", more_choices=("all",)),
    "device": CommandDefault("cpu", "float64 is slow on most GPUs, and every machine has a CPU"),
    **{key: CommandDefault(None, "a trained model is audited as it was trained; else several microbatches, with "
                                 "the scale policy on", shown=f"a --checkpoint's, else {fallback}")
       for key, fallback in WINDOW_FALLBACKS.items()},
    # the locks of a --checkpoint's run (`_setup`)
    **{key: CommandDefault(None, "a trained model is audited as it was trained", shown=f"a --checkpoint's, else {off}")
       for key, off in Locks().as_dict().items()},
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check that accumulated gradients equal the full-batch gradient",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    # the flags verify shares with train, each declared once in its group; verify's own defaults: VERIFY_DEFAULTS
    for group in (ModelSettings, WindowSettings, DeviceSettings, Seed):
        add_arguments(parser, group, defaults=VERIFY_DEFAULTS)
    own = parser.add_argument_group("verify")
    own.add_argument("--checkpoint", default=None,
                     help="audit a trained model: a checkpoint directory, or a run's checkpoints/ (latest)")
    own.add_argument("--splits", type=int, default=3, help="random splits of the window to check")
    own.add_argument("--num-examples", type=int, default=None,
                     help="random window: examples in it (default: accum-freq × batch-size)")
    own.add_argument("--dtype", default="float64", choices=("float64", "float32"),
                     help="the audit's precision (its tolerances: docs/accumulation.md)")
    add_arguments(parser, Locks, defaults=VERIFY_DEFAULTS)
    for objective in registry.OBJECTIVES:  # every registered objective's flags
        add_arguments(parser, objective.flags)
    # a real window: the first --accum-freq batches the loader yields (with --train-data, --checkpoint,
    # or --dataset-type synthetic); its own split is checked first, then random re-splits
    add_data_args(parser, defaults=VERIFY_DATA_DEFAULTS)
    parser.set_defaults(func=run)


@dataclass
class VerifySetup:
    model: nn.Module
    loss: str
    accum_freq: int
    reference_batch_size: int | None
    loss_scale: str
    hf_processor: str | None = None  # a pretrained family's tokenizer and patching (SigLIP 2, an OpenCLIP name)
    objectives: list[Objective] = field(default_factory=list)  # the objectives the flags turn on, checked
    notes: list[str] = field(default_factory=list)  # what they changed for this model (`Objective.prepare`)


def _setup(args: argparse.Namespace) -> VerifySetup:
    """Model and window settings: flags first, then the checkpoint's training config, then defaults."""
    trained: dict[str, Any] = {}
    objectives = registry.enabled_objectives(args, training=False)
    kinds = [kind for objective in objectives if (kind := objective.pair_loss_kind())]
    if args.loss is None and kinds and not (args.checkpoint or args.pretrained):
        args.loss = kinds[0]  # --recipe siglip2: a model from scratch trains the sigmoid loss
    if args.checkpoint:
        try:
            model, trained = load_checkpoint_model(args.checkpoint)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"--checkpoint {args.checkpoint}: {str(error).splitlines()[0]}") from None
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

    locks = Locks(**{key: pick(getattr(args, key), key, default) for key, default in Locks().as_dict().items()})
    locks.apply(model)
    processor = trained.get("data", {}).get("hf_processor")
    name = model.config.openclip_name
    # an OpenCLIP name's tokenizer and mean/std: for its data, and for a teacher's to be compared with
    compared = any(objective.compares_processing for objective in objectives)
    if processor is None and name is not None and (_uses_loader(args, objectives) or compared):
        from naflexclip.families import openclip

        processor = openclip.processor_spec(name, openclip.tokenizer_dir(name, args.pretrained, args.cache_dir))
    window = {key: pick(getattr(args, key), key, fallback) for key, fallback in WINDOW_FALLBACKS.items()}
    setup = VerifySetup(model, loss, window["accum_freq"], window["batch_size"], window["naflex_loss_scale"], processor,
                        objectives)
    # what the objectives train beside the towers (a decoder, heads), after the locks: as the checkpoint's run had it
    setup.notes = [note for objective in objectives
                   for note in objective.prepare(model, image_locked=locks.image_fully_locked)]
    if setup.accum_freq < 1:
        raise ValueError(f"--accum-freq must be ≥ 1, got {setup.accum_freq}")
    if setup.reference_batch_size is not None and setup.reference_batch_size < 1:
        raise ValueError(f"--batch-size must be ≥ 1, got {setup.reference_batch_size}")
    if args.splits < 1:
        raise ValueError(f"--splits must be ≥ 1, got {args.splits}")
    if args.num_examples is not None and args.num_examples < setup.accum_freq:
        raise ValueError(f"--num-examples {args.num_examples} is smaller than --accum-freq {setup.accum_freq}")
    return setup


def _data_flag(args: argparse.Namespace) -> str | None:
    """The flag that names data to draw the window from, as given, or None."""
    if args.train_data:
        return f"--train-data {args.train_data}"
    return "--dataset-type synthetic" if args.dataset_type == "synthetic" else None


def _random_window_only(objectives: list[Objective]) -> str | None:
    """The flags of the objectives verify checks on a random window it draws itself (several captions per image,
    the recipe's decoder examples and view seeds), or None."""
    flags = [flag for objective in objectives if (flag := objective.random_window_flags())]
    return " and ".join(flags) or None


def _uses_loader(args: argparse.Namespace, objectives: list[Objective]) -> bool:
    """The window comes from data: a data flag, or --checkpoint's data unless an objective's window is random (then
    the checkpoint's model is checked on a random window)."""
    return bool(_data_flag(args) or (args.checkpoint and not _random_window_only(objectives)))


def loader_window(args: argparse.Namespace, setup: VerifySetup) -> tuple[dict[str, Any], list[int]]:
    """The first `accum_freq` microbatches of epoch 0, as one batch, and their sizes."""
    cfg = data_config_from_args(args)
    cfg.hf_processor = setup.hf_processor
    if cfg.patch_sizes(setup.model.image_patch_size) is not None:
        raise ValueError(f"--naflex-patch-sizes {' '.join(map(str, cfg.naflex_patch_sizes or ()))}: verify's "
                         "full-batch reference is one batch of the window's microbatches, so one patch size (mixed "
                         "sizes are exact in the window: tests/test_window_patch_sizes.py)")
    processing = data_processing(cfg.hf_processor, setup.model.image_patch_size, cfg.augment)
    with build_loader(cfg, split="train", patch_size=setup.model.image_patch_size,
                      context_length=setup.model.context_length, processing=processing,
                      inputs=[inputs for objective in setup.objectives
                              for inputs in objective.loader_inputs(setup.model, processing)]) as loader:
        microbatches = list(itertools.islice(iter(loader), setup.accum_freq))
    if len(microbatches) < setup.accum_freq:
        raise ValueError(f"--accum-freq {setup.accum_freq}: the data yields only {len(microbatches)} batches")
    return concat_microbatches(microbatches), [batch_size(mb) for mb in microbatches]


def run(args: argparse.Namespace) -> int:
    try:
        check_device(args.device)
        device = torch.device(args.device)
        torch.manual_seed(args.seed)  # the model's initialisation and the objectives' modules: the same every run
        setup = _setup(args)
        loss_fn = create_loss(setup.loss, tile_size=args.loss_tile_size)
        dtype = torch.float64 if args.dtype == "float64" else torch.float32
        random_only, data_flag = _random_window_only(setup.objectives), _data_flag(args)
        if random_only and data_flag:
            raise ValueError(f"{random_only} is checked on a random window verify draws itself, not on data: drop "
                             f"{data_flag} (with --checkpoint, the checkpoint's model is checked on a random window)")
        # the window objective: the pair loss as the objectives change it, what they read without training (a
        # teacher's features, constants of the window)
        for objective in setup.objectives:
            loss_fn = objective.loss(loss_fn, setup.loss, args.loss_tile_size)
        context = BuildContext(setup.model, setup.loss, setup.hf_processor, args.cache_dir, args.augment,
                               device=device, dtype=dtype)
        for objective in setup.objectives:
            objective.build(context)
        # eval: dropout would make the full batch and the splits draw different masks
        model = setup.model.to(device, dtype).eval()
        # every objective's terms of a window after all of its switches (the recipe's EMA teacher as at the switch)
        terms = [term for objective in setup.objectives for term in objective.verify_terms(model)]
        first_split = None
        if _uses_loader(args, setup.objectives):
            batch, first_split = loader_window(args, setup)
            batch = to_device(batch, device, dtype)
        else:
            num_examples = args.num_examples or setup.accum_freq * (setup.reference_batch_size
                                                                    or WINDOW_FALLBACKS["batch_size"])
            draw = functools.partial(random_naflex_batch, patch_size=model.image_patch_size,
                                     context_length=model.context_length, dtype=dtype, vocab_size=model.vocab_size)
            generator = torch.Generator().manual_seed(args.seed)
            shaped = [window for objective in setup.objectives
                      if (window := objective.random_window(num_examples, draw, generator)) is not None]
            batch = shaped[0] if shaped else draw(num_examples, generator=generator)
            for objective in setup.objectives:  # what the objectives read besides their terms (a teacher's inputs)
                objective.add_random_inputs(batch, num_examples, draw, args.seed)
            for term in terms:  # what each term reads of every example (a decoder's tokens, view seeds)
                inputs = term.random_inputs(model, num_examples, args.seed)
                if inputs:
                    batch.setdefault(EXAMPLE_INPUTS, {}).update(inputs)
            batch = to_device(batch, device)
    except (ValueError, FileNotFoundError, DataError) as err:
        print(f"naflexclip verify: error: {err}")
        return 2
    methods = list(METHODS) if args.accum_method == "all" else [args.accum_method]
    result = verify_window(
        model, loss_fn, batch, accum_freq=setup.accum_freq,
        reference_batch_size=setup.reference_batch_size, loss_scale=setup.loss_scale, methods=methods,
        num_splits=args.splits, seed=args.seed, first_split=first_split, grad_checkpointing=args.grad_checkpointing,
        terms=terms,
    )
    source = "loader" if first_split else "random"
    print(
        f"window ({source}): {batch_size(batch)} examples, accum-freq {setup.accum_freq}, "
        f"B_ref {setup.reference_batch_size}, loss {setup.loss}, scale {setup.loss_scale} → s(W) = {result.scale:.6g}, "
        f"L(W) = {result.loss:.6g}"
    )
    if args.checkpoint and not first_split:  # the trained model, its run's settings, a window verify draws
        print(f"the model of --checkpoint {args.checkpoint} with its run's settings, on a random window (its "
              f"objective's window is drawn here: {_random_window_only(setup.objectives)})")
    checkpointing = "; grad checkpointing" if args.grad_checkpointing else ""
    print(f"splits: {result.splits}; methods: {', '.join(methods)}; {args.dtype} on {device}{checkpointing}")
    for line in [line for objective in setup.objectives for line in objective.describe()] + setup.notes:
        print(f"objective: {line}")
    locked = lock_summary(model)
    if locked:
        print(f"{locked}; the table lists the trainable parameters")
    print(format_table(result))
    verdict = "PASS" if result.passed else "FAIL"
    print(f"{verdict}: accumulated gradient {'equals' if result.passed else 'differs from'} "
          f"s(W)·∇L(W) of the full batch within the tolerances of docs/accumulation.md")
    return 0 if result.passed else 1
