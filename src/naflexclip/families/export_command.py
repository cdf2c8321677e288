"""`naflexclip export`: a run's checkpoint as a pretrained family's directory (`--format transformers`, SigLIP 2)
or, for a run of an OpenCLIP model name, as an open_clip state dict (`--format openclip`).

Either format writes the towers only; what each writes and refuses, and how it loads back:
docs/siglip2.md#export and docs/openclip.md#export.
"""

from __future__ import annotations

import argparse
import sys

from naflexclip.families import EXPORT_FORMATS, export_family
from naflexclip.models.naflex_clip import HEAD_SLOTS, PRESETS


def run(args: argparse.Namespace) -> int:
    from naflexclip.models.run_weights import load_checkpoint_model

    config: dict = {}
    try:
        family = export_family(args.format)
        try:
            model, config = load_checkpoint_model(args.checkpoint)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"--checkpoint {args.checkpoint}: {str(error).splitlines()[0]}") from None
        processor_dir = config.get("data", {}).get("hf_processor")
        out = family.export(model, args.out, processor_dir)
    except (ValueError, FileNotFoundError) as error:
        # a preset has no other library's format; a new run needs none: it starts from the checkpoint itself
        hint = (f"; to start a new run from it, no export is needed: train --pretrained {args.checkpoint}"
                if config.get("model") in PRESETS and not config.get("pretrained") else "")
        print(f"naflexclip export: error: {str(error).splitlines()[0]}{hint}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    for note in family.export_notes(out):
        print(note)
    # the heads objectives attached (the model's config records them, attached or waiting for their objective)
    heads = {slot for slot in HEAD_SLOTS if getattr(getattr(model, "config", None), slot, None) is not None}
    if "decoder" in heads:  # SigLIP 2's recipe drops the decoder after training
        print("note: the LocCa decoder is not exported (the towers only); it stays in the run's checkpoint")
    if "self_distill" in heads:  # and the self-distillation heads and EMA teacher
        print("note: the self-distillation heads are not exported (the towers only); they and the EMA teacher "
              "stay in the run's checkpoint")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a checkpoint as a pretrained family's directory "
                                                  "(transformers SigLIP 2) or an open_clip checkpoint file")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory, or a run's checkpoints/ (latest)")
    parser.add_argument("--format", default="transformers", choices=EXPORT_FORMATS)
    parser.add_argument("--out", required=True,
                        help="output directory (transformers), or file (openclip: .pt, or .safetensors by its suffix)")
    parser.set_defaults(func=run)
