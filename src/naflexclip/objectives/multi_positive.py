"""Several captions per image as several positives (`--multi-positive`): every caption of an image is a text row
with the image's group id, and the pair loss becomes the multi-positive loss (`naflexclip.loss.MultiPositiveLoss`:
multi-positive InfoNCE for clip, SigLIP+ for siglip).
docs/accumulation.md#the-window-objective-several-captions-per-image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from naflexclip.loss import MULTI_POSITIVE_WEIGHTINGS, MultiPositiveLoss
from naflexclip.objectives.objective import Objective
from naflexclip.settings import APPLY, setting

_CAPTIONS = "several captions per image"


@dataclass
class MultiPositiveFlags:
    """The flags of several captions per image (each field a setting, `naflexclip.settings`)."""

    multi_positive: bool = setting(False, rule=APPLY, section=_CAPTIONS, help=(
        "every caption of an image is a text row and a positive of it (group ids over the window): clip: "
        "multi-positive InfoNCE; siglip: SigLIP+ (without it: one caption per image per epoch)"))
    multi_positive_weighting: str = setting("symmetric", rule=APPLY, section=_CAPTIONS,
                                            choices=tuple(MULTI_POSITIVE_WEIGHTINGS), help=(
        "SigLIP+'s positive weights α/k_i + β/k'_j: symmetric ½, ½; asymmetric 1, 0; soft: as labels"))


def grouped_window(num_images: int, draw: Callable[..., dict[str, Any]], generator: torch.Generator,
                   max_captions: int = 3) -> dict[str, Any]:
    """A grouped window: `num_images` images from `draw(n, generator=generator)`, each with 1 to `max_captions`
    captions (its group), the captions in image order; group ids `image_group [N]`, `text_group [M]`."""
    captions = torch.randint(1, max_captions + 1, (num_images,), generator=generator)
    images = draw(num_images, generator=generator)
    texts = draw(int(captions.sum()), generator=generator)["text"]
    ids = torch.randperm(10 * num_images, generator=generator)[:num_images]
    return {"image": images["image"], "text": texts, "image_group": ids,
            "text_group": torch.repeat_interleave(ids, captions)}


class MultiPositive(Objective):
    """Several captions per image: the pair loss with group ids, the loader's microbatches grouped."""

    name = "multi_positive"
    flags = MultiPositiveFlags
    switch_flags = "--multi-positive"
    switch_fields = ("multi_positive",)

    def __init__(self, values: Any) -> None:
        self.values = MultiPositiveFlags(**{key: getattr(values, key) for key in asdict(MultiPositiveFlags())})
        self.kind = "clip"  # the pair loss's, once `loss` has been asked

    @property
    def enabled(self) -> bool:
        return self.values.multi_positive

    def check(self, values: Any, training: bool = True) -> None:
        weighting = self.values.multi_positive_weighting
        if weighting not in MULTI_POSITIVE_WEIGHTINGS:
            raise ValueError(f"--multi-positive-weighting: {weighting!r} is not one of "
                             f"{sorted(MULTI_POSITIVE_WEIGHTINGS)}")
        data = getattr(values, "data", None)
        if self.enabled and data is not None:  # every caption of a sample becomes a text row with its group id
            data.multi_caption = True

    def loss(self, loss: nn.Module, kind: str, tile_size: int) -> nn.Module:
        self.kind = kind
        return MultiPositiveLoss(kind, self.values.multi_positive_weighting, tile_size=tile_size)

    def random_window_flags(self) -> str | None:
        return "--multi-positive"

    def random_window(self, num_examples: int, draw: Callable[..., dict[str, Any]],
                      generator: torch.Generator) -> dict[str, Any] | None:
        return grouped_window(num_examples, draw, generator)

    def describe(self) -> list[str]:
        loss = "SigLIP+" if self.kind == "siglip" else "multi-positive InfoNCE"
        return [f"several captions per image (--multi-positive): every caption a positive of its image under "
                f"{loss} ({self.values.multi_positive_weighting}), group ids global over the window"]
