"""The per-microbatch loss scale of OpenCLIP's accumulation loop, kept only as the counter-example.

`open_clip_train`'s `--accum-freq` replay differentiates a loss over the whole cached window once per
microbatch but multiplies each replay by a coefficient from *that microbatch's own* size. Splitting
the same examples as `[1, 2]` or `[2, 1]` then weights them differently. `naflexclip verify` and the
tests run this rule beside the window to show the comparison has teeth; training never uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from naflexclip.batch import EXAMPLE_INPUTS, GROUP_KEYS, batch_size, is_grouped, teacher_inputs
from naflexclip.window import EXAMPLE_TERMS, ExampleTerm, output_dict, window_loss_scale


def per_microbatch_scale_gradients(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    microbatches: Sequence[dict[str, Any]],
    *,
    loss_scale: str,
    reference_batch_size: int | None,
    teacher: nn.Module | None = None,
    example_terms: Sequence[ExampleTerm] = (),
    example_teacher: Callable[..., dict[str, Any]] | None = None,
) -> None:
    """Accumulate gradients with OpenCLIP's rule: replay j backpropagates `s([b_j]) · L(W)` (with a teacher,
    `loss_fn` is a `DistillLoss` and L(W) the sum of its terms)."""
    with torch.no_grad():
        outputs = [output_dict(model(image=mb["image"], text=mb["text"])) for mb in microbatches]
        extra_inputs: tuple[Any, ...] = ()
        if teacher is not None:
            taught = [output_dict(teacher.eval()(**teacher_inputs(mb))) for mb in microbatches]
            extra_inputs = (torch.cat([out["image_features"] for out in taught]),
                              torch.cat([out["text_features"] for out in taught]),
                              taught[0]["logit_scale"], taught[0].get("logit_bias"))
    if is_grouped(microbatches[0]):  # the whole window's group ids follow the loss's scalars
        extra_inputs += tuple(torch.cat([mb[key] for mb in microbatches]) for key in GROUP_KEYS)
    cached_image = [out["image_features"] for out in outputs]
    cached_text = [out["text_features"] for out in outputs]
    for index, mb in enumerate(microbatches):
        targets = {}
        if example_teacher is not None:
            with torch.no_grad():
                targets = {"teacher_targets": example_teacher(image=mb["image"])}
        out = output_dict(model(image=mb["image"], text=mb["text"],
                                **(mb.get(EXAMPLE_INPUTS, {}) if example_terms else {}), **targets))
        image = torch.cat(cached_image[:index] + [out["image_features"]] + cached_image[index + 1 :])
        text = torch.cat(cached_text[:index] + [out["text_features"]] + cached_text[index + 1 :])
        loss = loss_fn(image, text, out["logit_scale"], out.get("logit_bias"), *extra_inputs).sum()
        # the bug: a coefficient per replay, from this microbatch's size alone
        own_scale = window_loss_scale([batch_size(mb)], reference_batch_size, loss_scale)
        # and per-example terms normalised by the microbatch's own count (OpenCLIP's CoCa before #1209)
        loss = loss + sum(term.weight * out[EXAMPLE_TERMS][term.name].sum() / term.count(mb) for term in example_terms)
        (own_scale * loss).backward()
