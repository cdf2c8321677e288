"""Several captions per image: retrieval on built-in validation scenes that carry 2-5 captions each.

For each checkpoint: image→text R@1 (the top caption is one of the image's own), text→image R@1 (the top image
is the caption's own), and the share of same-image captions ranked as negatives: an image with k captions should
rank its own k first; an own caption outside the image's top k sits where a negative should (1 − R-precision, the
retrieval metric for several relevant items). Run it on a model trained with `--multi-positive` and one trained
one-hot on the same data (`--synthetic-multi-caption` without it):

    naflexclip train --model tiny --synthetic-multi-caption --name tiny_onehot
    naflexclip train --model tiny --synthetic-multi-caption --multi-positive --name tiny_multipos
    python benchmarks/multi_caption.py logs/tiny_onehot/checkpoints logs/tiny_multipos/checkpoints
"""

from __future__ import annotations

import argparse

import torch

from naflexclip.data.synthetic import synthetic_captions
from naflexclip.models.run_weights import load_checkpoint_model
from naflexclip.processing.naflex_transform import default_processing


@torch.no_grad()
def evaluate(checkpoint: str, num_images: int, seq_len: int, seed: int) -> dict[str, float]:
    model, _ = load_checkpoint_model(checkpoint)
    processing = default_processing(model.image_patch_size)
    images, captions, owner = [], [], []
    for index in range(num_images):
        image, texts = synthetic_captions(seed, "val", index)
        images.append(processing.transform(image, seq_len))
        captions += texts
        owner += [index] * len(texts)
    image_features = model.encode_image(processing.collate(images, seq_len, model.image_patch_size))
    text_features = model.encode_text(processing.tokenize(captions, model.context_length))
    scores = image_features @ text_features.T  # [images, captions]
    owner_t = torch.tensor(owner)
    own = owner_t[None, :] == torch.arange(num_images)[:, None]
    image_to_text = own.gather(1, scores.argmax(1, keepdim=True)).float().mean()
    text_to_image = (scores.argmax(0) == owner_t).float().mean()
    counts = own.sum(1)
    ranks = scores.argsort(1, descending=True).argsort(1)  # 0 = the image's best caption
    ranked_as_negative = (ranks >= counts[:, None])[own].float().mean()
    return {"image_to_text_R@1": float(image_to_text), "text_to_image_R@1": float(text_to_image),
            "own_captions_ranked_as_negatives": float(ranked_as_negative), "captions": float(len(captions))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--num-images", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64, help="patches per image (the demo's middle length)")
    parser.add_argument("--seed", type=int, default=0, help="the built-in dataset's --synthetic-seed")
    args = parser.parse_args()
    print("| checkpoint | image→text R@1 | text→image R@1 | own captions ranked as negatives |")
    print("| --- | --- | --- | --- |")
    for checkpoint in args.checkpoints:
        metrics = evaluate(checkpoint, args.num_images, args.seq_len, args.seed)
        print(f"| {checkpoint} | {metrics['image_to_text_R@1']:.3f} | {metrics['text_to_image_R@1']:.3f} | "
              f"{metrics['own_captions_ranked_as_negatives']:.3f} |")
    print(f"({args.num_images} validation scenes, {int(metrics['captions'])} captions, {args.seq_len} patches)")


if __name__ == "__main__":
    main()
