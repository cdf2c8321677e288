"""What fits on one GPU when fine-tuning SigLIP 2 with the exact window: an estimate from parameter counts and
activation bytes measured on a CPU.

- Parameters: counted on the `siglip2-base` / `siglip2-so400m` presets (built on the meta device), at
  16 bytes each for fp32 weights, gradients and the two AdamW moments, plus 2 for autocast's bf16 weight copies.
- Activations: the bytes autograd saves per token per layer in our towers under bf16 autocast, measured by
  counting saved tensors (`torch.autograd.graph.saved_tensors_hooks`) on 1- and 2-layer copies at two batch
  sizes (the slope removes weights and per-batch constants). A GPU's flash / memory-efficient attention saves
  no more than this; the CPU figure stands in for it.
- One microbatch's activations are alive at a time (the `cache` method replays microbatches one by one); the
  window adds only its features and their gradients (N × width × 16 bytes) and the tiled loss no N × N matrix.

Usage: `python benchmarks/siglip2_memory.py [--budgets 16384 32768 65536] [--seq-len 256]`. Prints the table
docs/siglip2.md quotes. It is an estimate: allocator fragmentation, the optimizer's temporaries and CUDA context
(~0.5-1 GB) come on top.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from naflexclip.models.naflex_clip import PRESETS, NaFlexClip

TEXT_TOKENS = 64  # SigLIP 2's context length: every caption is padded to it
GB = 1e9


def parameter_counts(name: str) -> tuple[int, int]:
    with torch.device("meta"):
        model = NaFlexClip(PRESETS[name])
    return (sum(p.numel() for p in model.visual.parameters()), sum(p.numel() for p in model.text.parameters()))


def _batch(rows: int, patch_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    grid = torch.stack(torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij"), -1).reshape(256, 2)
    image = {"patches": torch.randn(rows, 256, patch_size * patch_size * 3),
             "patch_coord": grid.expand(rows, 256, 2).contiguous(),
             "patch_valid": torch.ones(rows, 256, dtype=torch.bool)}
    return image, torch.randint(0, 1000, (rows, TEXT_TOKENS))


def _saved_bytes(encode, inputs) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        encode(inputs)
    return sum(storages.values())


def activation_bytes_per_token_layer(name: str) -> tuple[float, float]:
    """(image, text) bytes autograd saves per token per layer under bf16 autocast."""
    config = PRESETS[name]
    saved = {}
    for depth in (1, 2):
        small = dataclasses.replace(config, image=dataclasses.replace(config.image, depth=depth),
                                    text=dataclasses.replace(config.text, layers=depth, vocab_size=1000))
        model = NaFlexClip(small)
        for rows in (2, 4):
            image, text = _batch(rows, config.image.patch_size)
            saved[("image", depth, rows)] = _saved_bytes(model.encode_image, image)
            saved[("text", depth, rows)] = _saved_bytes(model.encode_text, text)

    def slope(tower: str, tokens_per_row: int) -> float:
        extra_layer = (saved[(tower, 2, 4)] - saved[(tower, 2, 2)]) - (saved[(tower, 1, 4)] - saved[(tower, 1, 2)])
        return extra_layer / (2 * tokens_per_row)

    return slope("image", 256), slope("text", TEXT_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--window", type=int, default=32768, help="examples per window for the feature cache line")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in ("siglip2-base", "siglip2-so400m"):
        image_params, text_params = parameter_counts(name)
        config = PRESETS[name]
        image_bytes, text_bytes = activation_bytes_per_token_layer(name)
        states = (image_params + text_params) * 18
        print(f"{name}: {image_params / 1e6:.0f} M image + {text_params / 1e6:.0f} M text parameters -> "
              f"{states / GB:.1f} GB weights, grads, AdamW, bf16 copies; activations "
              f"{image_bytes / config.image.width:.1f}·width (image), {text_bytes / config.text.width:.1f}·width "
              f"(text) bytes per token per layer")
        for budget in args.budgets:
            rows = budget // args.seq_len
            activations = (budget * image_bytes * config.image.depth
                           + rows * TEXT_TOKENS * text_bytes * config.text.layers)
            print(f"  {budget:>6} image tokens ({rows} rows): activations {activations / GB:5.1f} GB, "
                  f"total ~{(states + activations) / GB:5.1f} GB")
        cache = args.window * config.embed_dim * 16
        print(f"  window of {args.window} examples: cached features and their gradients {cache / GB:.2f} GB")


if __name__ == "__main__":
    main()
