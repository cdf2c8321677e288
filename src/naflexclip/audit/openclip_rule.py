"""The per-microbatch loss scale of OpenCLIP's accumulation loop, kept only as the counter-example.

`open_clip_train`'s `--accum-freq` replay differentiates a loss over the whole cached window once per
microbatch but multiplies each replay by a coefficient from *that microbatch's own* size. Splitting
the same examples as `[1, 2]` or `[2, 1]` then weights them differently. `naflexclip verify` and the
tests run this rule beside the window to show the comparison has teeth; training never uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from naflexclip.batch import GROUP_KEYS, batch_size, is_grouped
from naflexclip.window import Term, output_dict, window_loss_scale
from naflexclip.window.terms import example_losses, loss_input_keys, output_tokens, pair_loss_inputs


def per_microbatch_scale_gradients(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    microbatches: Sequence[dict[str, Any]],
    *,
    loss_scale: str,
    reference_batch_size: int | None,
    terms: Sequence[Term] = (),
) -> None:
    """Accumulate gradients with OpenCLIP's rule: replay j backpropagates `s([b_j]) · L(W)` (with a teacher's term,
    `loss_fn` is a `DistillLoss` and L(W) the sum of its terms), each per-example part divided by the microbatch's
    own count."""
    for term in terms:
        term.check(microbatches)
    with torch.no_grad():
        outputs = [output_dict(model(image=mb["image"], text=mb["text"])) for mb in microbatches]
        constants = [[term.constants(mb, contextlib.nullcontext) for mb in microbatches] for term in terms]
        pair = pair_loss_inputs(terms, constants)
        extra_inputs: tuple[Any, ...] = tuple(pair.get(key) for key, _ in loss_input_keys(terms))
    if is_grouped(microbatches[0]):  # the whole window's group ids follow the loss's scalars
        extra_inputs += tuple(torch.cat([mb[key] for mb in microbatches]) for key in GROUP_KEYS)
    cached_image = [out["image_features"] for out in outputs]
    cached_text = [out["text_features"] for out in outputs]
    for index, mb in enumerate(microbatches):
        out = output_dict(model(image=mb["image"], text=mb["text"], **output_tokens(terms)))
        losses = example_losses(terms, model, mb, out, [held[index] for held in constants])
        image = torch.cat(cached_image[:index] + [out["image_features"]] + cached_image[index + 1 :])
        text = torch.cat(cached_text[:index] + [out["text_features"]] + cached_text[index + 1 :])
        loss = loss_fn(image, text, out["logit_scale"], out.get("logit_bias"), *extra_inputs).sum()
        # the bug: a coefficient per replay, from this microbatch's size alone
        own_scale = window_loss_scale([batch_size(mb)], reference_batch_size, loss_scale)
        # and per-example terms normalised by the microbatch's own count (OpenCLIP's CoCa before #1209)
        loss = loss + sum(term.weights[name] * losses[name].sum() / term.count(mb)[name]
                          for term in terms for name in term.parts)
        (own_scale * loss).backward()
