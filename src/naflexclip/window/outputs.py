"""What the window reads from a model: OpenCLIP's output dict (or open_clip's tuple), its keys, and the precision
the loss runs in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

FEATURE_KEYS = ("image_features", "text_features")
TOWER_FEATURES = {"image": "image_features", "text": "text_features"}  # the input each tower encodes → its output
SCALAR_KEYS = ("logit_scale", "logit_bias")
# open_clip's `CLIP` / `CustomTextCLIP` with `output_dict=False` (their default) return a tuple in this order
TUPLE_OUTPUT_KEYS = ("image_features", "text_features", "logit_scale", "logit_bias")


def output_dict(out: Any) -> dict[str, Any]:
    """A model's output as OpenCLIP's output dict: a mapping as it is; open_clip's tuple
    `(image_features, text_features, logit_scale[, logit_bias])` by position; anything else a one-line error."""
    if isinstance(out, Mapping):
        return dict(out)
    if isinstance(out, (tuple, list)) and 3 <= len(out) <= len(TUPLE_OUTPUT_KEYS):
        return {key: value for key, value in zip(TUPLE_OUTPUT_KEYS, out, strict=False) if value is not None}
    kind = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else f"a {type(out).__name__}"
    raise ValueError(f"model output is {kind}; expected OpenCLIP's output dict (image_features, text_features, "
                     f"logit_scale[, logit_bias]) or open_clip's tuple of those (build it with output_dict=True)")


def feature_sources(model: nn.Module) -> tuple[str, ...]:
    """The inputs (`image`, `text`) whose tower has no trainable parameter, as the model reports them through
    `locked_towers()` (a DDP wrapper's through its `.module`); a model without that method has none."""
    locked = getattr(getattr(model, "module", model), "locked_towers", None)
    names = locked() if locked is not None else ()
    return tuple(name for name in TOWER_FEATURES if name in names)


def loss_precision(t: torch.Tensor) -> torch.Tensor:
    """The loss is computed in at least float32 even when the towers ran in bf16/fp16."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
