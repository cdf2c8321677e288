"""OpenCLIP's training flags (`open_clip_train/params.py`) as `naflexclip train` treats each, and the --help
layout that groups the command's flags as OpenCLIP's and naflexclip's.

Every flag of OpenCLIP's parser is accepted (the train parser has it, with OpenCLIP's meaning), built in
(`BUILT_IN`: accepted, one line says what naflexclip does instead) or refused (`REFUSED`, and any flag no parser
block has added yet: one line naming it and why). `add_openclip_flags` registers the last two for every name the
parser lacks, so a flag a later parser block adds stops being refused. docs/training.md#openclips-flags-and-defaults.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

# every option string of open_clip_train's parser (main branch), in its order
OPENCLIP_FLAGS: tuple[str, ...] = (
    "--train-data", "--train-data-upsampling-factors", "--val-data", "--train-num-samples", "--val-num-samples",
    "--dataset-type", "--audio-ext", "--pretrained-audio", "--audio-fill", "--audio-trunc", "--audio-fusion",
    "--audio-int16-normalize", "--audio-zeroshot-dataset", "--audio-zeroshot-split", "--audio-zeroshot-audio-key",
    "--audio-zeroshot-target-key", "--audio-zeroshot-class-key", "--audio-zeroshot-template",
    "--audio-zeroshot-workers", "--audio-zeroshot-multiprocessing-context", "--audio-multiprocessing-context",
    "--dataset-resampled", "--csv-separator", "--csv-img-key", "--csv-caption-key", "--image-key",
    "--max-image-pixels", "--text-key", "--json-text-key", "--json-text-key-probs", "--imagenet-val",
    "--imagenet-v2", "--cache-dir", "--logs", "--log-local", "--name", "--workers", "--batch-size", "--epochs",
    "--epochs-cooldown", "--lr", "--beta1", "--beta2", "--eps", "--wd", "--momentum", "--warmup", "--opt",
    "--opt-kwargs", "--opt-fallback-list", "--text-layer-decay", "--image-layer-decay", "--visual-layer-decay",
    "--audio-layer-decay", "--wd-exclude", "--text-pooler-own-group", "--use-bn-sync", "--skip-scheduler",
    "--lr-scheduler", "--lr-cooldown-end", "--lr-cooldown-power", "--save-frequency", "--save-most-recent",
    "--zeroshot-frequency", "--val-frequency", "--val-retrieval-chunk-size", "--val-retrieval-precision",
    "--resume", "--precision", "--model", "--pretrained", "--pretrained-image", "--lock-image",
    "--lock-image-unlocked-groups", "--lock-image-freeze-bn-stats", "--image-mean", "--image-std",
    "--image-interpolation", "--image-resize-mode", "--aug-cfg", "--grad-checkpointing", "--local-loss",
    "--gather-with-grad", "--force-context-length", "--force-image-size", "--force-quick-gelu",
    "--force-patch-dropout", "--force-custom-text", "--torchcompile", "--torchcompile-strategy",
    "--torchcompile-backend", "--torchcompile-mode", "--accum-freq", "--device", "--dist-url", "--dist-backend",
    "--report-to", "--wandb-notes", "--wandb-project-name", "--debug", "--copy-codebase", "--ddp-static-graph",
    "--fsdp", "--fsdp-no-reshard-after-forward", "--fsdp-offload-cpu", "--fsdp-checkpoint", "--no-set-device-rank",
    "--seed", "--grad-clip-norm", "--lock-text", "--lock-text-unlocked-layers", "--lock-text-freeze-layer-norm",
    "--log-every-n-steps", "--log-metric-every-n-steps", "--train-loss-ema-samples", "--coca-caption-loss-weight",
    "--coca-contrastive-loss-weight", "--remote-sync", "--remote-sync-frequency", "--remote-sync-protocol",
    "--delete-previous-checkpoint", "--distill-model", "--distill-pretrained", "--use-bnb-linear", "--siglip",
    "--loss-dist-impl", "--use-naflex", "--force-naflex-vision", "--naflex-num-train-image-tokens",
    "--naflex-patch-sizes", "--naflex-patch-size-probs", "--naflex-seq-lens", "--naflex-seq-len-probs",
    "--naflex-max-tokens-per-batch", "--naflex-max-text-tokens", "--naflex-batch-divisor", "--naflex-loss-scale",
    "--length-bucketing", "--bucket-pool", "--bucket-chunk", "--bucket-prefetch-pools", "--naflex-pad-multiple",
    "--text-pad-multiple",
    # released open_clip_train (3.x) only
    "--horovod", "--torchscript", "--trace",
)

# accepted: flag -> (takes a value, what naflexclip does instead; printed once at the start of the run)
BUILT_IN: dict[str, tuple[bool, str]] = {
    "--local-loss": (False, "each rank already computes ~1/R of the window's loss, its rows against every rank's "
                            "features (docs/accumulation.md#the-loss-at-scale)"),
    "--gather-with-grad": (False, "the gradient of every gathered feature already reaches the rank that computed "
                                  "it: the window's gradient is exact across ranks"),
    "--loss-dist-impl": (True, "the loss across ranks is always naflexclip's sharded, tiled one"),
    "--use-naflex": (False, "every run is NaFlex: token-budget microbatches at each image's own aspect ratio"),
    "--force-naflex-vision": (False, "the image tower always is timm's NaFlexVit"),
    "--force-custom-text": (False, "the text tower always is a separate module (model.text)"),
    "--lock-image-freeze-bn-stats": (False, "a NaFlex ViT has no BatchNorm statistics to freeze"),
    "--use-bn-sync": (False, "a NaFlex ViT has no BatchNorm to synchronise"),
    "--image-resize-mode": (True, "NaFlex resizes each image to its patch budget at its own aspect ratio "
                                  "(no square resize or crop)"),
}

_AUDIO = "audio (CLAP) training; naflexclip trains image-text models"
_COCA = "CoCa's captioning loss; naflexclip trains contrastive image-text models (CLIP, SigLIP)"
_NOT_YET = "not supported by naflexclip yet"
# refused: flag -> why (a flag of OPENCLIP_FLAGS that is neither accepted, built in nor here: _NOT_YET)
REFUSED: dict[str, str] = {
    **{flag: _AUDIO for flag in OPENCLIP_FLAGS if "audio" in flag},
    "--coca-caption-loss-weight": _COCA, "--coca-contrastive-loss-weight": _COCA,
    "--naflex-max-text-tokens": "GenLIP's caption token cap; naflexclip trains contrastive image-text models",
    "--naflex-pad-multiple": "NaFlex audio padding; naflexclip pads each microbatch to its sequence length",
    "--pretrained-image": "timm ImageNet weights would be downloaded; naflexclip downloads nothing",
    "--copy-codebase": "naflexclip runs from its installed package (the run folder records the config)",
    "--use-bnb-linear": "bitsandbytes linear layers are not supported",
    "--force-quick-gelu": "the presets fix their activation (GELU)",
    "--length-bucketing": "samples keep their order (the exact window and resume rely on it)",
    "--bucket-pool": "goes with --length-bucketing, which is refused",
    "--bucket-chunk": "goes with --length-bucketing, which is refused",
    "--bucket-prefetch-pools": "goes with --length-bucketing, which is refused",
    "--horovod": "Horovod launches are not supported (torchrun)",
    "--torchscript": "TorchScript models are not supported",
    "--trace": "TorchScript tracing is not supported",
}


def status(flag: str, parser: argparse.ArgumentParser) -> str:
    """'accepted', 'built in' or 'refused': how `parser` (the train parser) treats OpenCLIP's `flag`."""
    action = parser._option_string_actions.get(flag)
    if isinstance(action, _Refused):
        return "refused"
    if isinstance(action, _BuiltIn):
        return "built in"
    return "accepted" if action is not None else "missing"


