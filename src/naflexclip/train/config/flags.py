"""The flags of `naflexclip train`, generated from `TrainConfig`'s declarations (`naflexclip.settings`), and
`config_from_args`, the one place they become a TrainConfig; the command handlers are `train.train_command`.
"""

from __future__ import annotations

import argparse

from naflexclip.parallel.process_group import check_device
from naflexclip.settings import add_arguments, resolve_defaults, values_from_args

from ..resume import resumed_settings
from .openclip_flags import refused_message
from .train_config import TrainConfig

__all__ = ["add_train_args", "config_from_args", "with_defaults"]


def add_train_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of `TrainConfig` (its data flags included), one group per section; a flag whose OpenCLIP default
    differs from the built-in dataset's takes OpenCLIP's with --train-data (`with_defaults`) and says both."""
    add_arguments(parser, TrainConfig, openclip_with_data=True)


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every flag not given at its default: OpenCLIP's with --train-data, else the demo's."""
    return resolve_defaults(args, TrainConfig)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The one place flags become a TrainConfig (ValueError with a one-line, flag-naming message)."""
    refused = refused_message(args)
    if refused is not None:
        raise ValueError(refused)
    batch_size_given = "batch_size" in args  # no parser default (OpenCLIP's with --train-data)
    args = with_defaults(args)
    check_device(args.device)
    # OpenCLIP's --imagenet-val / --imagenet-v2 feed zero-shot too
    zero_shot_given = any(getattr(args, key, None) for key in ("zeroshot_data", "imagenet_val", "imagenet_v2"))
    # OpenCLIP's README drops --imagenet-val to skip zero-shot and keeps --zeroshot-frequency: there it classifies
    # nothing, so here too, said in one line at the start (a built-in note)
    if "zeroshot_frequency" in args and args.zeroshot_frequency != 0 and not zero_shot_given:
        args.openclip_built_in = [*getattr(args, "openclip_built_in", ()),
                                  f"--zeroshot-frequency {args.zeroshot_frequency}"]
    # OpenCLIP's --batch-size is rows per batch; here it is B_ref of --naflex-loss-scale only (the token budget sets
    # the rows): given without a scale it changes nothing, said in one line at the start
    if batch_size_given and args.naflex_loss_scale == "none":
        args.openclip_built_in = [*getattr(args, "openclip_built_in", ()), f"--batch-size {args.batch_size}"]
    values = values_from_args(TrainConfig, args)
    if getattr(args, "given", None) is not None and values.get("resume") is not None:  # the run's saved settings
        values = resumed_settings(values, args.given)
    return TrainConfig(**values)
