"""`naflexclip export`: write a trained checkpoint as a transformers SigLIP 2 directory.

The directory holds `config.json`, `model.safetensors` and, for a run fine-tuned from an imported checkpoint,
that checkpoint's tokenizer and image-processor files; `transformers.Siglip2Model.from_pretrained` loads it
with the same outputs. A model transformers cannot express is refused in one line naming what does not map.
"""

from __future__ import annotations

import argparse
import sys

EXPORT_FORMATS = ("transformers",)


def run(args: argparse.Namespace) -> int:
    from naflexclip.siglip2 import export_model
    from naflexclip.train.checkpoint import load_checkpoint_model

    try:
        model, config = load_checkpoint_model(args.checkpoint)
        processor_dir = config.get("data", {}).get("hf_processor")
        out = export_model(model, args.out, format=args.format, processor_dir=processor_dir)
    except (ValueError, FileNotFoundError) as error:
        print(f"naflexclip export: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {out} (load with transformers.Siglip2Model.from_pretrained)")
    if not (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").is_file():
        # a preset trained from scratch used open_clip's tokenizer and timm's transform: nothing of transformers'
        print("note: no tokenizer or image-processor files (the run did not start from a SigLIP 2 directory; it "
              "used open_clip's tokenizer and OpenAI CLIP mean/std), add your own before using it in transformers")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a checkpoint as a transformers SigLIP 2 directory")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory, or a run's checkpoints/ (latest)")
    parser.add_argument("--format", default="transformers", choices=EXPORT_FORMATS)
    parser.add_argument("--out", required=True, help="output directory")
    parser.set_defaults(func=run)