class _BuiltIn(argparse.Action):
    """Accepts the flag (and its value) and records it for the run's one-line note."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = list(getattr(namespace, self.dest, None) or [])
        value = values[0] if isinstance(values, list) and values else None
        given.append(self.option_strings[0] + (f" {value}" if value is not None else ""))
        setattr(namespace, self.dest, given)


class _Refused(argparse.Action):
    """Takes whatever follows the flag and records why it is refused; `config_from_args` reports the first in one
    line (not argparse's usage block)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        refused = list(getattr(namespace, self.dest, None) or [])
        refused.append(f"{option_string}: OpenCLIP's flag is refused here: {self.reason}")
        setattr(namespace, self.dest, refused)


def add_openclip_flags(parser: argparse.ArgumentParser) -> None:
    """Register OpenCLIP's built-in and refused flags that `parser` does not have (call it last)."""
    built_in = parser.add_argument_group(
        "OpenCLIP's flags built in here (accepted; the run's first lines say what naflexclip does instead)")
    parser.set_defaults(openclip_built_in=[], openclip_refused=[])
    refused_names = []
    for flag in OPENCLIP_FLAGS:
        if flag in parser._option_string_actions:
            continue
        if flag in BUILT_IN:
            takes_value, what = BUILT_IN[flag]
            built_in.add_argument(flag, dest="openclip_built_in", action=_BuiltIn, nargs=1 if takes_value else 0,
                                  metavar="VALUE", default=argparse.SUPPRESS, help=what)
        else:
            # listed in the epilog, not one by one
            action = parser.add_argument(flag, dest="openclip_refused", action=_Refused, nargs="*",
                                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            action.reason = REFUSED.get(flag, _NOT_YET)
            refused_names.append(flag)
    parser.epilog = textwrap.fill(
        "OpenCLIP's flags refused here (each stops the run with one line naming it and why): "
        + " ".join(refused_names), width=100, break_on_hyphens=False)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown once — not where the help already states its default, nor an empty or None one (a default
    that depends on the data is said in the help); the epilog's flag list kept as wrapped (argparse would break the
    names at hyphens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, "", argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def refused_message(args: argparse.Namespace) -> str | None:
    """The one-line error of the first refused OpenCLIP flag on the command line, or None."""
    refused = getattr(args, "openclip_refused", None)
    return refused[0] if refused else None


# OpenCLIP's flags that, given as they were, change nothing in this run (`config_from_args` records them with the
# built-in ones): what the run's note says
WITHOUT_EFFECT: dict[str, str] = {
    "--zeroshot-frequency": "nothing to classify (no --zeroshot-data / --imagenet-val / --imagenet-v2), so zero-shot "
                            "does not run",
    "--batch-size": "with --naflex-loss-scale none (the default) it has no effect: the rows of each microbatch come "
                    "from the token budget (--naflex-max-tokens-per-batch, --naflex-seq-lens)",
}


def built_in_notes(flags: list[str] | tuple[str, ...]) -> list[str]:
    """One line per built-in flag given (`--flag [value]`): what naflexclip does instead (or that it changes
    nothing, `WITHOUT_EFFECT`)."""
    notes = {**{flag: what for flag, (_, what) in BUILT_IN.items()}, **WITHOUT_EFFECT}
    return [f"{flag}: OpenCLIP's flag is accepted; {notes[flag.split()[0]]}" for flag in flags]


def group_by_origin(parser: argparse.ArgumentParser) -> None:
    """Re-group --help: every topic group split into OpenCLIP's flags (named as in `OPENCLIP_FLAGS`, same meaning)
    and naflexclip's own, OpenCLIP's groups first. Later flag blocks need nothing: the name decides."""
    openclip = set(OPENCLIP_FLAGS)
    fixed, theirs, ours, tail = parser._action_groups[:2], [], [], []
    for group in parser._action_groups[2:]:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
        if group.title and group.title.startswith("OpenCLIP's flags built in"):
            tail.append(group)
            continue
        for target, keep, origin in ((theirs, True, "OpenCLIP's flags"), (ours, False, "naflexclip's flags")):
            picked = [a for a in actions if bool(set(a.option_strings) & openclip) == keep]
            if picked:
                title = (group.title or "").replace(" (OpenCLIP's flags)", "")
                new = argparse._ArgumentGroup(parser, f"{origin}: {title}")
                new._group_actions = picked
                target.append(new)
    parser._action_groups = fixed + theirs + ours + tail


def first_lines(config: dict[str, Any]) -> list[str]:
    """The run's first lines (`config`: `TrainConfig.to_dict()`): its settings that differ from OpenCLIP's defaults
    (on the built-in dataset: the demo's), then what each built-in OpenCLIP flag given means here."""
    from .settings_display import openclip_differences

    differences = openclip_differences(config)
    builtin_data = not config["data"].get("train_data")
    lines = []
    if differences:
        head = ("settings that differ from OpenCLIP's defaults" if not builtin_data else
                "built-in dataset: the demo's settings, which differ from OpenCLIP's defaults")
        lines.append(f"{head}: " + ", ".join(differences))
    return lines + built_in_notes(config.get("openclip_built_in", ()))
